"""The XLA:CPU default that mamba_train's entry points apply (mamba_train.xla_flags),
that importing the library applies nothing, and that a flag the installed XLA does not
define is found without starting XLA (which would abort)."""

import os
import subprocess
import sys

from mamba_train import xla_flags


def test_flag_is_added_once_and_respects_the_user():
  env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
  assert xla_flags.apply_cpu_defaults(env)
  assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false " + xla_flags.YNN_FLAG
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


BOGUS = "--xla_mamba_train_no_such_flag=1"
KNOWN = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2"


def test_unknown_flags_agree_with_what_xla_itself_rejects():
  # The check reads jaxlib's library; the reference is XLA starting in a child process
  # with the same flags (it aborts on an unknown one and names it).
  flags = f"{KNOWN} {BOGUS} {xla_flags.YNN_FLAG}"
  assert xla_flags.unknown(flags) == ["xla_mamba_train_no_such_flag"]
  assert xla_flags.probe_unknown(flags) == ["xla_mamba_train_no_such_flag"]
  assert xla_flags.probe_unknown(KNOWN) == [] and xla_flags.unknown(KNOWN) == []
  assert xla_flags.only_known(f"{KNOWN} {BOGUS}") == KNOWN


def test_an_unknown_flag_of_the_user_is_one_line_before_xla_starts(capsys):
  import pytest
  env = {"XLA_FLAGS": f"{KNOWN} {BOGUS}"}
  with pytest.raises(SystemExit) as e:
    xla_flags.apply_cpu_defaults(env)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--xla_mamba_train_no_such_flag" in err and "remove it" in err
  assert env["XLA_FLAGS"] == f"{KNOWN} {BOGUS}"  # nothing added


def test_train_py_names_an_unknown_flag_in_one_line():
  env = dict(os.environ, XLA_FLAGS=BOGUS, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, os.path.join(root, "train.py"), "--config.steps=1"], env=env,
                     capture_output=True, text=True, cwd=root)
  assert r.returncode == 2
  assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "xla_mamba_train_no_such_flag" in r.stderr
