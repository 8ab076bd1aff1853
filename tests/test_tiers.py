"""Multi-tier checkpoints (config.checkpoint.local_dir, mamba_train/workdir/local_tier.py)
in a two-process job on CPU (gloo on 127.0.0.1, two simulated devices a process;
dcn_data=2 across the processes, fsdp=2 inside each, so each process's shards are a
replica of the other's).

One job is killed mid-save: process 0 dies while writing local step 8, after local
steps 4 and 6 and persistent steps 3 and 6. Three copies of what it left resume to
step 10, each bit-exactly against an uninterrupted job: as left (the partial step is
no step), with process 1's local tier deleted (a replaced host: it takes step 6
from its peer), and with the newest persistent step damaged while the local tiers
hold nothing newer than step 4 (the restore passes to the older local step and sets
6 aside).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import FAST_XLA, ROOT, free_port, log_tail, model_flags, patched

STEPS = 10
ARGS = [os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "tiny.py"),
        "--config.data.source=synthetic", *model_flags(n_layer=1, vocab_size=64),
        "--config.seq_len=32", "--config.batch_size=4", f"--config.steps={STEPS}",
        "--config.log_every=1", "--config.eval_every=0", "--config.wandb.mode=disabled",
        "--config.mesh.dcn_data=2", "--config.mesh.data=1", "--config.mesh.fsdp=2",
        "--heartbeat_timeout=60"]
TIERS = ["--config.checkpoint_every=3", "--config.checkpoint.local_every=2"]
# Process 0 dies (SIGKILL) with local step 8 written but not yet committed (renamed):
# once persistent step 6 is committed, and before its main thread can pass step 8.
KILL_IN_SAVE = """
import os, signal
from mamba_train.workdir import checkpoint, local_tier
_write, _save = local_tier._write_synced, checkpoint.Checkpointer.save_local
def _dying_write(path, text):
  _write(path, text)
  if os.sep + ".8.partial" + os.sep in path:
    os.kill(os.getpid(), signal.SIGKILL)
def _save_and_die(self, step, *args):
  if step == 8:
    self.manager.wait_until_finished()
  _save(self, step, *args)
  if step == 8:
    self.local.wait()
