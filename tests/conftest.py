"""Suite-wide settings, applied before any test imports JAX.

* One persistent compilation cache for the whole run, shared with the train.py
  subprocesses the end-to-end tests start (they inherit the environment): runs
  of the same shapes then compile once instead of once per process.
* XLA:CPU flags that make compiling about 3x faster (less optimisation of the
  generated code). The suite is compile-bound on tiny shapes; numerics stay
  within float32 rounding. Subprocess tests that set XLA_FLAGS add them too.
* The XLA:CPU default every entry point applies (mamba_train.xla_flags), so the
  tests compile what train.py runs.
"""

import os
import tempfile

FAST_XLA = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
            "--xla_cpu_use_fusion_emitters=false")

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="mamba_train_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_XLA).strip()

from mamba_train.xla_flags import apply_cpu_defaults  # noqa: E402  (after the variables above)

apply_cpu_defaults()
