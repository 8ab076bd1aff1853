"""Checkpoints with Orbax: asynchronous, atomic, keep-last-k, reshardable on restore.

Layout: `<workdir>/checkpoints/<step>/` holding three items:
  state   the TrainState (params, optimizer state, step, rng), sharded: every
          process writes its own shards;
  data    the data iterator's state, one JSON file per process (Grain's handler);
  config  the resolved run config (JSON).

The workdir is a local directory or a gs:// bucket (`mamba_train.workdir.storage`). Orbax
writes each step into a temporary directory and renames it when complete (local),
or writes a commit file into the step last (a bucket, which has no atomic rename),
so a save cut off by a crash never becomes a step that a restart can pick.
A step any of whose items (state, data, config) is damaged is skipped on restore,
with a warning naming it and the step used instead, and set aside as
`<step>.damaged` (`storage.move_dir`). Nothing is deleted except by the keep-last-k policy.

With `local_dir` (config.checkpoint.local_dir) the Checkpointer has two tiers: this
one, the persistent tier, and each host's local disk (`mamba_train.workdir.local_tier`),
saved more often (`save_local`). A restore takes the newest step any tier can give
every process (a peer's replica where a host lost its own), with the same fallback
past damaged steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from mamba_train.errors import RunFailure, UserError
from mamba_train.model.config import Mamba2Config
from mamba_train.model.params import param_shapes, shape_problems
from mamba_train.model.runtime import Runtime
from mamba_train.workdir import local_tier, storage

log = logging.getLogger(__name__)


class ShapeMismatchError(UserError, ValueError):
  pass


class NoReadableCheckpoint(UserError, RuntimeError):
  """Every step of a workdir failed to restore; nothing was set aside or changed."""


class CheckpointWriteError(RunFailure, RuntimeError):
  """A save failed (a full disk, a lost mount): the run stops rather than train on unsaved."""


class _JsonStateIterator:
  """Lets an iterator with dict `get_state`/`set_state` (the synthetic stream) go
  through Grain's checkpoint handler, which stores per-process JSON."""

  def __init__(self, it):
    self.it = it

  def get_state(self) -> bytes:
    return json.dumps(self.it.get_state()).encode()

  def set_state(self, state: bytes) -> None:
    self.it.set_state(json.loads(state.decode()))

  def start_prefetch(self) -> None:  # called by Grain's handler after restore
    pass


def _grain_item(it):
  return it if hasattr(it, "start_prefetch") else _JsonStateIterator(it)


# Orbax's mark of a finished step on a bucket: deleted first when a step is set aside.
COMMIT_FILE = ocp.path.atomicity.COMMIT_SUCCESS_FILE


def checkpoint_dir(workdir) -> epath.Path:
  return storage.path(workdir) / "checkpoints"