local_tier._write_synced = _dying_write
checkpoint.Checkpointer.save_local = _save_and_die
"""


def _job(tmp, tag, workdir, local, patch=None):
  """The two processes of one job; output in tmp/<tag><rank>.log."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_XLA}"}
  port = free_port()
  extra = ["--workdir", str(workdir), f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
  if local:
    extra += [*TIERS, f"--config.checkpoint.local_dir={local}"]
  else:
    extra += ["--config.checkpoint_every=0"]
  procs = []
  for rank in range(2):
    cmd = [sys.executable, *ARGS, *extra, f"--process_id={rank}"]
    if patch and rank == 0:
      cmd = patched(cmd, patch)
    log = open(tmp / f"{tag}{rank}.log", "w")
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs


def _wait(procs, timeout=400):
  try:
    return [p.wait(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def _logs(tmp, tag):
  return [(tmp / f"{tag}{r}.log").read_text() for r in range(2)]


def _rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def _steps(d):
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("tiers")
  ref = _job(tmp, "ref", tmp / "ref", None)
  killed = _job(tmp, "killed", tmp / "killed", tmp / "killed_local", patch=KILL_IN_SAVE)
  codes = _wait(killed) + _wait(ref)
  assert codes[2:] == [0, 0], "\n".join(log_tail(x) for x in _logs(tmp, "ref"))
  assert codes[0] == -9 and codes[1] != 0, "\n".join(log_tail(x) for x in _logs(tmp, "killed"))
  local = tmp / "killed_local"
  assert _steps(tmp / "killed" / "checkpoints") == [3, 6]
  assert _steps(local / "process_0") == [4, 6] and (local / "process_0" / ".8.partial").is_dir()
  # Process 1 may have committed its step 8 before its next collective found process 0 gone.
  assert _steps(local / "process_1") in ([4, 6], [6, 8])

  scenarios = {}
  for name in ("as_left", "lost_host", "damaged"):
    work, loc = tmp / name, tmp / f"{name}_local"
    shutil.copytree(tmp / "killed", work)
    shutil.copytree(local, loc)
    scenarios[name] = (work, loc)
  shutil.rmtree(scenarios["lost_host"][1] / "process_1")
  work, loc = scenarios["damaged"]
  for p in ("process_0", "process_1"):
    for s in _steps(loc / p):
      if s > 4:
        shutil.rmtree(loc / p / str(s))
  damaged = next(f for f in sorted((work / "checkpoints" / "6" / "state").rglob("*"))
                 if f.is_file() and f.stat().st_size > 1000)
  damaged.write_bytes(b"\0" * damaged.stat().st_size)
  procs = {name: _job(tmp, name, work, loc) for name, (work, loc) in scenarios.items()}
  codes = {name: _wait(p) for name, p in procs.items()}
  logs = {name: _logs(tmp, name) for name in scenarios}
  for name, c in codes.items():
    assert c == [0, 0], f"{name}\n" + "\n".join(log_tail(x) for x in logs[name])
  return tmp, scenarios, logs


def _exact(tmp, work):
  ref, got = _rows(tmp / "ref"), _rows(work)
  assert sorted(got) == list(range(1, STEPS + 1))
  for step in range(1, STEPS + 1):
    for key in ("loss", "grad_norm", "param_norm"):
      assert got[step][key] == ref[step][key], (step, key, got[step][key], ref[step][key])


def test_partial_local_step_is_no_step(jobs):
  tmp, scenarios, logs = jobs
  work, loc = scenarios["as_left"]
  text = logs["as_left"][0]
  # The newest step every process can get: 8 from process 1's replica if it committed it, else 6.
  assert "restoring step 8 from the local tiers and peers' replicas" in text \
      or "restoring step 6 from the local tiers" in text, text[-3000:]
  assert not (loc / "process_0" / ".8.partial").exists()  # a crashed save's leftovers are cleared
  _exact(tmp, work)


def test_lost_host_restores_from_its_peer(jobs):
  tmp, scenarios, logs = jobs
  work, loc = scenarios["lost_host"]
  assert "restoring step 6 from the local tiers and peers' replicas" in logs["lost_host"][0]
  assert "from process 0's local replica" in logs["lost_host"][1], logs["lost_host"][1][-3000:]
  assert _steps(loc / "process_1") == [8, 10]  # the replaced host's tier fills again
  _exact(tmp, work)


def test_damaged_persistent_step_falls_back_to_an_older_local_one(jobs):
  tmp, scenarios, logs = jobs
  work, _ = scenarios["damaged"]
  text = logs["damaged"][0]
  assert "checkpoint step 6" in text and "cannot be read" in text, text[-3000:]
  # Process 1's own step 4 is there unless its committed step 8 pruned it: then its peer's.
  assert re.search(r"restoring step 4 from the local tiers( and peers' replicas)? \(the newest "
                   r"step 6 is damaged\)", text), text[-3000:]
  assert (work / "checkpoints" / "6.damaged").is_dir()  # set aside, not deleted
  _exact(tmp, work)


def test_tier_config_errors():
  from configs import base
  from mamba_train.train import run_config
  for tiers, message in (({"local_dir": "/tmp/x"}, "go together"),
                         ({"local_every": 2}, "go together"),
                         ({"local_dir": "gs://b/x", "local_every": 2}, "own disk"),
                         ({"local_dir": "/tmp/x", "local_every": -1}, "integer >= 0")):
    c = base.get_config()
    c.checkpoint.update(tiers)
    c.steps = 2
    with pytest.raises(run_config.ConfigError, match=message):
      run_config.validate(c, num_devices=1, reference=base.get_config(), platform="cpu")


def test_choose_takes_the_newest_step_some_tier_gives_every_process():
  from mamba_train.workdir.local_tier import choose
  same = ["a", "a"]  # both processes hold the same shards (replicas)
  assert choose([{4, 6}, {4, 6}], {3, 6}, same) == (6, "local", {})
  assert choose([{4, 6}, set()], {3}, same) == (6, "peer", {1: 0})
  assert choose([{6}, {6, 8}], {6}, same) == (8, "peer", {0: 1})
  assert choose([{4, 6}, set()], {3}, ["a", "b"]) == (3, "persistent", {})  # no replica of 1's shards
  assert choose([{4}, {4}], {6}, same) == (6, "persistent", {})
  assert choose([set(), set()], set(), same) is None


def test_local_step_round_trip_and_damage(tmp_path):
  """In one process: a saved step restores bit for bit (bfloat16 and scalars too); one
  with a changed byte is refused and set aside."""
  import jax
  import jax.numpy as jnp

  from mamba_train.workdir import local_tier
  state = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7, "b": jnp.ones(5, jnp.bfloat16) / 3,
           "step": jnp.int32(9), "rng": jnp.array([1, 2], jnp.uint32)}
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  tier = local_tier.LocalTier(str(tmp_path))
  tier.save(9, state, '{"pos": 9}', {"name": "t"})
  tier.wait()
  assert tier.usable(target) == [9]
  got, data = local_tier.restore(tier, 9, {}, target, {0})
  assert data == '{"pos": 9}'
  for k in state:
    assert got[k].dtype == state[k].dtype
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))
  shards = tmp_path / "process_0" / "9" / local_tier.SHARDS
  raw = bytearray(shards.read_bytes())
  at = raw.find(np.asarray(state["w"]).tobytes())  # a bit of w's data flips
  assert at > 0
  raw[at + 5] ^= 0x01
  shards.write_bytes(bytes(raw))
  assert local_tier.restore(tier, 9, {}, target, {0}) is None
  assert tier.steps() == [] and (tmp_path / "process_0" / "9.damaged").is_dir()
