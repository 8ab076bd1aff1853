"""Suite-wide settings, applied before any test imports JAX.

One persistent compilation cache for the whole run, shared with the train.py
subprocesses the end-to-end tests start (they inherit the environment): runs of
the same shapes then compile once instead of once per process.
"""

import os
import tempfile

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="mamba_train_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
