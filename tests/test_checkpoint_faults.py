"""Checkpoint and record faults: a damaged config item, replayed metric rows, a full disk
(fault injection: Orbax's JSON item writer, run in the background of every save,
raises OSError(ENOSPC)), the free-space pre-flight, and reads that log nothing."""

import json
import re
import subprocess

import pytest

from helpers import ROOT, complete_steps, patched, train_command


def _tiny_state(value):
  import jax.numpy as jnp
  return {"params": {"embedding": jnp.full((4, 3), value, jnp.float32)}, "step": jnp.array(value, jnp.int32)}

def test_restore_checks_the_config_item_too(tmp_path, caplog):
  """Garbage in a step's config/metadata alone went unnoticed until an export failed."""
  import jax

  from mamba_train.data import SyntheticLoader
  from mamba_train.workdir import checkpoint
  loader = SyntheticLoader(vocab_size=17, seq_len=4, global_batch_size=1, seed=0)
  ck = checkpoint.Checkpointer(tmp_path, keep=0, async_save=False)
  for step in (1, 2):
    ck.save(step, _tiny_state(step), loader, {"step_saved": step})
  ck.close()
  (tmp_path / "checkpoints" / "2" / "config" / "metadata").write_text("{garbage")
  with pytest.raises(checkpoint.CheckpointDamagedError, match=r"checkpoints/2 is damaged.*earlier step"):
    checkpoint.saved_config(tmp_path / "checkpoints" / "2")
  ck = checkpoint.Checkpointer(tmp_path, keep=0)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tiny_state(0))
  with caplog.at_level("WARNING"):
    step, state = ck.restore(target, loader)
  ck.close()
  assert step == 1 and int(state["step"]) == 1
  assert "resuming from step 1 instead of the newest step 2" in caplog.text
  assert (tmp_path / "checkpoints" / "2.damaged").exists()

def test_steps_of_another_state_layout_are_one_line_and_left_alone(tmp_path):
  """A workdir written before the train state changed shape (the weight guard's optimizer
  state): every step reads, into another tree. The refusal says how to go on, and no step
  is set aside as damaged."""
  import jax

  from mamba_train.data import SyntheticLoader
  from mamba_train.errors import UserError
  from mamba_train.workdir import checkpoint
  loader = SyntheticLoader(vocab_size=17, seq_len=4, global_batch_size=1, seed=0)
  ck = checkpoint.Checkpointer(tmp_path, keep=0, async_save=False)
  for step in (1, 2):
    ck.save(step, _tiny_state(step), loader, {"step_saved": step})
  ck.close()
  new_layout = dict(_tiny_state(0), guard={"accepted": jax.numpy.zeros((), "int32")})
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), new_layout)
  ck = checkpoint.Checkpointer(tmp_path, keep=0)
  with pytest.raises(UserError) as e:
    ck.restore(target, loader)
  ck.close()
  msg = str(e.value)
  assert "another layout" in msg and f"--config.init_from={tmp_path}" in msg and "\n" not in msg
  assert complete_steps(tmp_path) == [1, 2]
  assert not list((tmp_path / "checkpoints").glob("*.damaged*"))


def test_resumed_metrics_hold_each_step_once(tmp_path):
  from mamba_train.workdir.record import MetricsWriter
  path = tmp_path / "metrics.jsonl"
  rows = [json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 9)]
  path.write_text("".join(rows) + '{"step": 9, "lo')  # steps 1..8, then a line cut by a kill
  w = MetricsWriter(str(tmp_path), wandb_cfg={"mode": "disabled"}, run_config={}, resumed_from=4)
  for s in (5, 6):
    w.write(s, {"loss": 0.5})
  w.close()
  got = [json.loads(l) for l in path.read_text().splitlines()]
  assert [r["step"] for r in got] == [1, 2, 3, 4, 4, 5, 6]
  assert got[4] == {"step": 4, "event": "resumed", "set_aside": "metrics.jsonl.after-4"}
  assert got[5]["loss"] == 0.5
  aside = (tmp_path / "metrics.jsonl.after-4").read_text()
  assert aside == "".join(rows[4:]) + '{"step": 9, "lo\n'  # nothing lost

