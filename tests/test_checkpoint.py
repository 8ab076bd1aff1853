"""Checkpointing and resume: kill / SIGTERM / reshard / damaged steps / finetuning,
each against the uninterrupted run."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import FAST_XLA, ROOT, TRAIN_BASE, complete_steps, record_scalars, tensorboard_scalars, train_command

# Runs that a signal stops: far longer than any test waits, so that however fast the
# machine the signal always lands mid-run (they never get near the end).
ENDLESS = "--config.steps=1000000"


def train(workdir, *extra, devices=1):
  """Run train.py to the end; its output."""
  cmd, env = train_command(workdir, extra, devices)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:]
  return proc.stdout


@pytest.fixture
def start():
  """start(workdir, *extra) launches train.py in the background, its output going to
  `<workdir>.log` (a file, not a pipe nobody reads, which could fill and stall the run).
  Whatever a test leaves running is killed when it ends."""
  procs = []

  def launch(workdir, *extra, devices=1):
    cmd, env = train_command(workdir, extra, devices)
    log_path = Path(f"{workdir}.log")
    with open(log_path, "w") as log:
      proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log_path
    procs.append(proc)
    return proc

  yield launch
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def output(proc) -> str:
  return proc.log_path.read_text()


def losses(workdir) -> dict[int, float]:
  """step -> loss."""
  rows = [json.loads(l) for l in open(Path(workdir) / "metrics.jsonl")]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def logged_steps(workdir) -> list[int]:
  """The steps in metrics.jsonl so far, read while the run writes it (a line being
  written is skipped)."""
  path = Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  steps = []
  for line in path.read_text().splitlines(keepends=True):
    if line.endswith("\n") and '"loss"' in line:
      steps.append(json.loads(line)["step"])
  return steps


def wait_until(proc, condition, what, timeout=240):
  """Poll until `condition()`; fail if the run ends first (it cannot finish: see ENDLESS).
  The timeout only bounds a hung run."""
  t0 = time.monotonic()
  while not condition():
    assert proc.poll() is None, f"the run ended before {what}:\n" + output(proc)[-3000:]
    assert time.monotonic() - t0 < timeout, f"no {what} after {timeout} s:\n" + output(proc)[-3000:]
    time.sleep(0.1)


def resumed_at(out) -> int:
  found = re.findall(r"resumed from \S+ at step (\d+)", out)
  assert len(found) == 1, out[-3000:]
  return int(found[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("ref")
  train(workdir)
  return workdir


@pytest.fixture(scope="module")
def uninterrupted(reference, tmp_path_factory):
  """uninterrupted(n): step -> loss of steps 1..n of a run that nothing stopped. The
  6-step reference serves up to 6; a longer one is run (once) when a signal landed
  later, as it may on a fast machine. (The schedule is constant, so the first n
  losses do not depend on the run's length.)"""
  longest = {"steps": 6, "losses": losses(reference)}

  def first(n):
    if n > longest["steps"]:
      workdir = tmp_path_factory.mktemp("uninterrupted")
      train(workdir, f"--config.steps={n}", "--config.checkpoint_every=0")
      longest.update(steps=n, losses=losses(workdir))
    return {s: l for s, l in longest["losses"].items() if s <= n}

  return first


def test_uninterrupted_run_saves_keep_last_k(reference):
  assert complete_steps(reference) == [2, 4, 6]
  assert sorted(losses(reference)) == [1, 2, 3, 4, 5, 6]


# A hybrid (Mamba-2, Mamba-3 MIMO, attention, MLP, mixture-of-experts layers): its own
# parameter stacks and optimizer state, the routers' correction biases the steps move, and
# Mamba-3's data-dependent A, trapezoid, rotation and MIMO projections beside Mamba-2's.
HYBRID = ["--config.model.layer_pattern=M3*-E", "--config.model.n_layer=5",
          "--config.model.is_mimo=true", "--config.model.mimo_rank=2",
          "--config.model.attn_num_heads=4", "--config.model.attn_num_heads_kv=2",
          "--config.model.attn_head_dim=16", "--config.model.d_intermediate=128",
          "--config.model.n_routed_experts=4", "--config.model.num_experts_per_tok=2",
          "--config.model.moe_intermediate_size=32", "--config.model.moe_shared_expert_intermediate_size=32"]


def test_sigkill_and_restart_gives_identical_losses(tmp_path, start):
  """Killed mid-run and restarted, a run gives the losses it would have given, bit
  for bit. On a hybrid (its Mamba-2, Mamba-3 MIMO, attention, MLP and MoE stacks and
  their optimizer state; the pure model's resume is held below, by SIGTERM), in two runs: the
  killed run itself is the uninterrupted reference for the steps it logged past
  its newest checkpoint."""
  work = tmp_path / "run"
  proc = start(work, ENDLESS, *HYBRID)
  seen = []  # the newest checkpoint when the run had logged two steps past it

  def past_save():
    done = complete_steps(work)
    if done and max(logged_steps(work), default=0) >= done[-1] + 2:
      seen.append(done[-1])
    return bool(seen)

  wait_until(proc, past_save, "two steps past a checkpoint")
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  # On a fast machine the run may save again before the kill lands, with fewer than two
  # steps logged past that save: resume from the checkpoint seen instead (as if it had
  # died then), so the check does not depend on how far the run got.
  killed_at = seen[0]
  for step in complete_steps(work):
    if step > killed_at:
      shutil.rmtree(work / "checkpoints" / str(step))
  before = losses(work)
  end = killed_at + 2
  assert all(s in before for s in range(1, end + 1))
  out = train(work, f"--config.steps={end}", *HYBRID)
  assert resumed_at(out) == killed_at
  after = losses(work)  # steps after the checkpoint, logged again by the resumed run
  assert {s: after[s] for s in range(1, end + 1)} == {s: before[s] for s in range(1, end + 1)}
  # Each step once: the rows the killed run logged after its checkpoint were set aside.
  rows = [json.loads(l) for l in open(work / "metrics.jsonl")]
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, end + 1))
  assert {"step": killed_at, "event": "resumed"}.items() <= rows[killed_at].items()
  # TensorBoard holds the same record: every scalar of every kept row (the router's
  # figures among them), once a step; the killed run's later steps gone with their rows.
  assert tensorboard_scalars(work / "tensorboard") == record_scalars(rows)
  assert {"loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "goodput", "moe_aux_loss"} <= set(record_scalars(rows))
  # The routers' statistics, bit-exact too: tokens per expert of the one 'E' layer.
  loads = {r["step"]: r["moe_tokens_per_expert"] for r in rows if "loss" in r}
  assert all(sum(loads[s][0]) == 8 * 32 * 2 for s in loads)


def test_sigterm_saves_exits_cleanly_and_resumes(uninterrupted, tmp_path, start):
  work = tmp_path / "run"
  proc = start(work, ENDLESS, "--config.checkpoint_every=0")
  # No periodic saves: wait for step 2 in the log, then preempt.
  wait_until(proc, lambda: max(logged_steps(work), default=0) >= 2, "step 2 in metrics.jsonl")
  seen = max(logged_steps(work))
  proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=120)
  out = output(proc)
  assert proc.returncode == 0, out[-2000:]
  # One save, of the step the run was on when the signal came: the last step it trained.
  saved = complete_steps(work)
  assert len(saved) == 1 and saved[0] == max(losses(work)) and seen <= saved[0], (saved, seen)
  assert f"SIGTERM received: saving step {saved[0]} and exiting" in out
  end = saved[0] + 2
  out = train(work, "--config.checkpoint_every=0", f"--config.steps={end}")
  assert resumed_at(out) == saved[0]
  assert losses(work) == uninterrupted(end)


