"""GRPO rollout speed (`mamba_train.rollout.rollout`) on random weights: B prompts x G
completions sampled at temperature 1 (no EOS, so every row runs --new_tokens), the
prompts prefilled once and their state copied G times; beside it `generate` on the same
B*G rows (each prompt prefilled G times, no log-probabilities).

  python -m benchmarks.rollout --config tiny,130m --prompts 2 --group 4 --new_tokens 64

Tokens/s counts completion tokens over prefill + decode wall time; medians of --repeats
after a warm-up call, compile timed apart (the first call's).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np
from flax import nnx

from benchmarks.common import CORES, log
from mamba_train.generation import generate_with_stats
from mamba_train.model.config import config_for
from mamba_train.model.lm import Mamba2LM
from mamba_train.rollout import rollout
from mamba_train.xla_flags import apply_cpu_defaults


def bench_rollout(size: str, prompts: int, group: int, prompt_len: int, new_tokens: int,
                  repeats: int) -> dict:
  cfg = config_for(size)
  model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  # Prompts of different lengths up to prompt_len (left-padded to one power of two).
  ids = [rng.integers(0, cfg.vocab_size, max(1, prompt_len - 3 * i)) for i in range(prompts)]
  runs = [rollout(model, ids, group, new_tokens, key=jax.random.key(i), temperature=1.0).stats
          for i in range(repeats + 2)]
  first, timed = runs[0], runs[2:]  # compile; warm-up; timed
  med = lambda k: statistics.median(s[k] for s in timed)
  row = {"config": size, "prompts": prompts, "group": group, "prompt_len": prompt_len,
         "new_tokens": new_tokens, "compile_s": first["compile_s"], "prefill_s": med("prefill_s"),
         "decode_s": med("decode_s"), "seconds": med("seconds"),
         "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed)}
  # generate on the B*G rows: every copy prefilled, no log-probabilities.
  rows = [p for p in ids for _ in range(group)]
  gen = [generate_with_stats(model, rows, new_tokens, temperature=1.0, seed=i)[1]
         for i in range(repeats + 2)]
  row["generate_compile_s"] = gen[0].compile_s
  row["generate_tokens_per_s"] = statistics.median(s.tokens_per_s for s in gen[2:])
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="tiny,130m")
  ap.add_argument("--prompts", type=int, default=2)
  ap.add_argument("--group", type=int, default=4)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--new_tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  a = ap.parse_args()
  apply_cpu_defaults()  # before JAX starts its CPU backend, as `python -m benchmarks` does
  log(f"{jax.devices()[0].device_kind}, {CORES} cores: B={a.prompts} prompts x G={a.group}, "
      f"prompts up to {a.prompt_len} tokens, {a.new_tokens} new tokens, median of {a.repeats}")
  log("| config | rollout tokens/s | prefill s | decode s | compile s | generate on B*G rows, tokens/s |")
  log("|---|---|---|---|---|---|")
  for size in a.config.split(","):
    r = bench_rollout(size, a.prompts, a.group, a.prompt_len, a.new_tokens, a.repeats)
    log(f"| {size} | {r['tokens_per_s']:.0f} | {r['prefill_s']:.3f} | {r['decode_s']:.3f} | "
        f"{r['compile_s']:.1f} | {r['generate_tokens_per_s']:.0f} |")


if __name__ == "__main__":
  main()