ENOSPC_PATCH = """
import errno, orbax.checkpoint as ocp
async def _full(self, item, directory):
  raise OSError(errno.ENOSPC, "No space left on device", str(directory))
ocp.JsonCheckpointHandler._save_fn = _full
"""

def test_failed_async_save_is_raised_with_path_and_free_space(tmp_path, monkeypatch):
  import errno

  import orbax.checkpoint as ocp

  from mamba_train.data import SyntheticLoader
  from mamba_train.workdir import checkpoint
  loader = SyntheticLoader(vocab_size=17, seq_len=4, global_batch_size=1, seed=0)
  ck = checkpoint.Checkpointer(tmp_path, keep=0)
  ck.save(1, _tiny_state(1), loader, {})
  ck.manager.wait_until_finished()

  async def full(self, item, directory):
    raise OSError(errno.ENOSPC, "No space left on device", str(directory))

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full)
  ck.save(2, _tiny_state(2), loader, {})
  with pytest.raises(checkpoint.CheckpointWriteError) as e:
    ck.check()  # at a step after the failure: raises whether or not it has landed yet
    ck.save(3, _tiny_state(3), loader, {})  # the next save waits for it
  msg = str(e.value)
  assert "\n" not in msg and f"step 2 to {tmp_path / 'checkpoints'} failed: No space left on device" in msg
  assert "GiB free there" in msg and "the last complete checkpoint is step 1" in msg
  ck.close()  # reported once: closing does not raise it again
  assert ck.steps() == [1]

def test_a_failure_orbax_raises_from_its_own_check_is_one_error(tmp_path, monkeypatch):
  """Orbax's check_for_errors raises a finished save's error itself (tensorstore's
  ValueError on a full disk): the step's check reports it as the save's failure, not as a
  raw ValueError with Orbax's traceback (seen once in the suite's real-full-disk run)."""
  from mamba_train.workdir import checkpoint
  ck = checkpoint.Checkpointer(tmp_path, keep=0)
  ck.last_saved = 4

  def failed():
    raise ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state" in OCDBT database: Failed writing: '
                     '"x/d/0": Failed to write 206831 bytes to file 5: No space left on device')

  monkeypatch.setattr(ck.manager, "check_for_errors", failed)
  with pytest.raises(checkpoint.CheckpointWriteError, match="step 4 to .* failed: No space left on device"):
    ck.check()
  monkeypatch.undo()
  ck.close()


