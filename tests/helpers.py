"""What several test files share: the repository root, the fast-compile XLA flags, the
small model that end-to-end runs train, a train.py command line, and small checks.

Test files import these from here, never from one another (`import helpers`: pytest
puts tests/ on the path)."""

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from mamba_train import xla_flags

ROOT = Path(__file__).resolve().parents[1]

# XLA:CPU flags that compile the suite's tiny programs about 3x faster (less optimisation
# of the generated code); numerics stay within float32 rounding. Only those the installed
# XLA defines: XLA aborts on an unknown one, and jaxlib 0.12 dropped the fusion-emitter flag.
#
# XLA:CPU also ends a process (SIGABRT) when a collective's rendezvous has not completed in
# 40 s (its default terminate timeout), and the test's heartbeat timeouts are as short as
# a test can afford: on a loaded CI machine a process of a multi-process job can lag that
# long without being dead. One CI run lost a job to a SIGABRT inside an all-gather; the
# suite's subprocess runs therefore let a collective wait 15 minutes (a dead peer is still
# found at once, its sockets closing, or by train.py's heartbeat).
PATIENT_COLLECTIVES = xla_flags.only_known("--xla_cpu_collective_call_terminate_timeout_seconds=900 "
                                           "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")
#
# One codegen part a program (XLA:CPU splits each program's LLVM module into parts compiled on
# a thread pool): the suite's programs are small, so splitting, cloning and the threads' hand-offs
# cost more CPU than the parallel compile saves, and the suite's two workers keep both cores
# busy anyway. The same machine code; docs/bench/suite.md has the figures.
FAST_XLA = xla_flags.only_known("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1") \
    + " " + PATIENT_COLLECTIVES


def rel(a, b) -> float:
  """max |a - b| / max |b|, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def require_libtpu() -> None:
  """Fail (not skip) without libtpu: the TPU compiler is part of the test extra, so its
  absence is a broken install. No TPU is needed to compile for one."""
  import pytest
  if importlib.util.find_spec("libtpu") is None:
    pytest.fail("libtpu is not installed: pip install -e '.[test]' (it brings libtpu from PyPI, "
                "the TPU compiler these tests compile with; no TPU is needed)")


def libtpu_compiles(script: str, topologies=("v6e:1x1", "v5p:2x2x1")) -> None:
  """Run `script` (Python source that compiles Pallas TPU kernels for each topology
  in sys.argv[1:] and prints "compiled TOPO" for each) in a subprocess through
  libtpu, and assert every topology compiled. A subprocess: libtpu parses XLA_FLAGS
  too and aborts on conftest's CPU-only fast-compile flags."""
  require_libtpu()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT)
  r = subprocess.run([sys.executable, "-c", script, *topologies], capture_output=True, text=True, env=env,
                     timeout=600)
  assert r.returncode == 0 and r.stdout.count("compiled") == len(topologies), r.stderr[-3000:]


