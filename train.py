"""Train a Mamba-2 language model.

  python train.py                                     # the tiny default, a few minutes on a CPU
  python train.py --config configs/130m.py --workdir runs/130m --config.steps=1000
  python train.py --config configs/tiny.py --config.optim.lr=1e-3 --config.mesh.fsdp=-1 --config.mesh.data=1

The entry point: flags, the run config validated into its plan
(mamba_train/train/run_config.py), one call into the loop (mamba_train/train/loop.py),
and the one-line exit for what a user can fix.
"""

import logging
import os
import re
import sys
import threading

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend (see the module)

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import base  # noqa: E402
from mamba_train import cli, errors  # noqa: E402
from mamba_train.parallel import distributed  # noqa: E402
from mamba_train.train import loop, run_config  # noqa: E402
from mamba_train.workdir import checkpoint  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
# A misspelt --config.key or a bad value: ml_collections raises it as one of these, with
# a traceback, and for the default --config already here, where the flag is defined.
FLAG_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError)


def bad_flag(e: Exception):
  """One line and exit 2 (the traceback with --debug)."""
  if "--debug" in sys.argv:
    raise e
  text = " ".join(str(e).replace("\\n", "\n").replace("\\'", "'").split())
  if len(text) > 1 and text[0] == text[-1] == "'":  # KeyError inside AttributeError: quoted
    text = text[1:-1]
  print(f"error: bad flag or --config override: {text} (flags: --help; config keys: "
        "configs/base.py)", file=sys.stderr)
  sys.exit(2)


try:
  _CONFIG = config_flags.DEFINE_config_file(
      "config", os.path.join(_HERE, "configs", "tiny.py"), "Run config file (configs/*.py).")
except FLAG_ERRORS as e:
  bad_flag(e)
_FORCE_RESUME = flags.DEFINE_bool(
    "force_resume", False, "Resume a workdir even if its checkpoints hold a different model config.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Output directory; default runs/<config name>-<time>.")
# Multi-process jobs (mamba_train/distributed.py). On a TPU pod, under SLURM or Open MPI
# these are detected; elsewhere give all three, the same address to every process.
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Processes in the job (0 = detect).")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "This process's rank (-1 = detect).")
_INIT_TIMEOUT = flags.DEFINE_integer("init_timeout", 300, "Seconds to wait for all processes to join.")
_DEBUG = flags.DEFINE_bool("debug", False, "Show the traceback of a configuration or data error.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", 100, "Seconds of silence after which a process counts as dead and the job stops.")


def _quiet_library_info(record: logging.LogRecord) -> bool:
  # Orbax logs every save step at INFO; keep its warnings and errors only.
  return record.levelno >= logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.INFO)
  logging.getLogger("absl").addFilter(_quiet_library_info)
  for chatty in ("gcsfs", "fsspec", "google"):  # the bucket clients log every file they open
    logging.getLogger(chatty).setLevel(logging.WARNING)
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           init_timeout=_INIT_TIMEOUT.value, heartbeat_timeout=_HEARTBEAT_TIMEOUT.value,
                           on_peer_lost=lost_peer)
  except distributed.DistributedInitError as e:
    sys.exit(f"error: {e}")
  try:
    config = _CONFIG.value
    # What the user set: the --config.* flags as given, recorded by the flag as it parses
    # them. Not a comparison with the recipe's defaults, which would take a value the user
    # restated (--config.model.d_model=768 on a 130m recipe) for a default and let init_from
    # replace it silently, and which would have to load the recipe again.
    explicit = config_flags.get_override_values(flags.FLAGS["config"])
    plan = run_config.validate(config, num_devices=jax.device_count(),
                               process_count=jax.process_count(), platform=jax.devices()[0].platform,
                               device_kind=jax.devices()[0].device_kind,
                               reference=base.get_config(), data_root=os.path.join(_HERE, "data"),
                               init_model=run_config.init_architecture(config.init_from), explicit=explicit)
    loop.train(plan, _WORKDIR.value, force_resume=_FORCE_RESUME.value)
  except errors.UserError as e:  # the fix is in the message: no traceback unless asked
    if _DEBUG.value:
      raise
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except errors.RunFailure as e:  # a run that started and cannot go on
    if _DEBUG.value:
      raise
    print(f"error: {e}", file=sys.stderr)
    if isinstance(e, checkpoint.CheckpointWriteError):
      # Orbax's writer threads of the failed save would print pages of tracebacks at
      # interpreter shutdown.
      _leave(1)
    sys.exit(1)
  except Exception as e:  # noqa: BLE001 - a collective whose peer is gone, or a bug
    if _DEBUG.value or jax.process_count() == 1 or not LOST_PEER.search(str(e)):
      raise
    lost_peer(str(e).splitlines()[0][:160])


_LOST = threading.Lock()


def lost_peer(reason: str) -> None:
  """One line and exit 1 for a dead peer, whichever notices first: a collective that fails
  here, or the peer watch's thread (mamba_train/parallel/distributed.py); the other waits."""
  _LOST.acquire()  # held until the exit: a second reporter never prints
  step = checkpoint.find_step_dir(_WORKDIR.value)
  # From the watch's thread the progress bar is still open: "\r" starts the line afresh.
  print(f"\rerror: process {jax.process_index()} lost contact with another process of the job "
        f"({reason}); the last complete checkpoint is {step or 'none'}; restart every process to "
        "resume", file=sys.stderr)
  _leave(1)  # the runtime's threads would abort at interpreter shutdown


def _leave(code: int) -> None:
  """Exit now, without interpreter shutdown (train's finally blocks have closed the files and
  released the lock already)."""
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


# What a collective raises when a peer process died (gloo on CPU; the coordination service).
LOST_PEER = re.compile(r"[Gg]loo|Connection (refused|reset|closed)|task died|heartbeat|UNAVAILABLE")


def parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except FLAG_ERRORS as e:
    bad_flag(e)


if __name__ == "__main__":
  cli.freeze_imported()  # the imports above stay out of the garbage collector's walks
  app.run(main, flags_parser=parse_flags)
