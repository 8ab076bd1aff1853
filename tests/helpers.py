"""What several test files share: the repository root, the fast-compile XLA flags, the
small model that end-to-end runs train, a train.py command line, and small checks.

Test files import these from here, never from one another (`import helpers`: pytest
puts tests/ on the path)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# XLA:CPU flags that compile the suite's tiny programs about 3x faster (less optimisation
# of the generated code); numerics stay within float32 rounding.
FAST_XLA = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
            "--xla_cpu_use_fusion_emitters=false")


def rel(a, b) -> float:
  """max |a - b| / max |b|, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def free_port() -> int:
  """A TCP port on 127.0.0.1 free now (for a coordinator or gloo)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# The small Mamba-2 the end-to-end runs train: a few seconds a compile on a CPU core.
SMALL_MODEL = dict(d_model=64, n_layer=2, d_state=16, headdim=16, chunk_size=16)


def model_flags(**overrides) -> list[str]:
  """SMALL_MODEL (with `overrides`) as train.py's --config.model.* flags."""
  return [f"--config.model.{k}={v}" for k, v in {**SMALL_MODEL, **overrides}.items()]


# train.py on the small model and synthetic data: 6 steps, a checkpoint every 2, 3 kept.
TRAIN_BASE = ["--config", str(ROOT / "configs" / "tiny.py"), "--config.data.source=synthetic",
              "--config.seq_len=32", "--config.batch_size=8", "--config.log_every=1",
              "--config.eval_every=0", "--config.checkpoint_every=2", "--config.checkpoint_keep=3",
              "--config.wandb.mode=disabled", "--config.steps=6", *model_flags(),
              # A constant learning rate after one warmup step, whatever the run's length: the
              # first n losses of every run are then the same, so a run that is stopped by a
              # signal can be as long as it likes and still be compared with a short one.
              "--config.optim.schedule=constant", "--config.optim.warmup_frac=0.0"]


def train_command(workdir, extra=(), devices: int = 1) -> tuple[list[str], dict]:
  """(argv, env) of train.py on TRAIN_BASE + `extra` in `workdir`, on `devices` CPU devices
  with the fast-compile flags (the same numerics within a test: every run uses them)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_XLA}")
  cmd = [sys.executable, str(ROOT / "train.py"), "--workdir", str(workdir), *TRAIN_BASE, *extra]
  return cmd, env


def run_train(workdir, *extra, timeout=300) -> subprocess.CompletedProcess:
  """train.py (`train_command`) to its end, output captured; the caller checks the exit code."""
  cmd, env = train_command(workdir, extra)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def patched(cmd: list[str], patch: str) -> list[str]:
  """`cmd` (a python script's argv) run after `patch`, Python source executed first in the
  same process: how a test injects a fault into train.py."""
  return [sys.executable, "-c", patch + "\nimport runpy, sys; sys.argv = sys.argv[1:]; "
          "runpy.run_path(sys.argv[0], run_name='__main__')", *cmd[1:]]


def complete_steps(workdir) -> list[int]:
  """The finished checkpoint steps of a workdir."""
  d = Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def script_env(**extra) -> dict:
  """The environment of a scripts/*.py subprocess: CPU, this checkout's library first."""
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)


def export_cli(ckpt, out, *extra, env=None) -> subprocess.CompletedProcess:
  """scripts/export.py --checkpoint ckpt --out out, output captured."""
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), "--checkpoint", str(ckpt),
                         "--out", str(out), *extra], cwd=ROOT, env=script_env(**(env or {})),
                        capture_output=True, text=True, timeout=300)


def tree_sizes(path: Path) -> dict:
  """{relative path: size} of everything under `path`: what a test compares to see nothing touched."""
  return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*")}