def missing_gpu_wheels() -> list[str]:
  """The GPU compile wheels (the `gpu` extra) that are not installed. find_spec of a
  submodule raises when its parent package is absent too (no jax_plugins at all)."""
  def absent(name):
    try:
      return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:
      return True
  return [m for m in ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc") if absent(m)]


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


def log_tail(text: str, chars: int = 3000) -> str:
  """The end of a subprocess's log for an assertion message, without the stack dumps that
  faulthandler prints for every thread of an aborted process: what the process said
  before it died stays in view."""
  dump = ('File "', "Thread 0x", "Current thread 0x", "Extension modules:")
  kept = [line for line in text.splitlines() if not line.lstrip().startswith(dump)]
  return "\n".join(kept)[-chars:]


def patched(cmd: list[str], patch: str) -> list[str]:
  """`cmd` (a python script's argv) run after `patch`, Python source executed first in the
  same process: how a test injects a fault into train.py."""
  return [sys.executable, "-c", patch + "\nimport runpy, sys; sys.argv = sys.argv[1:]; "
          "runpy.run_path(sys.argv[0], run_name='__main__')", *cmd[1:]]


def complete_steps(workdir) -> list[int]:
  """The finished checkpoint steps of a workdir."""
  d = Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} as TensorBoard itself reads the event files of `logdir`
  (its EventAccumulator), every event kept, in the order written: its purge of the steps
  a restarted writer repeats is off, so a step written twice shows twice."""
  from tensorboard.backend.event_processing import event_accumulator
  acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0},
                                           purge_orphaned_data=False)
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def record_scalars(rows) -> dict[str, list[tuple[int, float]]]:
  """What TensorBoard should hold of a run record's rows: every finite number of each
  measurement row (not the marker rows, which carry "event"; not the goodput's run id),
  at the row's step, as float32, its name as a TensorBoard tag may spell it (letters,
  digits and -_/. kept, any other character an underscore)."""
  out = {}
  for r in rows:
    if "event" in r:
      continue
    for k, v in r.items():
      if k not in ("step", "goodput/run") and type(v) in (int, float) and np.isfinite(v):
        out.setdefault(re.sub(r"[^-/\w.]", "_", k), []).append((r["step"], float(np.float32(v))))
  return out


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


# ---------------------------------------------------------------------------
# Inputs. JAX is imported inside the functions: conftest imports this module before it
# sets XLA_FLAGS.


def ssd_inputs(seed, b, l, h, p, g, n, dtype):
  """Random SSD inputs (x, dt, A, B, C, D, h0) of the given sizes: dt > 0 and A < 0 as the
  model makes them."""
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  x = jax.random.normal(ks[0], (b, l, h, p), dtype)
  dt = jax.nn.softplus(jax.random.normal(ks[1], (b, l, h), dtype) - 1.0)
  A = -jnp.exp(jax.random.uniform(ks[2], (h,), dtype, -1.0, 1.5))
  B = jax.random.normal(ks[3], (b, l, g, n), dtype)
  C = jax.random.normal(ks[4], (b, l, g, n), dtype)
  D = jax.random.normal(ks[5], (h,), dtype)
  h0 = jax.random.normal(ks[6], (b, h, p, n), dtype)
  return x, dt, A, B, C, D, h0


def ssd3_inputs(seed, rank, g, h, l, p, n, dtype, b=2):
  """Random Mamba-3 scan inputs as the layer makes them (dt > 0, A < 0 per token, lam in
  (0, 1)): x, dt, A, lam, B, C, D, x_proj and an incoming cache (state, last k, last x).
  rank None: SISO (no x_proj, B and C without a rank axis)."""
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.PRNGKey(seed), 11)
  bc = (b, l, g, n) if rank is None else (b, l, rank, g, n)
  x = jax.random.normal(ks[0], (b, l, h, p), dtype)
  dt = jax.nn.softplus(jax.random.normal(ks[1], (b, l, h), dtype) - 1.0)
  A = -jnp.exp(jax.random.uniform(ks[2], (b, l, h), dtype, -1.0, 1.5))
  lam = jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], (b, l, h), dtype))
  B, C = (jax.random.normal(k, bc, dtype) for k in ks[4:6])
  D = jax.random.normal(ks[6], (h,), dtype)
  xp = None if rank is None else jax.random.normal(ks[7], (h, rank, p), dtype)
  cache = (jax.random.normal(ks[8], (b, h, p, n), dtype),
           jax.random.normal(ks[9], (b,) + bc[2:], dtype), jax.random.normal(ks[10], (b, h, p), dtype))
  return x, dt, A, lam, B, C, D, xp, cache


def packed_ids(seed, b, l):
  """(b, l) document ids of rows that pack four documents each, cut at random positions."""
  import jax.numpy as jnp
  rng = np.random.RandomState(seed)
  ids = np.zeros((b, l), np.int32)
  for i in range(b):
    cuts = np.sort(rng.choice(np.arange(1, l), size=min(3, l - 1), replace=False))
    for c in cuts:
      ids[i, c:] += 1
  return jnp.asarray(ids)


def random_model(cfg, rng):
  """A Mamba2LM of `cfg` with random weights, skipping the model's init (about 40 small
  XLA compiles, 30 s on a CPU). A and dt are drawn as mamba_ssm draws them, so that state
  carries across chunks the way it does in a trained model."""
  import jax
  from flax import nnx

  from mamba_train import Mamba2LM
  abstract = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0))).params()

  def draw(path, a):
    name = jax.tree_util.keystr(path)
    if "A_log" in name:
      return np.log(rng.uniform(1, 16, a.shape)).astype(np.float32)
    if "dt_bias" in name:  # softplus(dt_bias) = dt, log-uniform in [1e-3, 1e-1]
      dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), a.shape))
      return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    return (0.1 * rng.standard_normal(a.shape)).astype(np.float32)
  return Mamba2LM.from_params(cfg, jax.tree_util.tree_map_with_path(draw, abstract))


def scaled_random_model(cfg, seed: int = 0):
  """A Mamba2LM of `cfg` (hybrids too) with random weights drawn with numpy (an initialiser
  run through XLA would cost more compile time than the tests that use it), scaled like a
  trained model's so that its next-token distributions are far from uniform: norms near 1,
  A and dt as mamba_ssm draws them, D near 1, biases 0, matrices by 1/sqrt(fan in)."""
  import jax
  from flax import nnx

  from mamba_train import Mamba2LM
  rng = np.random.default_rng(seed)

  def draw(path, s):
    name = path[-1].key
    if "norm" in name:
      return 1.0 + 0.1 * rng.standard_normal(s.shape)
    if name == "A_log":
      return np.log(rng.uniform(1.0, 16.0, s.shape))
    if name == "dt_bias":
      dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), s.shape))
      return dt + np.log(-np.expm1(-dt))
    if name == "D":
      return rng.uniform(0.5, 1.5, s.shape)
    if "bias" in name:
      return np.zeros(s.shape)
    fan_in = s.shape[1] if len(s.shape) > 2 else s.shape[-1]
    return rng.standard_normal(s.shape) / np.sqrt(fan_in)

  shapes = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0))).params()
  params = jax.tree_util.tree_map_with_path(draw, shapes)
  return Mamba2LM.from_params(cfg, jax.tree.map(lambda a: a.astype(np.float32), params))


def orbax_round_trip(it, fresh, directory):
  """Saves data iterator `it` as the checkpointer does (Grain's handler in an Orbax
  Composite) and restores it into `fresh`."""
  import grain
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(str(directory)) as mngr:
    mngr.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  with ocp.CheckpointManager(str(directory)) as mngr:
    mngr.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))


def skip_on_known_transformers_bug(ref_config) -> None:
  """Skip, naming the release and the failing call, where the installed transformers has
  a known bug that keeps its NemotronH model (built from `ref_config`) from running.

  Only the newest-releases leg of `.ci/run` can meet one: the first leg installs the
  reference libraries at the tested versions of `constraints.txt`, where these tests
  run in full. Probed, not keyed to a version, so the skip ends when upstream fixes it.
  - transformers 5.25.0: `NemotronHModel.forward` asks `DynamicCache(config).get_seq_length()`,
    which reads layer 0's cache; when layer 0 is an MLP or MoE layer that is a `DummyLayer`,
    which has no `get_seq_length` (modeling_nemotron_h.py:1212)."""
  import pytest
  import transformers
  from transformers import DynamicCache
  try:
    DynamicCache(config=ref_config).get_seq_length()
  except AttributeError as err:
    pytest.skip(f"known upstream bug in transformers {transformers.__version__}: NemotronHModel.forward calls "
                f"DynamicCache(config).get_seq_length(), which fails when layer 0 is "
                f"{ref_config.layers_block_type[0]!r} ({err})")


def step_through(graphdef, params, cache, ids, start: int, stop: int):
  """Decode ids[:, start:stop] one token at a time from `cache` (one jitted step, the
  model split as `nnx.split` gives it); the logits of each position, stacked (b, n, vocab)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from mamba_train.generation import step
  one = jax.jit(lambda p, t, c: step(nnx.merge(graphdef, p), t, c))
  got = []
  for t in range(start, stop):
    logits, cache = one(params, ids[:, t], cache)
    got.append(logits)
  return jnp.stack(got, 1)