class Checkpointer:
  """Saves and restores (state, data iterator, config) under `<workdir>/checkpoints`."""

  def __init__(self, workdir, *, keep: int = 3, async_save: bool = True, local_dir: str = ""):
    self.directory = checkpoint_dir(workdir)
    self.local = local_tier.LocalTier(local_dir) if local_dir else None
    self.keep = keep if keep > 0 else None
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self.keep, create=True,
        enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_handlers=_handlers())
    self.last_saved: int | None = None
    self._failed = False
    # Orbax's writer threads log each failed save's traceback (three of them a save) as it
    # happens, outside any call of ours; the failure is reported here, in one line, instead.
    self._quiet = _DropOrbaxErrors()
    logging.getLogger("absl").addFilter(self._quiet)
    _ignore_stray_write_completions()

  # -- saving --

  def save(self, step: int, state, data_iter, config: dict, *, force: bool = False) -> bool:
    """Starts an asynchronous save; returns once device arrays are copied to host.
    Raises CheckpointWriteError if an earlier save failed."""
    self.check()
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(_grain_item(data_iter)),
        config=ocp.args.JsonSave(config))
    try:
      with _quiet_orbax():  # its traceback of the previous save's failure: we say it in one line
        saved = self.manager.save(step, args=args, force=force)
    except Exception as e:  # Orbax waits for the previous save first and re-raises its error
      if not is_storage_error(e):
        raise
      raise self._write_error(self.last_saved, e) from e
    self.last_saved = step
    return saved

  def save_local(self, step: int, state, data_iter, config: dict) -> None:
    """Save to this host's local tier: returns once the state is in host memory."""
    self.local.save(step, state, json.dumps(data_iter.get_state()), config)

  def check(self) -> None:
    """Raise CheckpointWriteError if an asynchronous save has failed; never waits.
    Called at every step, so a failed save stops the run at the next step after it."""
    try:
      error = _finished_save_error(self.manager)
    except Exception as e:  # noqa: BLE001 - Orbax's own check raises the finished save's error
      error = e
    if error is not None:
      raise self._write_error(self.last_saved, error) from error

  def _write_error(self, step, error: BaseException) -> CheckpointWriteError:
    self._failed = True
    remote = storage.is_remote(self.directory)
    try:
      room = storage.free_bytes(self.directory)
      free = "a bucket" if room is None else f"{_size(room)} free there"
    except OSError:
      free = "free space unknown"
    reason = storage_reason(error)
    try:
      done = [s for s in self.steps() if s != step]
      last = f"the last complete checkpoint is step {done[-1]}" if done else "no checkpoint is complete"
    except Exception:  # noqa: BLE001 - the storage itself is gone
      last = "the last complete checkpoint is unknown"
    fix = ("Check the bucket (permissions, quota)" if remote else "Free space")
    return CheckpointWriteError(f"saving checkpoint step {step} to {self.directory} failed: {reason} "
                                f"({free}); {last}. {fix} (or use another --workdir) and rerun "
                                "to resume.")

  def preflight(self, state_bytes: int) -> None:
    """Warn when the disk cannot hold the checkpoints this run keeps (and one being written)."""
    keep = self.keep
    need = state_bytes * ((keep or 1) + 1)
    try:
      free = storage.free_bytes(self.directory)
    except OSError:
      return
    if free is not None and need > free:
      log.warning("%s has %s free but this run's checkpoints need about %s (%s of %s "
                  "and one being written): saves will fail. Free space, lower checkpoint_keep "
                  "or use another --workdir.", self.directory, _size(free), _size(need),
                  f"{keep} kept" if keep else "all kept; counting 1", _size(state_bytes))

  def close(self) -> None:
    """Wait for the saves in flight; raise CheckpointWriteError if one failed and was not
    reported yet (a failure already reported at a step is not raised again)."""
    if self.local is not None:
      self.local.wait()
    try:
      with _quiet_orbax():
        self.manager.wait_until_finished()
    except Exception as e:  # only a background save's error comes from the wait: a failed save
      if not self._failed:
        raise self._write_error(self.last_saved, e) from e
    finally:
      try:
        with _quiet_orbax(), contextlib.suppress(Exception if self._failed else OSError):
          self.manager.close()
      finally:
        logging.getLogger("absl").removeFilter(self._quiet)

  # -- restoring --

  def _set_aside(self, steps: list[int]) -> None:
    """Rename damaged steps to `<step>.damaged` so the run can save that step again;
    nothing is deleted. The manager is reopened to forget them."""
    self.manager.wait_until_finished()
    _move_aside(self.directory, steps)
    if jax.process_count() > 1:
      # Process 0 renames; every process's reload lists the step directories and then
      # reads each one's timestamp, so a reload that listed a step before the rename
      # failed on it (FileNotFoundError in Orbax's threads, the job then lost).
      multihost_utils.sync_global_devices(f"mamba_train: checkpoints {steps} set aside")
    self.manager.reload()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def saved_config(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

  def check_shapes(self, step: int, abstract_state) -> None:
    """Raise ShapeMismatchError listing every parameter whose shape differs."""
    saved = param_shapes(_state_tree(self.manager, step)["params"])
    wanted = param_shapes(abstract_state["params"] if isinstance(abstract_state, dict)
                          else abstract_state.params)
    bad = shape_problems(wanted, saved)
    if bad:
      raise ShapeMismatchError(
          f"checkpoint step {step} in {self.directory} does not fit the model config: "
          + "; ".join(bad))

  def restore(self, abstract_state, data_iter, *, step: int | None = None):
    """Restore the newest complete step (or `step`) into `abstract_state`'s shapes and
    shardings, which may differ from the ones it was saved with (resharding).
    A step that fails to read is skipped for the one before it, with a warning.
    With a local tier the newest step of either tier (see the module docstring).
    Returns (step, state) or (None, None) when there is nothing to restore."""
    if self.local is not None and step is None:
      return self._restore_tiers(abstract_state, data_iter)
    candidates = [step] if step is not None else self.steps()[::-1]
    failed, layout = [], False
    for s in candidates:
      try:
        state = self._restore_step(s, abstract_state, data_iter)
      except ShapeMismatchError:
        raise
      except Exception as e:  # a damaged or partial step: fall back to the previous one
        if step is not None:
          raise
        self._warn_unreadable(s, e)
        failed.append(s)
        # Orbax's words for a step read into another tree (train-state layout changed).
        layout |= any(w in str(e) for w in ("tree structures do not match", "Structure mismatch"))
        continue
      if failed:
        log.warning("resuming from step %d instead of the newest step %d, which is damaged",
                    s, failed[0])
        self._set_aside(failed)
      return s, state
    if failed:
      if layout:  # every step read, but into another train-state tree: nothing is damaged
        raise NoReadableCheckpoint(
            f"the checkpoints in {self.directory} (steps {failed}) hold a train state of another layout "
            "(written by an earlier mamba_train, before the optimizer state gained the weight guard's "
            "fields); nothing was changed. Continue from their weights in a new workdir with "
            f"--config.init_from={self.directory.parent} (the optimizer state starts afresh)")
      raise NoReadableCheckpoint(f"no checkpoint in {self.directory} could be read (steps {failed}); "
                                 "nothing was changed: move the directory away to start afresh")
    return None, None

  def _warn_unreadable(self, s: int, e: Exception) -> None:
    log.warning("checkpoint step %d in %s cannot be read (%s: %s); trying an earlier step",
                s, self.directory, type(e).__name__, str(e).splitlines()[0][:200])

  def _restore_step(self, s: int, abstract_state, data_iter):
    """The state of persistent step `s` (and the data iterator's); raises if any item is damaged."""
    self.check_shapes(s, abstract_state)
    item = _grain_item(data_iter)
    data_dir = self.directory / str(s) / "data"
    mine = data_dir / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    # Every item is read, the config too: a step is trusted only if all of it is whole.
    args = dict(state=ocp.args.StandardRestore(abstract_state), config=ocp.args.JsonRestore())
    if mine.exists():
      args["data"] = grain.checkpoint.CheckpointRestore(item)
    out = self.manager.restore(s, args=ocp.args.Composite(**args))
    if not mine.exists():
      _restore_data_from_other_process_count(data_dir, item)
    return out["state"]

  def _restore_tiers(self, abstract_state, data_iter):
    """The newest step that the local tiers (every process's own, or a peer's replica)
    or the persistent tier gives every process; damaged steps of either are set aside
    and passed over. Every process takes the same decisions from the same facts
    (the persistent listing, the gathered local listings)."""
    self.local.wait()
    self.manager.wait_until_finished()
    persistent, failed = set(self.steps()), []
    prints = local_tier.fingerprints(abstract_state)
    local = local_tier.gather_steps(self.local.usable(abstract_state))
    newest = max(persistent.union(*local), default=None)
    try:
      while (choice := local_tier.choose(local, persistent, prints)) is not None:
        s, tier, sources = choice
        if tier == "persistent":
          try:
            state = self._restore_step(s, abstract_state, data_iter)
          except ShapeMismatchError:
            raise
          except Exception as e:  # noqa: BLE001 - damaged: the next newest of either tier
            self._warn_unreadable(s, e)
            failed.append(s)
            persistent.discard(s)
            continue
        else:
          got = local_tier.restore(self.local, s, sources, abstract_state,
                                   {p for p, steps in enumerate(local) if s in steps})
          if got is None:  # a holder's copy is damaged (and set aside): look again
            local = local_tier.gather_steps(self.local.usable(abstract_state))
            continue
          state, data_state = got
          data_iter.set_state(json.loads(data_state))
        where = {"persistent": str(self.directory), "local": "the local tiers",
                 "peer": "the local tiers and peers' replicas"}[tier]
        log.info("restoring step %d from %s%s", s, where,
                 "" if s == newest else f" (the newest step {newest} is damaged)")
        return s, state
    finally:
      if failed:
        self._set_aside(failed)
    if failed:
      raise RuntimeError(f"no checkpoint in {self.directory} or the local tiers could be read "
                         f"(persistent steps {failed}); move them away to start afresh")
    return None, None


# What a write that failed for want of room or rights says. Orbax writes arrays with
# tensorstore, which raises a ValueError carrying an absl status code ("RESOURCE_EXHAUSTED:
# Error writing ... in OCDBT database ...: No space left on device"), not an OSError; its
# JSON and metadata writers raise OSError. Both forms are recognised, wherever they come
# from (the save call, the background threads, close).
_STORAGE_REASONS = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                    "Permission denied", "File too large")
_STORAGE_CODES = re.compile(r"\b(RESOURCE_EXHAUSTED|PERMISSION_DENIED|UNAVAILABLE|DATA_LOSS)\b")


