"""Issue 19: no run destroys another's work, every fault stops at once with one
clear line, and the record stays true. Each test first builds the failure the
issue describes and then checks the behaviour that replaces it."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_checkpoint import BASE, ENDLESS, FAST_XLA, ROOT, _command, complete_steps, losses, output, wait_until

# ----------------------------------------------------------------------------
# 1. One run per workdir.


def _write_lock(workdir: Path, **info):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / ".lock").write_text(json.dumps(info))


def test_lock_refuses_a_live_holder_and_takes_over_stale_ones(tmp_path, caplog):
  from mamba_train.workdir import WorkdirLock, WorkdirLockedError
  work = tmp_path / "w"
  with WorkdirLock(work) as held:
    info = json.loads((work / ".lock").read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()} on {socket.gethostname()}"):
      WorkdirLock(work).acquire()
    assert held.held
  assert not (work / ".lock").exists()  # released at the end

  # A dead pid on this host: a child that has exited.
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  _write_lock(work, host=socket.gethostname(), pid=child.pid, started=0)
  with caplog.at_level("WARNING"):
    lock = WorkdirLock(work).acquire()
  assert "taking over the stale lock" in caplog.text and f"process {child.pid}" in caplog.text
  assert json.loads((work / ".lock").read_text())["pid"] == os.getpid()
  lock.release()

  # Another host: live until its lock goes unrefreshed for stale_s.
  _write_lock(work, host="elsewhere", pid=1, started=0)
  with pytest.raises(WorkdirLockedError, match="elsewhere"):
    WorkdirLock(work, stale_s=600).acquire()
  old = time.time() - 3600
  os.utime(work / ".lock", (old, old))
  lock = WorkdirLock(work, stale_s=600).acquire()
  assert json.loads((work / ".lock").read_text())["host"] == socket.gethostname()
  lock.release()


def test_lock_is_refreshed(tmp_path):
  from mamba_train.workdir import WorkdirLock
  work = tmp_path / "w"
  with WorkdirLock(work, refresh_s=0.05):
    first = json.loads((work / ".lock").read_text())["refreshed"]
    t0 = time.monotonic()
    while json.loads((work / ".lock").read_text())["refreshed"] == first:
      assert time.monotonic() - t0 < 30
      time.sleep(0.05)


def run_train(workdir, *extra, timeout=300):
  cmd, env = _command(workdir, extra, 1)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_second_run_on_a_workdir_is_refused(tmp_path):
  """Two train.py on one workdir: the second exits 2 naming the holder, the first is untouched."""
  work = tmp_path / "run"
  cmd, env = _command(work, [ENDLESS, "--config.checkpoint_every=0"], 1)
  with open(f"{work}.log", "w") as log:
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  first.log_path = Path(f"{work}.log")
  try:
    # The first run holds the lock from before it writes anything until it ends
    # (never: it is endless), so its lock file existing is enough.
    wait_until(first, lambda: (work / ".lock").exists(), "the lock")
    r = run_train(work, "--config.steps=3")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"pid {first.pid}" in r.stderr and "in use by another run" in r.stderr
    assert "Traceback" not in r.stderr
  finally:
    first.kill()
    first.wait()
  if (work / "config.json").exists():  # only the first run's
    assert json.loads((work / "config.json").read_text())["steps"] == 1000000


# ----------------------------------------------------------------------------
# 2. Writers never delete what they read.


def _export_cli(ckpt, out, *extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))  # this checkout's library
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), "--checkpoint", str(ckpt),
                         "--out", str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


def _tree(path: Path) -> dict:
  return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*")}


def test_export_never_replaces_its_source_or_a_non_export(tmp_path):
  from mamba_train.interop import export
  src = tmp_path / "run"
  (src / "checkpoints" / "2" / "state").mkdir(parents=True)  # a workdir's shape: never opened
  (src / "metrics.jsonl").write_text("{}\n")
  before = _tree(src)
  for out in (src, src / "exported", tmp_path):  # equal, inside, containing
    with pytest.raises(export.ExportPathError, match="checkpoint"):
      export.check_out(out, src / "checkpoints" / "2" if out == tmp_path else src)
  r = _export_cli(src, src, "--overwrite")  # the reported failure: it deleted the run
  assert r.returncode == 2 and "is the checkpoint" in r.stderr and "Traceback" not in r.stderr, r.stderr
  assert _tree(src) == before

  # --overwrite replaces a previous export only.
  from flax import nnx
  from mamba_train import Mamba2Config
  from mamba_train.model.mamba2 import Mamba2LM
  model = Mamba2LM(Mamba2Config(d_model=32, n_layer=1, vocab_size=64, headdim=8, d_state=8,
                                chunk_size=8), rngs=nnx.Rngs(0))
  unrelated = tmp_path / "notes"
  unrelated.mkdir()
  (unrelated / "keep.txt").write_text("mine")
  with pytest.raises(export.ExportPathError, match="not a previous export"):
    export.save_hf(model, unrelated, overwrite=True)
  assert (unrelated / "keep.txt").read_text() == "mine"
  out = export.save_hf(model, tmp_path / "exp")
  assert (out / export.MARKER).exists()
  (out / "stale.txt").write_text("from the first export")
  export.save_hf(model, out, overwrite=True)
  assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
