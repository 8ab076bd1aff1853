"""TensorBoard's view of the run record: every number of a `metrics.jsonl` row as a
scalar of the same name at the row's step, in `<workdir>/tensorboard/`, and the run
config in the text and hparams panels (`tensorboard --logdir <workdir>/tensorboard`).

The writer is tensorboardX: it writes TensorBoard's event files with protobuf alone (no
TensorFlow, no torch; a few hundred kB), and builds the scalar, text and hparams
summaries TensorBoard's plugins read. TensorBoard's own package carries its server
(grpcio, werkzeug, the data server) for writing a few numbers; users who view the runs
install it anyway.

The view is rebuilt from the record (`rebuild`): `metrics.jsonl` is the truth, as it is
for W&B, and an event file cannot be cut back. When a run resumes or rolls back, the
record sets aside the rows past the restored step (`record.set_aside_after`), and the
view is written anew from the rows it kept: one event file, each scalar once a step, the
killed run's later steps gone with their rows. Rebuilding reads the record once, at a
resume; the rows it writes cost microseconds each.

On a bucket, where objects cannot be appended to, the event file is written to a local
directory and uploaded whole at each `sync` (the record's own rhythm: every
`sync_every_s` and at each checkpoint), as `metrics.jsonl` is.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any, Iterable, Mapping

from mamba_train.workdir import storage

DIR = "tensorboard"
_PREFIX = "events.out.tfevents."


# The characters a TensorBoard tag may hold (tensorboardX's rule, which would rename the
# others itself and log a line each time): a reward function's name `module:function`
# becomes `module_function`.
_NOT_IN_TAGS = re.compile(r"[^-/\w.]")

# Numbers of a row that name rather than measure: the goodput's run id (its start time,
# which a float32 scalar could not even hold).
_NOT_MEASURES = frozenset({"step", "goodput/run"})


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
  """The numbers of a record row that TensorBoard plots: finite ints and floats, not
  booleans, lists (the router's per-expert token counts) or strings, under TensorBoard's
  spelling of the name (`_NOT_IN_TAGS`); none of a marker
  row (`"event"`: a resume, a roll-back, the closing goodput of a step already logged),
  so that each scalar has one value a step."""
  if "event" in row:
    return {}
  return {_NOT_IN_TAGS.sub("_", k): float(v) for k, v in row.items()
          if k not in _NOT_MEASURES and isinstance(v, (int, float)) and not isinstance(v, bool)
          and math.isfinite(v)}


def _hparams(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """The run config flattened to dotted names, each a number, a bool or a string (the
  kinds TensorBoard's hparams panel holds); lists and None as their JSON text."""
  out = {}
  for k, v in config.items():
    name = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(_hparams(v, name + "."))
    elif isinstance(v, (bool, int, float, str)):
      out[name] = v
    else:
      out[name] = json.dumps(v, default=str)
  return out


class TensorBoardView:
  """The event file of one run, in `<workdir>/tensorboard/`. Only process 0 makes one."""

  def __init__(self, workdir, run_config: Mapping[str, Any]):
    from tensorboardX import FileWriter  # imported here: only a run that writes events needs it
    self._file_writer = FileWriter
    self.remote_dir = storage.path(workdir) / DIR
    self._remote = storage.is_remote(workdir)
    self._staging = tempfile.mkdtemp(prefix="mamba_train_events_") if self._remote else None
    self.local_dir = self._staging or os.fspath(self.remote_dir)
    self.run_config = dict(run_config)
    self._writer = None

  def rebuild(self, rows: Iterable[Mapping[str, Any]]) -> None:
    """Start the event file anew from the record's `rows` (a resume, a roll-back, a start)."""
    self._close_writer()
    for name in os.listdir(self.local_dir) if os.path.isdir(self.local_dir) else ():
      if name.startswith(_PREFIX):
        os.remove(os.path.join(self.local_dir, name))
    os.makedirs(self.local_dir, exist_ok=True)
    # The background thread flushes every flush_secs; `sync` flushes at the record's rhythm.
    self._writer = self._file_writer(self.local_dir, flush_secs=30)
    self._write_config()
    for row in rows:
      if "step" in row:
        self.write(row["step"], row)
    self.sync(replace=True)

  def _write_config(self) -> None:
    from tensorboardX import summary
    text = json.dumps(self.run_config, indent=2, default=str)
    # The text plugin renders markdown: an indented block keeps the JSON as it is.
    self._writer.add_summary(summary.text("config", "\n".join("    " + l for l in text.splitlines())), 0)
    # The hparams panel: the config's fields beside the metrics it lists for each run.
    for s in summary.hparams(_hparams(self.run_config), {"loss": None, "eval_loss": None}):
      self._writer.add_summary(s, 0)

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    from tensorboardX import summary
    for tag, value in scalars(row).items():
      self._writer.add_summary(summary.scalar(tag, value), int(step))

  def sync(self, replace: bool = False) -> None:
    """Flush the event file; on a bucket upload it whole (and, `replace`, remove the
    bucket's older event files, which a rebuild replaced)."""
    if self._writer is None:
      return
    self._writer.flush()
    if not self._remote:
      return
    names = [n for n in os.listdir(self.local_dir) if n.startswith(_PREFIX)]
    for name in names:
      with open(os.path.join(self.local_dir, name), "rb") as f:
        (self.remote_dir / name).write_bytes(f.read())  # one upload: the object appears whole
    if replace and self.remote_dir.exists():
      for old in self.remote_dir.iterdir():
        if old.name.startswith(_PREFIX) and old.name not in names:
          old.unlink()

  def _close_writer(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def close(self) -> None:
    self.sync()
    self._close_writer()
    if self._staging is not None:
      shutil.rmtree(self._staging, ignore_errors=True)
      self._staging = None
