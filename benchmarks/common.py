"""What every benchmark shares, so that each figure is taken the same way.

Timing is `mamba_train.metrics.Timer` around one call, blocked on its result:
a warm-up call first (compilation and first-touch page faults are not speed),
then the median of the repeats (the minimum where a benchmark says so: decode
loops on a shared machine). Compiling is timed apart, in wall and process-CPU
seconds, with XLA's memory analysis of the program. The flags turn into the
model's architecture (`Mamba2Config`) and how it runs (`Runtime`) here, once,
and into the run config the train step is built from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from mamba_train import metrics
from mamba_train.model.config import Mamba2Config, config_for
from mamba_train.model.runtime import Runtime
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train.run_config import validate

F32 = jnp.float32
CORES = os.cpu_count() or 1
# The repository root: the default corpus is built under its data/.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*a):
  print(*a, flush=True)


def add_rows(results: dict, rows: list[dict]) -> list[dict]:
  results.setdefault("rows", []).extend(rows)
  return rows


# ----------------------------------------------------------------------------
# Timing and compiling.


def median_time(fn: Callable[[], Any], repeats: int, *, warmup: int = 1, best: bool = False,
                block: Callable[[Any], Any] | None = jax.block_until_ready) -> float:
  """Median (or with best=True the minimum) wall seconds of `fn()` over `repeats`
  calls after `warmup` calls. `block` waits for the result (JAX dispatches
  asynchronously); None for callables that return when done (torch on CPU)."""
  block = block or (lambda x: x)
  for _ in range(warmup):
    block(fn())
  times = []
  for _ in range(repeats):
    with metrics.Timer() as t:
      block(fn())
    times.append(t.seconds)
  return min(times) if best else statistics.median(times)


def compile_fn(jitted, *args, **kwargs):
  """(compiled, {'compile_s', 'compile_cpu_s'[, 'peak_bytes', 'temp_bytes']}):
  `jitted.lower(*args, **kwargs).compile()` timed, and XLA's memory analysis of it."""
  with metrics.Timer() as t:
    compiled = jitted.lower(*args, **kwargs).compile()
  info = {"compile_s": t.seconds, "compile_cpu_s": t.cpu_seconds}
  mem = metrics.compiled_memory(compiled)
  if mem:
    info["peak_bytes"] = mem["peak_bytes"]
    info["temp_bytes"] = mem["temp_bytes"]
  return compiled, info


# ----------------------------------------------------------------------------
# Model, runtime and run config from the flags.


def model_cfg(args, size: str, **overrides) -> Mamba2Config:
  """The architecture of `size`, with --chunk_size."""
  if args.chunk_size:
    overrides.setdefault("chunk_size", args.chunk_size)
  return config_for(size, **overrides)


def unresolved_runtime(args) -> Runtime:
  """How the model runs, from --dtype, --remat and --ssd_form (scan or parallel:
  the XLA SSD in that form; auto: the backend's default, Pallas kernels on TPU) (the runtime's
  defaults where a flag is unset); 'auto' left for the caller to resolve."""
  kw = {"compute_dtype": args.dtype}
  if args.remat:
    kw["remat"] = args.remat
  if getattr(args, "decode_layers", "auto") != "auto":
    kw["decode_layers"] = args.decode_layers
  if args.ssd_form in ("scan", "parallel"):
    kw["ssd_form"] = args.ssd_form
    kw["ssd_impl"] = "xla"  # a form names the XLA SSD's way of combining chunks
  return Runtime(**kw)


def runtime(args, backend: str | None = None) -> Runtime:
  """`unresolved_runtime` resolved for `backend` (default: this process's)."""
  return unresolved_runtime(args).resolve(backend)


def run_plan(args, size: str, batch: int, seq_len: int, **model_overrides):
  """The plan (`run_config.validate`) of configs/base.py with the bench's model,
  runtime and shapes, on one device of this process's platform, as
  `train.step.build` takes it."""
  from configs import base  # the repository's run configs (python -m benchmarks runs from its root)
  c = base.get_config()
  c.model.update(model_cfg(args, size, **model_overrides).to_dict())
  c.runtime.update(unresolved_runtime(args).to_dict())
  c.batch_size, c.seq_len = batch, seq_len
  c.mesh.update(data=1, fsdp=1, tensor=1)
  return validate(c, num_devices=1, platform=jax.devices()[0].platform, device_kind=jax.devices()[0].device_kind)


def one_device_mesh():
  return make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def random_batch(cfg: Mamba2Config, batch: int, seq_len: int, seed: int = 0) -> dict[str, jax.Array]:
  """A train batch of random tokens: one document per row, every position counted."""
  ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
  out = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "seq_idx": np.zeros((batch, seq_len), np.int32),
         "loss_mask": np.ones((batch, seq_len), np.float32)}
  return {k: jnp.asarray(v) for k, v in out.items()}


# ----------------------------------------------------------------------------
# Pallas GPU kernels against the plain forms they replace (gpu_ssd, gpu_layer, gpu_fused).


