"""The run record: `<workdir>/metrics.jsonl`, one JSON object a row, mirrored to Weights &
Biases and to TensorBoard's event files (`events.py`); and the rows a resumed or
rolled-back run sets aside so each step is logged once.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from typing import Any, Mapping

from mamba_train.workdir import events, storage


def _plain(v):
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return None if math.isnan(v) else str(v)
  return v


def set_aside_after(path, step: int) -> str | None:
  """Keep in `path` (a metrics.jsonl, local or on a bucket) only the rows of steps <=
  `step`, so that a run resumed from the checkpoint of `step` logs each later step once.
  The other rows (and any line cut off by a kill) go, in order, to
  `<path>.after-<step>[.n]`, which is written before `path` is replaced; each of the two
  writes is atomic (`storage.write_text`: a rename on a disk, one upload on a bucket),
  so no row is ever lost. Returns the set-aside file's name, or None when there was
  nothing to move."""
  path = storage.path(path)
  if not path.exists():
    return None
  rows = path.read_text().split("\n")  # the last: "" or a line cut off by a kill
  lines = [l + "\n" for l in rows[:-1]] + ([rows[-1] + "\n"] if rows[-1] else [])
  keep, later = [], []
  for line in lines:
    try:
      row_step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
      row_step = None  # a torn line: never a record of a kept step
    (keep if row_step is not None and row_step <= step else later).append(line)
  if not later:
    return None
  aside, n = path.with_name(f"{path.name}.after-{step}"), 1
  while aside.exists():
    aside, n = path.with_name(f"{path.name}.after-{step}.{n}"), n + 1
  storage.write_text(aside, "".join(later))
  storage.write_text(path, "".join(keep))
  return aside.name


def _rows(text: str):
  """The complete rows of a record's text (set_aside_after has moved any torn line)."""
  for line in text.splitlines():
    try:
      yield json.loads(line)
    except ValueError:
      continue


class MetricsWriter:
  """Appends one JSON object per call to `workdir/metrics.jsonl` and logs the
  same values to a W&B run (mode 'offline' needs no network or account;
  'disabled' writes nothing there) and, `tensorboard`, as TensorBoard scalars in
  `workdir/tensorboard/` (`events.TensorBoardView`, rebuilt from the kept rows whenever
  rows are set aside). Only process 0 writes.

  `resumed_from`: the step a resumed run restored. Rows of later steps, logged by
  the run that stopped, are set aside (`set_aside_after`) and a marker row
  `{"step": N, "event": "resumed", ...}` says where the record continues.

  On a bucket, where an object cannot be appended to, rows go to a local copy that
  is uploaded whole (one atomic write) every `sync_every_s`, at `sync()` (the train
  loop calls it at each checkpoint, so the record reaches every saved step) and at
  `close()`; W&B then keeps its files under $WANDB_DIR or ./wandb, not in the bucket.
  """

  def __init__(self, workdir, *, wandb_cfg: Mapping[str, Any], run_config: Mapping[str, Any],
               is_main: bool = True, resumed_from: int | None = None, sync_every_s: float = 60.0,
               tensorboard: bool = True):
    self.is_main = is_main
    self.path = storage.path(workdir) / "metrics.jsonl"
    self._remote = storage.is_remote(workdir)
    self._staging = None
    self._local = self.path
    if is_main and self._remote:
      self._staging = tempfile.mkdtemp(prefix="mamba_train_metrics_")
      self._local = os.path.join(self._staging, "metrics.jsonl")
    self.sync_every_s = sync_every_s
    self._synced = time.monotonic()
    self._file = None
    self._tb = events.TensorBoardView(workdir, run_config) if is_main and tensorboard else None
    if is_main:
      self.rewind(resumed_from or 0, {"event": "resumed" if resumed_from else "restarted"},
                  always=bool(resumed_from))
    self._wandb = None
    if is_main and wandb_cfg["mode"] != "disabled":
      import wandb  # imported here: it is slow to import and tests mostly disable it
      self._wandb = wandb.init(
          mode=wandb_cfg["mode"], project=wandb_cfg["project"], name=wandb_cfg["name"] or None,
          dir=None if self._remote else os.fspath(workdir), config=dict(run_config), resume="allow")

  def rewind(self, step: int, marker: Mapping[str, Any], *, always: bool = True) -> None:
    """The run continues after `step` (a resume, a rollback): rows of later steps are set
    aside and a marker row `{"step": step, **marker, "set_aside": file}` is written
    (`always=False`: only if some rows were set aside)."""
    if not self.is_main:
      return
    if self._file is not None:
      self._file.close()
      self.sync()  # the whole record where set_aside_after reads it
    aside = set_aside_after(self.path, step)
    kept = self.path.read_text() if self.path.exists() else ""
    if self._remote:  # the local copy starts from the bucket's record
      with open(self._local, "w") as f:
        f.write(kept)
    if self._tb is not None:
      self._tb.rebuild(_rows(kept))
    self._file = open(self._local, "a")
    if always or aside:
      self._file.write(json.dumps({"step": int(step), **marker, "set_aside": aside}) + "\n")
      self._file.flush()
      self.sync()

  def write(self, step: int, values: Mapping[str, Any]) -> None:
    if not self.is_main:
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._remote and time.monotonic() - self._synced > self.sync_every_s:
      self.sync()
    if self._tb is not None:
      self._tb.write(step, row)
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=int(step))

  def sync(self) -> None:
    """On a bucket: upload the record whole (one atomic write). Nothing to do on a disk."""
    if self._remote and self.is_main and os.path.exists(self._local):
      with open(self._local) as f:
        storage.write_text(self.path, f.read())
    if self._tb is not None and self.is_main:
      self._tb.sync()
    self._synced = time.monotonic()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
      self.sync()
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._staging is not None:
      shutil.rmtree(self._staging, ignore_errors=True)
      self._staging = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None