def test_reshard_restore_onto_fewer_devices(tmp_path):
  """Save on 8 devices (data=2 x fsdp=4), continue on 1: every array gathered from its
  shards. (Onto 4 devices at fsdp 4 is the same restore into another sharding, a train.py
  process more out of the suite's ten minutes; tests/test_sequence_parallel.py moves a
  checkpoint between meshes both ways in one process.)"""
  src = tmp_path / "eight"
  train(src, "--config.mesh.data=2", "--config.mesh.fsdp=4", devices=8)
  full = losses(src)
  for devices, mesh in ((1, ["--config.mesh.data=1", "--config.mesh.fsdp=1"]),):
    dst = tmp_path / f"on{devices}"
    shutil.copytree(src, dst)
    for s in (4, 6):  # resume from step 2
      os.rename(dst / "checkpoints" / str(s), dst / "checkpoints" / f"{s}.later")
    (dst / "metrics.jsonl").unlink()
    out = train(dst, *mesh, devices=devices)
    assert "at step 2" in out
    got = losses(dst)
    assert sorted(got) == [3, 4, 5, 6]
    for step in got:
      assert abs(got[step] - full[step]) <= 1e-5 * abs(full[step]), (devices, step)


def test_damaged_newest_checkpoint_falls_back(reference, tmp_path, caplog):
  from mamba_train.data import SyntheticLoader
  from mamba_train.workdir import checkpoint
  work = tmp_path / "w"
  shutil.copytree(reference, work)
  for f in (work / "checkpoints" / "6" / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
      f.write_bytes(b"\0" * 7)  # damage the array data, keep the layout
  ck = checkpoint.Checkpointer(work, keep=3)
  meta = ck.manager.item_metadata(4)["state"]
  tree = meta.tree if hasattr(meta, "tree") else meta
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree,
                        is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  loader = SyntheticLoader(vocab_size=257, seq_len=32, global_batch_size=8, seed=0)
  with caplog.at_level(logging.WARNING):
    step, state = ck.restore(target, loader)
  assert step == 4 and int(state["step"]) == 4
  assert loader.index == 4  # the data iterator is where it was at step 4
  text = caplog.text
  assert "step 6" in text and "resuming from step 4 instead of the newest step 6" in text
  assert (work / "checkpoints" / "6.damaged").exists()  # moved aside, not deleted
  ck.close()
  # train.py then continues from 4 and reproduces the uninterrupted losses.
  train(work)
  assert losses(work) == losses(reference)


def test_shape_mismatch_and_other_model_are_refused(reference, tmp_path):
  work = tmp_path / "w"
  shutil.copytree(reference, work)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA)
  cmd = [sys.executable, str(ROOT / "train.py"), "--workdir", str(work), *TRAIN_BASE,
         "--config.model.d_state=32", "--config.steps=8"]
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode != 0
  assert "holds checkpoints of another model" in r.stderr and "d_state" in r.stderr
  assert "--force_resume" in r.stderr
  r = subprocess.run(cmd + ["--force_resume"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode != 0
  assert "does not fit the model config" in r.stderr and "in_proj_bc" in r.stderr
  assert complete_steps(work) == [2, 4, 6]  # nothing deleted


def test_finetune_from_checkpoint(reference, tmp_path):
  from mamba_train import load_model
  # One step: its learning rate is the warmup's first, 0 (see TRAIN_BASE), so the finetuned parameters must
  # be exactly those it started from. (optim.lr itself must be positive.)
  out = train(tmp_path / "ft", f"--config.init_from={reference}", "--config.steps=1",
              "--config.seq_len=16")
  assert "resumed" not in out
  assert sorted(losses(tmp_path / "ft")) == [1]  # a fresh run: step 0, own workdir
  a, b = load_model(reference).params(), load_model(tmp_path / "ft").params()
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_finetune_from_transformers(tmp_path):
  from mamba_train import load_model
  torch = pytest.importorskip("torch", reason="the transformers reference needs torch (the test extra)")
  from transformers import Mamba2Config as HFConfig, Mamba2ForCausalLM
  torch.manual_seed(0)
  hf = Mamba2ForCausalLM(HFConfig(hidden_size=64, num_heads=8, head_dim=16, n_groups=1,
                                  state_size=16, chunk_size=16, vocab_size=257,
                                  num_hidden_layers=2, tie_word_embeddings=True))
  hf.save_pretrained(tmp_path / "hf")
  train(tmp_path / "ft_hf", f"--config.init_from={tmp_path / 'hf'}", "--config.steps=1")
  a, b = load_model(tmp_path / "hf").params(), load_model(tmp_path / "ft_hf").params()
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
