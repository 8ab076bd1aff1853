"""The smallest SSD window W at which a trained model's validation loss stays within
a tolerance of the exact model's, overall and per layer (mamba_train/tools/window_search.py).

  python scripts/window_search.py --model=runs/tiny --data=data/default --seq_len=4096
  python scripts/window_search.py --model=/path/to/hf_dir --data=data/web \
      --min_window=512 --max_window=2048 --window_step=256 --tolerance=0.01 --out=w.json
  python scripts/window_search.py --model=... --data=... --windows=256,1024 --noper_layer

--model is anything `mamba_train.load_model` accepts (a workdir, a checkpoint step, a
transformers or mamba_ssm directory); --data a prepared data directory with a
validation split, as train.py reads. Each candidate compiles the model once overall
and once per layer, so the search costs (1 + layers) x candidates evaluations.
"""

import json
import sys

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend

from absl import flags  # noqa: E402

import mamba_train  # noqa: E402
from mamba_train import cli  # noqa: E402
from mamba_train.data import prepare  # noqa: E402
from mamba_train.data.loader import make_eval_loader, validate_for_model  # noqa: E402
from mamba_train.errors import UserError  # noqa: E402
from mamba_train.interop.load import load_config  # noqa: E402
from mamba_train.tools import window_search  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "Workdir, checkpoint, transformers or mamba_ssm dir.",
                             required=True)
_DATA = flags.DEFINE_string("data", None, "Prepared data directory (its validation split).",
                            required=True)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Positions per evaluated sequence (> every window).")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Sequences per batch.")
_BATCHES = flags.DEFINE_integer("batches", 4, "Validation batches (the first ones).")
_MIN = flags.DEFINE_integer("min_window", 512, "Smallest candidate window.")
_MAX = flags.DEFINE_integer("max_window", 2048, "Largest candidate window.")
_STEP = flags.DEFINE_integer("window_step", 256, "Step between candidates.")
_WINDOWS = flags.DEFINE_list("windows", None, "Explicit candidates (replaces the range).")
_TOL = flags.DEFINE_float("tolerance", 0.01, "Allowed loss above the exact model's, nats/token.")
_PER_LAYER = flags.DEFINE_boolean("per_layer", True, "Also window one layer at a time.")
_OUT = flags.DEFINE_string("out", None, "Write the report as JSON here.")


def main(argv):
  del argv
  cli.must_exist(_MODEL.value, "--model")
  cli.must_exist(_DATA.value, "--data")
  windows = ([int(w) for w in _WINDOWS.value] if _WINDOWS.value
             else list(range(_MIN.value, _MAX.value + 1, _STEP.value)))
  try:
    # The candidates against the model's config before any weight is read.
    window_search.check_candidates(load_config(_MODEL.value), windows, _SEQ_LEN.value)
    model = mamba_train.load_model(_MODEL.value)
    validate_for_model(prepare.read_metadata(_DATA.value), model.config.vocab_size)
    batches = list(make_eval_loader(_DATA.value, seq_len=_SEQ_LEN.value,
                                    global_batch_size=_BATCH.value, num_batches=_BATCHES.value))
    report = window_search.search(model, batches, windows, tolerance=_TOL.value,
                                  per_layer=_PER_LAYER.value)
  except (UserError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(report.table())
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(report.to_dict(), f, indent=2)


if __name__ == "__main__":
  cli.run(main)
