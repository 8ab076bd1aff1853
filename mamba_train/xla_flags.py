"""The XLA:CPU default that mamba_train's entry points apply before JAX starts
a backend (train.py, scripts/, benchmarks/ and the test suite call
`apply_cpu_defaults` first; importing the library changes nothing).

jaxlib's XLA:CPU hands matmuls and the elementwise and reduction work around them
to YNNPACK fusions by default. For Mamba-2 turning them off is faster: train
steps and the SSD gain while a plain matmul runs at the same rate either way
(docs/bench/design_notes.md has the figures). The YNN fusions also crashed
(SIGSEGV) running one SSD gradient in testing. The flag only touches the CPU
backend; GPUs and TPUs are unaffected.

Not applied when XLA_FLAGS already sets xla_cpu_experimental_ynn_fusion_type
(yours wins) or MAMBA_TRAIN_KEEP_XLA_FLAGS=1. It cannot apply once JAX has
created its CPU backend: call it before running any JAX computation.
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
