"""Writes the prompts of GRPO's synthetic task: copy the last digit.

Each prompt is a few random digits and a colon ("4715:"); the answer is the last digit ("5"),
scored by mamba_train.train.rewards:closeness (1 for the digit, less for a character near it
in code points, 0 far from it). A byte-level model trained from scratch (configs/grpo.py)
learns in 20 GRPO steps on a CPU to answer with a digit (mean reward 0.05 to about 0.7);
copying the right one takes longer.

  python scripts/grpo_task.py --out=data/grpo_task.jsonl
  python train.py --config configs/grpo.py --workdir runs/grpo-task --config.grpo.prompts=data/grpo_task.jsonl
"""

import json
import os

import numpy as np
from absl import flags

from mamba_train import cli

_OUT = flags.DEFINE_string("out", "data/grpo_task.jsonl", "The prompts file to write.")
_N = flags.DEFINE_integer("n", 1000, "Prompts.", lower_bound=1)
_DIGITS = flags.DEFINE_integer("digits", 4, "Digits per prompt.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")


def prompts(n: int, digits: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    s = "".join(str(d) for d in rng.integers(0, 10, digits))
    rows.append({"prompt": f"{s}:", "answer": s[-1]})
  return rows


def main(argv):
  del argv
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    for row in prompts(_N.value, _DIGITS.value, _SEED.value):
      f.write(json.dumps(row) + "\n")
  print(f"wrote {_N.value} prompts to {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
