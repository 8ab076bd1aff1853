"""Suite-wide settings, applied before any test imports JAX.

* One persistent compilation cache for the whole run, shared with the train.py
  subprocesses the end-to-end tests start (they inherit the environment): runs
  of the same shapes then compile once instead of once per process.
* One OpenMP thread for torch and numpy's BLAS (below).
* XLA:CPU flags that make compiling about 3x faster (less optimisation of the
  generated code). The suite is compile-bound on tiny shapes; numerics stay
  within float32 rounding. Subprocess tests that set XLA_FLAGS add them too.
* The XLA:CPU default every entry point applies (mamba_train.xla_flags), so the
  tests compile what train.py runs.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from helpers import FAST_XLA

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="mamba_train_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_XLA).strip()
# The reference libraries' CPU math (torch's intra-op pool, numpy's BLAS) on one thread: two
# workers share two cores, and an OpenMP pool sized to the machine spins on the core the other
# worker computes on. torch's float32 forward of the 130m parity model took 12.3 CPU seconds
# with two threads on the loaded host against 3.1 with one (docs/bench/suite.md). Set before
# any test imports torch; subprocesses inherit it. XLA's own pool does not read it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from mamba_train.xla_flags import apply_cpu_defaults  # noqa: E402  (after the variables above)

apply_cpu_defaults()


@pytest.fixture(scope="session")
def on_simulated_devices():
  """`run(script, out_dir)`: run `python script out_dir` on 8 simulated CPU devices
  (the device count is fixed when JAX starts, so multi-device checks run in their
  own process), with the fast-compile flags; fails with the end of its stderr.
  Returns what the script wrote to out_dir/results.json."""
  def run(script, out_dir, devices=8, timeout=600):
    flags = f"--xla_force_host_platform_device_count={devices} {FAST_XLA}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    apply_cpu_defaults(env)  # the YNNPACK default train.py runs with (the flags above replaced it)
    proc = subprocess.run([sys.executable, script, str(out_dir)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out_dir, "results.json")) as f:
      return json.load(f)
  return run


# The suite's longest files (seconds of one worker on a 2-core machine, 2026-12-02), handed
# out first: `--dist loadfile` gives each worker one file at a time, so a long file started
# last leaves the other core idle at the end. pyproject turns off xdist's own reordering
# (by number of tests, which is not their length). Only a scheduling hint: a file missing
# here runs after these, in collection order.
LONGEST_FIRST = ("test_multihost.py", "test_checkpoint.py", "test_precision.py", "test_aot.py",
                 "test_tiers.py", "test_lora.py", "test_sequence_parallel.py", "test_run_guards.py",
                 "test_expert_parallel.py", "test_train_sharding.py", "test_window.py", "test_parity.py",
                 "test_eval_harness.py", "test_grpo_multihost.py", "test_docs.py", "test_mamba3.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
