"""TensorBoard's view of the run record: every number of a `metrics.jsonl` row as a
scalar of the same name at the row's step, in `<workdir>/tensorboard/`, and the run
config in the text and hparams panels (`tensorboard --logdir <workdir>/tensorboard`).

The writer is TensorBoard's own: its event file writer
(`tensorboard.summary.writer.event_file_writer`, which needs no TensorFlow; torch's
SummaryWriter writes through it) and the summary protos its scalar, text and hparams
plugins read. Not tensorboardX: importing it imports torch wherever torch is installed
(about 5 s of CPU in every training process of the test environment) and Cloud Storage's
client; TensorBoard's writer imports in about 0.2 s, and the same install gives
`tensorboard --logdir`.

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
import time
from typing import Any, Iterable, Mapping

from mamba_train.workdir import storage

DIR = "tensorboard"
_PREFIX = "events.out.tfevents."


# The characters a TensorBoard tag may hold (TensorFlow's op-name rule, which TensorBoard's
# writers apply): a reward function's name `module:function` becomes `module_function`.
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
    self.remote_dir = storage.path(workdir) / DIR
    self._remote = storage.is_remote(workdir)
    self._staging = tempfile.mkdtemp(prefix="mamba_train_events_") if self._remote else None
    self.local_dir = self._staging or os.fspath(self.remote_dir)
    self.run_config = dict(run_config)
    self._writer = None

  def rebuild(self, rows: Iterable[Mapping[str, Any]]) -> None:
    """Start the event file anew from the record's `rows` (a resume, a roll-back, a start)."""
    # Imported here: only a run that writes events needs them.
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    self._close_writer()
    for name in os.listdir(self.local_dir) if os.path.isdir(self.local_dir) else ():
      if name.startswith(_PREFIX):
        os.remove(os.path.join(self.local_dir, name))
    os.makedirs(self.local_dir, exist_ok=True)
    # Its thread flushes every flush_secs; `sync` flushes at the record's rhythm.
    self._writer = EventFileWriter(self.local_dir, flush_secs=30)
    self._write_config()
    for row in rows:
      if "step" in row:
        self.write(row["step"], row)
    self.sync(replace=True)

  def _add(self, step: int, *values) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                           summary=summary_pb2.Summary(value=list(values))))

  def _write_config(self) -> None:
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2
    from tensorboard.plugins.hparams import api_pb2, metadata as hparams_metadata, plugin_data_pb2
    from tensorboard.plugins.text import metadata as text_metadata
    text = json.dumps(self.run_config, indent=2, default=str)
    # The text plugin renders markdown: an indented block keeps the JSON as it is.
    block = "\n".join("    " + line for line in text.splitlines()).encode()
    self._add(0, summary_pb2.Summary.Value(
        tag="config", metadata=text_metadata.create_summary_metadata("config", "the run config"),
        tensor=tensor_pb2.TensorProto(dtype="DT_STRING", string_val=[block],
                                      tensor_shape=tensor_shape_pb2.TensorShapeProto(
                                          dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))))
    # The hparams panel: the experiment (the fields and the metrics it lists), the session's values.
    start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    infos = []
    for name, value in _hparams(self.run_config).items():
      if isinstance(value, bool):
        start.hparams[name].bool_value, kind = value, "DATA_TYPE_BOOL"
      elif isinstance(value, (int, float)):
        start.hparams[name].number_value, kind = float(value), "DATA_TYPE_FLOAT64"
      else:
        start.hparams[name].string_value, kind = str(value), "DATA_TYPE_STRING"
      infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind)))
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in ("loss", "eval_loss")])
    for tag, data in ((hparams_metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)),
                      (hparams_metadata.SESSION_START_INFO_TAG,
                       plugin_data_pb2.HParamsPluginData(session_start_info=start))):
      data.version = hparams_metadata.PLUGIN_DATA_VERSION
      self._add(0, summary_pb2.Summary.Value(tag=tag, metadata=hparams_metadata.create_summary_metadata(data)))

  def write(self, step: int, row: Mapping[str, Any]) -> None:
    from tensorboard.compat.proto import summary_pb2
    values = [summary_pb2.Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(row).items()]
    if values:
      self._add(step, *values)

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