def test_preflight_warns_when_the_checkpoints_cannot_fit(tmp_path, caplog):
  import shutil

  from mamba_train.workdir import checkpoint
  ck = checkpoint.Checkpointer(tmp_path, keep=3)
  free = shutil.disk_usage(tmp_path).free
  with caplog.at_level("WARNING"):
    ck.preflight(free // 8)  # 4 copies fit
    assert "saves will fail" not in caplog.text
    ck.preflight(free // 3)  # 4 copies do not
  assert "saves will fail" in caplog.text and "3 kept" in caplog.text
  ck.close()

def test_full_disk_stops_train_py_with_one_line(tmp_path):
  work = tmp_path / "run"
  cmd, env = train_command(work, ["--config.steps=8", "--config.checkpoint_every=2"], 1)
  cmd = patched(cmd, ENOSPC_PATCH)
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: saving checkpoint step 2 to ") and "No space left on device" in last, last
  assert "GiB free there" in last and "Traceback" not in r.stderr, r.stderr[-3000:]
  steps = [json.loads(l)["step"] for l in open(work / "metrics.jsonl") if '"loss"' in l]
  # Stopped at the first step that saw the failure (before logging it), at the latest at
  # the next save (step 4, after logging it): never trained on past an unreported failure.
  assert 2 <= max(steps) <= 4
  assert complete_steps(work) == []

def test_reading_a_checkpoint_logs_no_library_warnings(tmp_path, caplog):
  """generate.py printed five Orbax read_only warnings before its answer."""
  from mamba_train.data import SyntheticLoader
  from mamba_train.workdir import checkpoint
  loader = SyntheticLoader(vocab_size=17, seq_len=4, global_batch_size=1, seed=0)
  ck = checkpoint.Checkpointer(tmp_path, keep=0, async_save=False)
  ck.save(3, _tiny_state(3), loader, {"k": 1})
  ck.close()
  with caplog.at_level("DEBUG"):
    params = checkpoint.restore_params(tmp_path / "checkpoints" / "3")
    assert checkpoint.saved_config(tmp_path / "checkpoints" / "3") == {"k": 1}
  assert float(params["embedding"][0, 0]) == 3.0
  assert [r for r in caplog.records if "/orbax/" in r.pathname] == []

@pytest.fixture
def small_tmpfs(tmp_path):
  """A 1.6 MB tmpfs (the first checkpoint of train_command's model, 0.9 MB, fits; the second
  does not), mounted for the test when it runs as root; skipped with the reason otherwise."""
  import os
  mnt = tmp_path / "tmpfs"
  mnt.mkdir()
  if os.geteuid() != 0:
    pytest.skip("a real full disk needs a tmpfs mounted by the test, which needs root")
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mnt)],
                     capture_output=True, text=True)
  if r.returncode != 0:
    pytest.skip(f"mount -t tmpfs failed (a container without CAP_SYS_ADMIN?): {r.stderr.strip()}")
  try:
    yield mnt
  finally:
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_disk_stops_with_one_line_and_resumes(small_tmpfs):
  """The reported run: on a real full disk tensorstore raises ValueError(RESOURCE_EXHAUSTED ...)
  from Orbax's writer threads, not OSError; train.py printed 369 lines and five tracebacks."""
  work = small_tmpfs / "run"
  cmd, env = train_command(work, ["--config.steps=8", "--config.checkpoint_every=2"], 1)
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  out = r.stdout + r.stderr
  assert r.returncode == 1, out[-3000:]
  assert "Traceback" not in out and "Event loop is closed" not in out, out[-5000:]
  # One error line, the last; log records (a warning that the closing goodput row found the
  # disk full too) may name the disk, but no traceback or second error does.
  about = [line for line in out.splitlines() if ("No space left" in line or "RESOURCE_EXHAUSTED" in line)
           and not re.match(r"[IWEF]\d{4} ", line)]
  assert len(about) == 1 and about[0] == r.stderr.strip().splitlines()[-1], out[-5000:]
  assert about[0].startswith(f"error: saving checkpoint step 4 to {work / 'checkpoints'} failed: "
                             "No space left on device"), about[0]
  assert "MiB free there" in about[0] and "the last complete checkpoint is step 2" in about[0], about[0]
  assert complete_steps(work) == [2]
  first = {row["step"]: row["loss"] for row in map(json.loads, open(work / "metrics.jsonl")) if "loss" in row}
  # Space freed (the tmpfs grown): the same command resumes from step 2, the steps after it
  # bit-identical to those the failed run trained before it stopped.
  subprocess.run(["mount", "-o", "remount,size=16m", str(small_tmpfs)], check=True)
  cmd, env = train_command(work, ["--config.steps=6", "--config.checkpoint_every=2"], 1)
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "at step 2" in r.stderr, r.stderr[-3000:]
  resumed = {row["step"]: row["loss"] for row in map(json.loads, open(work / "metrics.jsonl"))
             if "loss" in row and row["step"] > 2}
  both = sorted(set(first) & set(resumed))
  assert sorted(resumed) == [3, 4, 5, 6] and both[:2] == [3, 4], (resumed, first)
  assert all(resumed[s] == first[s] for s in both), (resumed, first)
  assert complete_steps(work) == [2, 4, 6]
