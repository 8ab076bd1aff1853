"""One run per workdir: the lock (taken atomically, refreshed, taken over only when
stale) and train.py refusing a workdir that a live run holds."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import run_train, tree_sizes


def _write_lock(workdir: Path, **info):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / ".lock").write_text(json.dumps(info))

def test_lock_refuses_a_live_holder_and_takes_over_stale_ones(tmp_path, caplog):
  from mamba_train.workdir.lock import WorkdirLock, WorkdirLockedError
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
  from mamba_train.workdir.lock import WorkdirLock
  work = tmp_path / "w"
  with WorkdirLock(work, refresh_s=0.05):
    first = json.loads((work / ".lock").read_text())["refreshed"]
    t0 = time.monotonic()
    while json.loads((work / ".lock").read_text())["refreshed"] == first:
      assert time.monotonic() - t0 < 30
      time.sleep(0.05)

def test_second_run_on_a_workdir_is_refused(tmp_path):
  """A train.py on a workdir that a live run holds exits 2 naming the holder, and touches
  nothing. The holder is this test process (a live pid on this host, as a first
  train.py would be: the lock is all that stops the second one, and no run has to be
  caught mid-way)."""
  from mamba_train.workdir.lock import WorkdirLock
  work = tmp_path / "run"
  with WorkdirLock(work):
    (work / "config.json").write_text('{"steps": 1000000}')  # the first run's
    before = tree_sizes(work)
    r = run_train(work, "--config.steps=3")
    assert tree_sizes(work) == before
  assert r.returncode == 2, r.stderr[-2000:]
  assert f"pid {os.getpid()}" in r.stderr and "in use by another run" in r.stderr
  assert "Traceback" not in r.stderr
