"""Low-precision matmuls (`runtime.matmul_precision`): what int8 decoding reads a token
on one TPU v6e (AOT via libtpu), and its tokens/s on this CPU, against the compute
dtype's. The training step's figures come from `scripts/aot_compile.py` with
`--config.runtime.matmul_precision=int8` (docs/bench/precision.md).

  python -m benchmarks.precision decode_bytes --config 130m,1.3b
  python -m benchmarks.precision cpu_decode --config 130m --new_tokens 32
"""

from __future__ import annotations

import argparse

import numpy as np
from flax import nnx

from benchmarks.common import log
from benchmarks.decode import compile_decode_step
from mamba_train.generation import generate_with_stats
from mamba_train.model.config import config_for
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.runtime import Runtime


def decode_bytes(sizes):
  """HBM bytes of one batch-1 decode step (the loop body, weights prepared once per
  call as `generate` prepares them), bfloat16 against int8 weights."""
  for size in sizes:
    cfg = config_for(size)
    for prec in ("default", "int8"):
      r = compile_decode_step(cfg, Runtime(compute_dtype="bfloat16", matmul_precision=prec),
                              unrolled=True, precast=True)
      log(f"{size} v6e decode step, {'bf16' if prec == 'default' else prec} weights: HBM est. "
          f"{r['hbm_bytes_est']:.3e} bytes a token, XLA {r['xla_bytes']:.3e}, "
          f"{r['fusions']} fusions, compile {r['compile_cpu_s']:.1f}s cpu")


def cpu_decode(sizes, new_tokens, repeats):
  """Greedy tokens/s of `generate` at batch 1 on this CPU, float32 against int8 weights
  (float32 compute dtype both: XLA:CPU's matmuls are no faster in bfloat16). The
  minimum over repeats (a shared machine), compile apart."""
  for size in sizes:
    cfg = config_for(size)
    base = Mamba2LM(cfg, rngs=nnx.Rngs(0)).params()
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, 16).tolist()
    rates = {}
    for prec in ("default", "int8"):
      model = Mamba2LM.from_params(cfg, base, Runtime(matmul_precision=prec))
      runs = [generate_with_stats(model, prompt, new_tokens, eos_id=None)[1] for _ in range(repeats + 1)]
      rates[prec] = max(s.tokens_per_s for s in runs[1:])
      log(f"{size} CPU decode, {'float32' if prec == 'default' else prec} weights: "
          f"{rates[prec]:.1f} tokens/s (best of {repeats}, prefill included), compile {runs[0].compile_s:.1f}s")
    log(f"{size} int8 / float32: {rates['int8'] / rates['default']:.2f}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("what", choices=["decode_bytes", "cpu_decode"])
  ap.add_argument("--config", default="130m")
  ap.add_argument("--new_tokens", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=3)
  a = ap.parse_args()
  sizes = a.config.split(",")
  if a.what == "decode_bytes":
    decode_bytes(sizes)
  else:
    cpu_decode(sizes, a.new_tokens, a.repeats)


if __name__ == "__main__":
  main()