def _chain(error: BaseException):
  while error is not None:
    yield error
    error = error.__cause__ or error.__context__


def is_storage_error(error: BaseException) -> bool:
  """Whether `error` (or what it was raised from) is a write refused by the storage: an
  OSError, or tensorstore's status error of a full disk, a quota, missing rights."""
  for e in _chain(error):
    if isinstance(e, OSError) or _STORAGE_CODES.search(str(e)) or any(r in str(e) for r in _STORAGE_REASONS):
      return True
  return False


def storage_reason(error: BaseException) -> str:
  """The short reason of a failed write: the OS's words ("No space left on device"), with
  tensorstore's status code when it raised it, else the error's first line."""
  for e in _chain(error):
    if isinstance(e, OSError) and e.strerror:
      return e.strerror
    text = str(e)
    reason = next((r for r in _STORAGE_REASONS if r in text), None)
    code = _STORAGE_CODES.search(text)
    if reason:
      return f"{reason} (tensorstore {code.group(1)})" if code else reason
  first = str(error).splitlines()[0] if str(error) else type(error).__name__
  return first[:200]


def _stray_write_completion(u) -> bool:
  """A tensorstore write of a failed save finishing after Orbax's event loop closed: when one
  write of a save fails, asyncio.gather returns and Orbax's thread closes its loop while the
  save's other writes are still in flight; each of them, finishing, calls
  `loop.call_soon_threadsafe` on the closed loop from a C++ thread, which reports it as
  unraisable (a bare traceback on stderr, a dozen a failed save). Nothing is lost: the
  save has failed already, and the checkpointer reports it."""
  # The same failed save's writes that never finished: Python closes their coroutines
  # while it shuts down, and their cleanup can no longer import anything.
  code = getattr(u.object, "cr_code", None)
  if (u.exc_type is ImportError and "shutting down" in str(u.exc_value)
          and "orbax" in getattr(code, "co_filename", "")):
    return True
  if u.exc_type is not RuntimeError or str(u.exc_value) != "Event loop is closed":
    return False
  tb = u.exc_traceback
  while tb is not None and tb.tb_next is not None:
    if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
      return True
    tb = tb.tb_next
  return tb is not None and tb.tb_frame.f_code.co_name in ("call_soon_threadsafe", "_check_closed")


