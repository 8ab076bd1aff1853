"""One run per workdir: a lock file held for the whole run.

`<workdir>/.lock` is created atomically (O_CREAT | O_EXCL, which local disks and
NFS v3+ honour; on a gs:// bucket an upload that succeeds only if no object exists,
`mamba_train.workdir.storage`) and holds the holder's host, pid and start time, plus the time
it was last refreshed; a background thread refreshes it every `refresh_s`. A
second run on a locked workdir is refused with the holder named. A stale lock is
taken over with a warning: one whose pid is dead on this host, or one not
refreshed for `stale_s` (a holder on another host that died): it is removed only if
it is still the version judged stale, so of several takers one wins. With several
processes only process 0 takes the lock (one lock per job).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import jax
import numpy as np

from mamba_train.errors import UserError
from mamba_train.workdir import storage

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class WorkdirLockedError(UserError, RuntimeError):
  """Another live run holds the workdir."""


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, another user's
    return True
  return True


def _holder_text(info: dict) -> str:
  started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
  return f"pid {info.get('pid')} on {info.get('host')}, started {started}"


class WorkdirLock:
  """`with WorkdirLock(workdir): ...`, or `acquire()` / `release()`."""

  def __init__(self, workdir, *, refresh_s: float = 60.0, stale_s: float = 600.0):
    self.path = storage.path(workdir) / LOCK_NAME
    self.refresh_s, self.stale_s = refresh_s, stale_s
    self.info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    self._stop = threading.Event()
    self._thread = None
    self.held = False

  def _text(self) -> str:
    return json.dumps({**self.info, "refreshed": time.time()})

  def _read(self) -> dict | None:
    try:
      return json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}  # being written, or garbage: judged by its age

  def _stale_reason(self, info: dict, modified: float) -> str | None:
    age = time.time() - modified
    if info.get("host") == self.info["host"] and isinstance(info.get("pid"), int):
      if not _pid_alive(info["pid"]):
        return f"its process {info['pid']} on this host is gone"
      return None
    if age > self.stale_s:
      return f"it was not refreshed for {age:.0f} s (more than {self.stale_s:.0f} s)"
    return None

  def acquire(self) -> "WorkdirLock":
    storage.makedirs(self.path.parent)
    for _ in range(3):
      if storage.create_new(self.path, self._text()):
        break
      seen = storage.version(self.path)
      info = self._read()
      if seen is None or info is None:
        continue  # released meanwhile: try again
      reason = self._stale_reason(info, seen[1])
      if reason is None:
        raise WorkdirLockedError(
            f"{self.path.parent} is in use by another run ({_holder_text(info)}); wait for it to "
            f"end, or use another --workdir. If that run is dead, delete {self.path}.")
      log.warning("taking over the stale lock %s (%s): %s", self.path, _holder_text(info), reason)
      storage.remove_if_unchanged(self.path, seen[0])  # one taker wins; the others try again
    else:
      raise WorkdirLockedError(f"could not take the lock {self.path}; is another run starting?")
    self.held = True
    self._thread = threading.Thread(target=self._refresh_loop, name="workdir-lock", daemon=True)
    self._thread.start()
    return self

  def _refresh_loop(self) -> None:
    while not self._stop.wait(self.refresh_s):
      try:
        storage.write_text(self.path, self._text())
      except Exception as e:  # noqa: BLE001 - a full disk or a lost bucket must not kill the run from here
        log.warning("could not refresh %s: %s", self.path, e)

  def release(self) -> None:
    if not self.held:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    info = self._read()
    if info and info.get("pid") == self.info["pid"] and info.get("host") == self.info["host"]:
      self.path.unlink(missing_ok=True)
    self.held = False

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
    return False


def lock_workdir(workdir) -> WorkdirLock:
  """Process 0 takes the workdir's lock for the job; every process learns whether it got it."""
  lock = WorkdirLock(workdir)
  error = ""
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except WorkdirLockedError as e:
      error = str(e)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    try:
      if bool(multihost_utils.broadcast_one_to_all(np.array(bool(error)))):
        error = error or f"process 0 could not lock {workdir} (its log says why)"
    except BaseException:
      lock.release()
      raise
  if error:
    raise WorkdirLockedError(error)
  return lock
