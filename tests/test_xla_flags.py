"""The XLA:CPU default that mamba_train's entry points apply (mamba_train.xla_flags),
and that importing the library applies nothing."""

import os
import subprocess
import sys

from mamba_train import xla_flags


def test_flag_is_added_once_and_respects_the_user():
  env = {"XLA_FLAGS": "--xla_foo=1"}
  assert xla_flags.apply_cpu_defaults(env)
  assert env["XLA_FLAGS"] == "--xla_foo=1 " + xla_flags.YNN_FLAG
  assert not xla_flags.apply_cpu_defaults(env)  # already there: unchanged
  assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1
  mine = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"}
  assert not xla_flags.apply_cpu_defaults(mine)
  assert mine["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"
  keep = {"MAMBA_TRAIN_KEEP_XLA_FLAGS": "1"}
  assert not xla_flags.apply_cpu_defaults(keep) and "XLA_FLAGS" not in keep


_PROBE = """
import os, sys
before = os.environ.get("XLA_FLAGS")
import mamba_train  # noqa: F401
assert os.environ.get("XLA_FLAGS") == before, "importing the library changed XLA_FLAGS"
if sys.argv[1] == "apply":
  from mamba_train.xla_flags import apply_cpu_defaults
  apply_cpu_defaults()
import jax, jax.numpy as jnp
hlo = jax.jit(lambda a: a @ a).lower(jnp.ones((64, 64))).compile().as_text()
print("YNN" if "__ynn_fusion" in hlo else "NOYNN")
"""


def test_entry_points_turn_off_ynn_fusions_and_importing_changes_nothing():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MAMBA_TRAIN_KEEP_XLA_FLAGS")}
  env["JAX_PLATFORMS"] = "cpu"
  run = lambda mode: subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True,
                                    text=True, check=True).stdout.split()[-1]
  assert run("apply") == "NOYNN"  # what train.py, scripts/ and benchmarks/ do first
  assert run("import") == "YNN"  # the probe can tell: importing the package leaves XLA's default


def test_train_py_applies_the_flag_first():
  # The flag must be set before JAX starts a backend: train.py applies it before importing jax.
  src = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")).read()
  assert src.index("apply_cpu_defaults()") < src.index("import jax")
