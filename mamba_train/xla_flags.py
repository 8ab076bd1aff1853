"""XLA:CPU defaults this package applies on import (before JAX starts a backend).

jaxlib 0.10's XLA:CPU hands matmuls and the elementwise/reduction work around them
to YNNPACK fusions by default. For Mamba-2 that is slower: on a 2-core AVX2 host
(EPYC Zen 3) turning the fusions off made the 130m train step 1.35x faster (MFU
40% -> 57% of the measured matmul rate), the tiny one 1.2x and the SSD's
forward+backward 1.3x, while a plain 2048^3 matmul runs at the same rate either
way (scripts/bench.py; docs/bench/results.md). The YNN fusions also crashed
(SIGSEGV) running one SSD gradient in testing. The flag only touches the CPU
backend; GPUs and TPUs are unaffected.

Not applied when XLA_FLAGS already sets xla_cpu_experimental_ynn_fusion_type
(yours wins) or MAMBA_TRAIN_KEEP_XLA_FLAGS=1. It cannot apply once JAX has
created its CPU backend (import mamba_train before running any JAX computation,
as train.py and scripts/ do).
"""

import os

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def apply_cpu_defaults(environ=os.environ) -> bool:
  """Append the flag to XLA_FLAGS unless opted out; True when it was added."""
  flags = environ.get("XLA_FLAGS", "")
  if environ.get("MAMBA_TRAIN_KEEP_XLA_FLAGS") == "1" or "xla_cpu_experimental_ynn_fusion_type" in flags:
    return False
  environ["XLA_FLAGS"] = (flags + " " + YNN_FLAG).strip()
  return True
