"""Goodput: where a run's wall time goes. Productive step time against compiling,
checkpoint saves and restores, waiting for data, evaluation, and the step time that a
restart loses (the steps a resumed run trains again).

The loop wraps each part of its work in `phase(name)`; phases nest, and time spent in
an inner phase counts for it alone (a save inside a step's hooks is save time, not step
time), so the phases are disjoint and, with `other` (what no phase covers), add up to
the wall time since the tracker started. `row()` is what the loop writes to
`metrics.jsonl` (and W&B) as `goodput/<phase>_s`, plus `goodput/wall_s` and
`goodput` (the step share); `summary()` is the line it logs at the end of a run.

The step time lost to a restart is read from the record the stopped run left: its
rows carry the cumulative step time of their run (`goodput/step_s`, and the run's start
time `goodput/run`), so the step time it spent after the step a resume restores is
`lost_to_restart`. Steps after the stopped run's last logged row are not in its record:
the figure is a lower bound by at most `log_every` steps' time.

(Google's ml-goodput-measurement, which MaxText uses, computes these from a job's Cloud
Logging records and needs a Google Cloud project; a run on a disk, a CPU or a GPU cluster
has none, hence this small module.)
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Iterator

import jax

from mamba_train.metrics import Timer
from mamba_train.workdir import storage

# The loop's phases, in the order the summary lists them.
# A GRPO step's rollout (generation on the device) and rewards (scoring on the host) are
# phases of their own beside its optimizer steps ("step").
PHASES = ("step", "compile", "checkpoint_save", "checkpoint_restore", "data", "eval", "setup", "rollout",
          "reward")
LABELS = {"step": "steps", "compile": "compile", "checkpoint_save": "checkpoint save",
          "checkpoint_restore": "checkpoint restore", "data": "data wait", "eval": "evaluation",
          "setup": "setup", "rollout": "rollout", "reward": "rewards", "other": "other"}


class Goodput:
  """Seconds by phase since it was made (the start of the run)."""

  def __init__(self):
    self.wall = Timer()
    self.run = time.time()  # names this run's rows in the record
    self.seconds = dict.fromkeys(PHASES, 0.0)
    self._stack: list[list] = []  # [name, timer, seconds in nested phases]
    self.lost_to_restart = 0.0

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    if name not in self.seconds:
      raise ValueError(f"unknown goodput phase {name!r}; one of {PHASES}")
    entry = [name, Timer(), 0.0]
    self._stack.append(entry)
    try:
      yield
    finally:
      self._stack.pop()
      spent = entry[1].elapsed
      self.seconds[name] += spent - entry[2]
      if self._stack:
        self._stack[-1][2] += spent

  def hook(self, name: str, fn):
    """A hook body `fn(step, state, metrics)` counted as phase `name`. It first waits for
    the step's metrics: steps are dispatched asynchronously, and a save or an evaluation
    would otherwise count the step it waits for as its own time."""

    def run(step, state, metrics, *args, **kwargs):
      if metrics is not None:
        jax.block_until_ready(metrics)
      with self.phase(name):
        return fn(step, state, metrics, *args, **kwargs)
    return run

  def setup_done(self) -> None:
    """The loop starts: the time so far that no phase took is setup (mesh, data, model)."""
    self.seconds["setup"] += max(self.wall.elapsed - sum(self.seconds.values()), 0.0)

  def row(self) -> dict[str, float]:
    wall = self.wall.elapsed
    covered = dict(self.seconds)
    for name, timer, nested in self._stack:  # phases still open count up to now
      covered[name] += timer.elapsed - nested
    other = max(wall - sum(covered.values()), 0.0)
    out = {f"goodput/{k}_s": round(v, 4) for k, v in covered.items()}
    out.update({"goodput/other_s": round(other, 4), "goodput/wall_s": round(wall, 4),
                "goodput/lost_to_restart_s": round(self.lost_to_restart, 4),
                "goodput": round(covered["step"] / wall, 4) if wall > 0 else 0.0,
                "goodput/run": self.run})
    return out

  def summary(self) -> str:
    return summary(self.row())


def summary(row: dict) -> str:
  """One line of a goodput row: the wall time, each phase's share, the restart's loss."""
  wall = row["goodput/wall_s"]
  parts = [f"{LABELS[k]} {100 * row[f'goodput/{k}_s'] / wall:.1f}%"
           for k in (*PHASES, "other") if row.get(f"goodput/{k}_s", 0) > 0 or k == "step"] if wall else []
  lost = row.get("goodput/lost_to_restart_s", 0)
  lost = f"; {lost:.1f} s of earlier runs' step time lost to the restart" if lost else ""
  return f"goodput: {wall:.1f} s wall: {', '.join(parts)}{lost}"


def lost_to_restart(metrics_path, restored: int) -> tuple[float, int | None, dict | None]:
  """(seconds of step time the runs recorded in `metrics_path` spent on steps after
  `restored`, the last step they recorded, the last goodput row), from their cumulative
  `goodput/step_s`; read before the record sets those rows aside."""
  path = storage.path(metrics_path)
  if not path.exists():
    return 0.0, None, None
  runs: dict[float, dict[str, float]] = {}  # run -> cumulative step time at `restored`, at its end
  last = final = None
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
      run, step, spent = row["goodput/run"], int(row["step"]), float(row["goodput/step_s"])
    except (ValueError, KeyError, TypeError):
      continue  # other rows, a torn line
    r = runs.setdefault(run, {"at": 0.0, "end": 0.0})
    if step <= restored:
      r["at"] = spent
    r["end"] = spent
    last, final = (step if last is None else max(last, step)), row
  return sum(max(r["end"] - r["at"], 0.0) for r in runs.values()), last, final