def _ignore_stray_write_completions() -> None:
  """Drop `_stray_write_completion`s, passing every other unraisable error on to the hook
  in place. Installed once per process, by the first Checkpointer (it cannot be scoped to
  one: the stray completions can come after its close)."""
  previous = sys.unraisablehook
  if getattr(previous, "_drops_stray_write_completions", False):
    return

  def hook(u):
    if not _stray_write_completion(u):
      previous(u)

  hook._drops_stray_write_completions = True
  sys.unraisablehook = hook


def _size(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**29 else f"{n / 2**20:.1f} MiB"


def _finished_save_error(manager) -> BaseException | None:
  """The error of a finished asynchronous save, if it failed. Orbax keeps it on its
  finalize thread and raises it only when the next save or close waits; this reads
  it without waiting (a private attribute: absent in another version, this says None
  and the error comes at the next save instead)."""
  manager.check_for_errors()
  ref = getattr(manager, "_finalize_thread", None)
  if ref is None or not hasattr(ref, "map"):
    return None
  return ref.map(lambda t: None if t is None or t.is_alive() else getattr(t, "exception", None))


class _DropOrbaxRecords(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    # With a bucket, gcsfs logs every object it opens at INFO (its warnings stay).
    return "/orbax/" not in record.pathname and (
        record.levelno >= logging.WARNING or "/gcsfs/" not in record.pathname)


class _DropOrbaxErrors(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not ("/orbax/" in record.pathname and record.levelno >= logging.ERROR)


@contextlib.contextmanager
def _quiet_orbax():
  """Orbax's own log records (its warnings on reading read-only, its tracebacks of a
  failed save that we report in one line), and gcsfs's INFO records, are dropped
  inside this block."""
  quiet = _DropOrbaxRecords()
  loggers = [logging.getLogger("absl"), logging.getLogger()]
  handlers = [h for lg in loggers for h in lg.handlers]
  for h in handlers:
    h.addFilter(quiet)
  try:
    yield
  finally:
    for h in handlers:
      h.removeFilter(quiet)


def _move_aside(directory: epath.Path, steps: list[int]) -> None:
  if jax.process_index() != 0:
    return
  for s in steps:
    src = directory / str(s)
    dst = directory / f"{s}.damaged"
    n = 1
    while dst.exists():
      dst, n = directory / f"{s}.damaged{n}", n + 1
    if src.exists():
      # A rename on a disk; on a bucket a copy, a marker, then the commit file's deletion
      # (from then on no finished step) and the rest's.
      storage.move_dir(src, dst, first=(COMMIT_FILE,))
      log.warning("moved the damaged checkpoint %s to %s (kept for inspection, not deleted)", src, dst)


def _restore_data_from_other_process_count(directory: epath.Path, data_iter) -> None:
  """Grain names each process's iterator file `process_<i>-of-<n>.json`, so a run
  on another process count finds none of its own. That restore is exact for our
  loaders: their state counts global batches (every process reads its rows of the
  same global batch), so every process saved the same state."""
  saved = sorted(directory.glob("process_*-of-*.json"))
  if not saved:
    raise ValueError(f"{directory} holds no data iterator state")
  log.warning("the data iterator was saved by another process count; restoring %s on %d processes",
              saved[0].name, jax.process_count())
  state = saved[0].read_text()
  data_iter.set_state(json.loads(state) if isinstance(data_iter, grain.DatasetIterator)
                      else state.encode())


def _handlers():
  # Named explicitly so that a fresh process can read metadata before restoring.
  return {"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
          "config": ocp.JsonCheckpointHandler()}


def _state_tree(manager, step) -> dict:
  meta = manager.item_metadata(step)["state"]
  return meta.tree if hasattr(meta, "tree") else meta


def _read_only(step_dir: epath.Path) -> ocp.CheckpointManager:
  # Orbax warns at INFO/WARNING about every read-only manager (nothing to delete, no
  # directory to create); callers hold _quiet_orbax so generate and export print none.
  return ocp.CheckpointManager(step_dir.parent, item_handlers=_handlers(),
                               options=ocp.CheckpointManagerOptions(read_only=True))


def restore_params(path, abstract_params=None) -> Any:
  """Only the parameters of a checkpoint step directory (`<workdir>/checkpoints/<step>`),
  on this process's first device, for finetuning and export. `abstract_params`,
  if given, is checked against the saved shapes first."""
  path = storage.path(path)
  with _quiet_orbax(), _read_only(path) as mgr:
    tree = _state_tree(mgr, int(path.name))
    if abstract_params is not None:
      bad = shape_problems(param_shapes(abstract_params), param_shapes(tree["params"]))
      if bad:
        raise ShapeMismatchError(f"{path} does not fit the model config: " + "; ".join(bad))
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree,
                          is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    out = mgr.restore(int(path.name), args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return out["state"]["params"]


class CheckpointDamagedError(UserError, ValueError):
  pass


def saved_config(path) -> dict:
  """The run config stored with a checkpoint step directory."""
  path = storage.path(path)
  with _quiet_orbax(), _read_only(path) as mgr:
    try:
      return mgr.restore(int(path.name), args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    except ValueError as e:  # JSONDecodeError and Orbax's own
      raise CheckpointDamagedError(
          f"the run config of checkpoint {path} is damaged ({type(e).__name__}: "
          f"{str(e).splitlines()[0][:200]}); use an earlier step of {path.parent}") from None


def saved_configs(run_config: dict) -> tuple[Mamba2Config, Runtime]:
  """(architecture, runtime) of a run config saved with a checkpoint. Runs saved
  before the runtime had its own section kept its fields in `model`."""
  rt_names = Runtime.field_names()
  model = run_config["model"]
  rt = run_config.get("runtime") or {k: v for k, v in model.items() if k in rt_names}
  return (Mamba2Config.from_dict({k: v for k, v in model.items() if k not in rt_names}),
          Runtime.from_dict(rt))


def find_step_dir(path) -> epath.Path | None:
  """`path` as a finished checkpoint step directory: a workdir (its newest step), its
  `checkpoints/` directory, or a step directory itself. None if it is none of these.
  (On a bucket a step being written already holds `state/`: Orbax says which are finished.)"""
  path = storage.path(path)

  def finished(ckdir) -> list[int]:
    return sorted(s for s in ocp.path.step.checkpoint_steps(ckdir) if (ckdir / str(s) / "state").is_dir())

  if path.name.isdigit() and (path / "state").is_dir():
    return path if int(path.name) in finished(path.parent) else None
  ckdir = path if path.name == "checkpoints" else path / "checkpoints"
  if ckdir.is_dir():
    steps = finished(ckdir)
    if steps:
      return ckdir / str(steps[-1])
  return None
