"""Draws one or several runs' curves into one image, with no server.

  python scripts/plot.py runs/tiny-20261204-120000 --out tiny.png
  python scripts/plot.py runs/a runs/b --out compare.png --smooth 0

The loss and the eval loss against steps and tokens, the learning rate, the gradient
norm, tokens/s, MFU, the goodput and the device memory at peak, one colour a run
(mamba_train/tools/plot.py). Each RUN is a workdir (local or gs://) or its
metrics.jsonl. Needs matplotlib: pip install -e '.[plot]'.
"""

from absl import app, flags

from mamba_train import cli

_OUT = flags.DEFINE_string("out", None, "The image to write (.png, .svg or .pdf).", required=True)
_SMOOTH = flags.DEFINE_float("smooth", 0.6, "TensorBoard's smoothing weight for the train loss, in [0, 1) "
                             "(0: raw).", lower_bound=0.0, upper_bound=0.999)


def main(argv):
  runs = argv[1:]
  if not runs:
    raise app.UsageError("name at least one run: plot.py RUN [RUN...] --out FILE.png")
  try:
    import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise app.UsageError("plot.py needs matplotlib: pip install -e '.[plot]'") from None
  from mamba_train.tools import plot  # pylint: disable=import-outside-toplevel
  try:
    read = [plot.read_run(r) for r in runs]
  except plot.NoRecord as e:
    raise app.UsageError(str(e)) from None
  plot.save(read, _OUT.value, smooth=_SMOOTH.value)
  print(f"wrote {_OUT.value}: {', '.join(f'{r.name} ({len(r.rows)} rows)' for r in read)}")


if __name__ == "__main__":
  cli.run(main)
