"""A run's curves as one PNG, with no server (`scripts/plot.py`): the loss and the eval
loss against steps and against tokens, the learning rate, the gradient norm, tokens/s,
MFU, the goodput and the device memory, for one run or several side by side.

It reads what the run recorded: `<workdir>/metrics.jsonl` (marker rows left out; the
record already holds each step once, `workdir/record.py`) and, for the tokens axis,
`<workdir>/config.json` (batch_size x seq_len tokens a step). matplotlib's object API,
no pyplot: nothing global changes in the caller's process (no backend chosen).
"""

from __future__ import annotations

import dataclasses
import json
import os

# (row key, panel title, scale for the axis, x axis) in the grid's order; eval_loss rides
# with loss. A panel no run has numbers for says so instead of standing empty.
PANELS = (("loss", "loss (eval dashed)", 1.0, "step"), ("loss", "loss against tokens (eval dashed)", 1.0, "tokens"),
          ("lr", "learning rate", 1.0, "step"), ("grad_norm", "gradient norm", 1.0, "step"),
          ("tokens_per_sec", "tokens/s", 1.0, "step"), ("mfu", "MFU (%)", 100.0, "step"),
          ("goodput", "goodput (%)", 100.0, "step"), ("peak_memory_gib", "device memory at peak (GiB)", 1.0, "step"))


@dataclasses.dataclass
class Run:
  name: str
  rows: list[dict]  # the measurement rows of metrics.jsonl, in order
  tokens_per_step: int | None  # None: config.json missing (no tokens axis)

  def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of `key` over the rows that hold a number for it; x: 'step' or 'tokens'."""
    xs, ys = [], []
    for r in self.rows:
      v = r.get(key)
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        if x == "tokens" and self.tokens_per_step is None:
          continue
        xs.append(r["step"] * (self.tokens_per_step if x == "tokens" else 1))
        ys.append(float(v))
    return xs, ys


class NoRecord(FileNotFoundError):
  """A run path with no metrics.jsonl."""


def read_run(path: str) -> Run:
  """A workdir (or its metrics.jsonl). The run's name is its directory's."""
  from mamba_train.workdir import storage  # pylint: disable=import-outside-toplevel
  p = storage.path(path)
  record = p if p.name.endswith(".jsonl") else p / "metrics.jsonl"
  if not record.exists():
    raise NoRecord(f"{path} holds no metrics.jsonl: pass a run's workdir")
  rows = []
  for line in record.read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:
      continue  # a line cut off by a kill
    if "event" not in row and "step" in row:
      rows.append(row)
  workdir = record.parent
  tokens = None
  if (workdir / "config.json").exists():
    cfg = json.loads((workdir / "config.json").read_text())  # the run config, as the run saved it
    if isinstance(cfg.get("batch_size"), int) and isinstance(cfg.get("seq_len"), int):
      tokens = cfg["batch_size"] * cfg["seq_len"]
  return Run(name=os.path.basename(os.path.normpath(os.fspath(workdir))), rows=rows, tokens_per_step=tokens)


def smoothed(ys: list[float], weight: float) -> list[float]:
  """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
  if not weight:
    return list(ys)
  out, last, n = [], 0.0, 0
  for y in ys:
    last, n = last * weight + (1 - weight) * y, n + 1
    out.append(last / (1 - weight**n))
  return out


def figure(runs: list[Run], smooth: float = 0.6):
  """A matplotlib Figure of PANELS for `runs` (one colour a run). The train loss is
  drawn smoothed (`smooth`, TensorBoard's weight; 0: raw) over its raw curve, faint."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  fig = Figure(figsize=(20, 8.5), layout="constrained")
  axes = fig.subplots(2, 4).ravel()
  colours = [f"C{i % 10}" for i in range(len(runs))]
  for ax, (key, title, scale, x) in zip(axes, PANELS):
    drawn = False
    for run, colour in zip(runs, colours):
      xs, ys = run.series(key, x)
      if xs:
        ys = [y * scale for y in ys]
        if key == "loss" and smooth:
          ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=1)
          ax.plot(xs, smoothed(ys, smooth), color=colour, linewidth=2, label=run.name)
        else:
          ax.plot(xs, ys, color=colour, linewidth=1.5, label=run.name)
        drawn = True
      if key == "loss":
        ex, ey = run.series("eval_loss", x)
        if ex:
          ax.plot(ex, ey, color=colour, linestyle="--", marker="o", markersize=3, linewidth=1.5)
          drawn = True
    ax.set_title(title)
    ax.set_xlabel("tokens" if x == "tokens" else "step")
    ax.grid(alpha=0.3)
    if key == "lr":
      ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if not drawn:
      why = {"tokens": " (no config.json)", "peak_memory_gib": " (a CPU reports none)"}
      ax.text(0.5, 0.5, "not recorded" + why.get(x if x == "tokens" else key, ""),
              ha="center", va="center", transform=ax.transAxes, color="0.5")
  axes[0].legend(loc="upper right")
  return fig


def save(runs: list[Run], out: str, smooth: float = 0.6, dpi: int = 80) -> None:
  """Write the figure of `runs` to `out` (its extension picks the format: .png, .svg, .pdf)."""
  figure(runs, smooth).savefig(out, dpi=dpi)