def rel_error(a, b) -> float:
  """The largest difference of a from b, relative to b's largest entry (float64)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def time_forms(fns: Callable, inputs, repeats: int):
  """(impl, mode, seconds, compile info) of the plain form ('xla') then the kernels,
  each forward ('fwd') and forward+backward ('fwd+bwd'); `fns(impl)` -> the two
  jitted functions of `inputs`. Each compiled, then timed (`median_time`)."""
  for impl in ("xla", "kernels"):
    fwd, bwd = fns(impl)
    for mode, fn in (("fwd", fwd), ("fwd+bwd", bwd)):
      compiled, info = compile_fn(fn, *inputs)
      yield impl, mode, median_time(lambda compiled=compiled: compiled(*inputs), repeats), info


def byte_rows(bench: str, shape: str, fns: Callable, inputs, tokens: int, repeats: int, copy_bytes_per_s: float,
              **fields) -> list[dict]:
  """`time_forms`' rows of one shape, each with the bytes the kernels' own cost estimates
  say they move (the same work for both forms: what a fused chain has to move at least)
  over its time, against the run's copy bandwidth; with the kernels' speedup."""
  from mamba_train.tools import hlo  # the kernels' estimates from a traced program
  rows = []
  for impl, mode, sec, info in time_forms(fns, inputs, repeats):
    est = hlo.kernel_estimates(fns("kernels")[0 if mode == "fwd" else 1].trace(*inputs).jaxpr)
    moved = sum(e.bytes_accessed for calls in est.values() for _, e in calls)
    rows.append({"bench": bench, "shape": shape, "impl": impl, "mode": mode, **fields, "seconds": sec,
                 "tokens_per_s": tokens / sec, "kernel_bytes": moved,
                 "frac_copy_bandwidth": moved / sec / copy_bytes_per_s, **info})
    log(f"  {shape} {impl:8s} {mode:8s}: {tokens / sec:12.0f} tok/s, {moved / sec / 1e9:8.1f} GB/s of "
        f"the kernels' bytes ({100 * moved / sec / copy_bytes_per_s:.0f}% of copy), compile {info['compile_s']:.1f} s")
  add_speedups(rows, shape)
  return rows


def byte_table(rows: list[dict], names: dict[str, str], speedup: str) -> list[str]:
  """`byte_rows`' markdown table; names: each impl's label; speedup: the last column's header."""
  lines = [f"| shape | impl | mode | tokens/s | kernels' bytes / s | of copy bandwidth | compile s | {speedup} |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['shape']} | {names[r['impl']]} | {r['mode']} | {r['tokens_per_s']:,.0f} | "
                 f"{r['kernel_bytes'] / r['seconds'] / 1e9:,.0f} GB/s | {100 * r['frac_copy_bandwidth']:.0f}% | "
                 f"{r['compile_s']:.2g} | " + (f"{r['kernels_speedup']:.2f}x |" if r["impl"] == "kernels" else " |"))
  return lines


def add_speedups(rows: list[dict], shape: str) -> None:
  """Each row of `shape` gets the kernels' speed over the plain form's in its mode."""
  timed = {(r["impl"], r["mode"]): r["seconds"] for r in rows if r["shape"] == shape}
  for r in rows:
    if r["shape"] == shape:
      r["kernels_speedup"] = timed[("xla", r["mode"])] / timed[("kernels", r["mode"])]


def kernels_main(argv, *, prog: str, description: str, shapes, dry_shapes, check: Callable,
                 checked: str, bench: Callable, table: Callable, trace: Callable | None = None):
  """A GPU kernels benchmark's command line: on the device, `check(shape, dtype)`'s
  errors of the kernels against the plain forms (the first shape, float32 and
  --dtype) logged as `checked` on <device>; then `bench(args)`'s rows, timed, with
  `trace(args, dir)` after them where the benchmark takes --trace; `table(rows)`'s
  markdown lines printed, and with --out written with the rows and errors as
  results.json. --dry_run: `dry_shapes`, the kernels in Pallas' interpreter on a CPU."""
  ap = argparse.ArgumentParser(prog=prog, description=description)
  ap.add_argument("--out", default=None, help="write results.json and results.md here")
  if trace is not None:
    ap.add_argument("--trace", default=None, help="write a jax.profiler trace here")
  ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--dry_run", action="store_true", help="small shapes; on CPU the kernels run interpreted")
  args = ap.parse_args(argv)
  accel = jax.default_backend() != "cpu"
  args.roofline_n, args.roofline_mib = (8192, 2048) if accel else (512, 16)
  if not accel and not args.dry_run:
    ap.error("no GPU here: use --dry_run (small shapes, the kernels in Pallas' interpreter)")
  shape = (dry_shapes if args.dry_run else shapes)[0]
  errors = {dt: check(shape, jnp.dtype(dt)) for dt in ("float32", args.dtype)}
  for dt, e in errors.items():
    log(f"  {checked} on {jax.devices()[0].device_kind}, {shape[0]} shape, {dt}: "
        + ", ".join(f"{k} {v:.1e}" for k, v in e.items()))
  rows = bench(args)
  if trace is not None and args.trace:
    trace(args, args.trace)
  lines = table(rows)
  print("\n".join(lines))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "errors": errors,
                 "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
      f.write("\n".join(lines) + "\n")
  return rows, errors
