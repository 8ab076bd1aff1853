"""The SSD alone on an NVIDIA GPU: the Pallas Triton kernels (`ssd_gpu`) against the
XLA form (`ssd_chunked`, parallel, at the runtime's GPU chunk), forward and
forward+backward, at the 130m and 1.3b layers' shapes, after checking on the device
that the kernels agree with the XLA form (they were written and tested on CPU in
Pallas' interpreter; the GPU is where their Triton code first runs).

  python -m benchmarks.gpu_ssd --out DIR [--trace DIR]   # on a GPU
  python -m benchmarks.gpu_ssd --dry_run                   # any host: small shapes, interpreter

Each row: median of --repeats after a warm-up, compile timed apart; tokens/s,
GFLOP/s (`metrics.ssd_flops_per_token`, the parallel form's count for both, so
the rates compare the same work), the fraction of this run's bf16 matmul rate,
and the kernels' speed over XLA's. --trace writes a `jax.profiler` trace of one
kernel and one XLA forward+backward at the 1.3b shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import roofline
from benchmarks.common import F32, add_speedups, kernels_main, log, rel_error, time_forms
from mamba_train.metrics import ssd_flops_per_token
from mamba_train.ops import ssd, ssd_gpu

# (name, b, l, h, p, g, n): a layer of each model at 4 x 2048 per GPU.
SHAPES = [("130m", 4, 2048, 24, 64, 1, 128), ("1.3b", 4, 2048, 64, 64, 1, 128)]
DRY_SHAPES = [("dry", 1, 96, 4, 16, 1, 16)]
XLA_CHUNK = 128  # Runtime.parallel_chunk_size: what the XLA form runs at on a GPU


def _inputs(b, l, h, p, g, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, l, h, p)), F32).astype(dtype)
  dt = jnp.asarray(rng.uniform(0.001, 0.1, (b, l, h)), F32)
  A = -jnp.asarray(rng.uniform(1, 16, (h,)), F32)
  B = jnp.asarray(rng.standard_normal((b, l, g, n)), F32).astype(dtype)
  C = jnp.asarray(rng.standard_normal((b, l, g, n)), F32).astype(dtype)
  D = jnp.ones((h,), F32)
  seq = jnp.asarray(np.sort(rng.integers(0, 4, (b, l)), axis=1), jnp.int32)  # packed documents
  cot = jnp.asarray(rng.standard_normal((b, l, h, p)), F32)
  return (x, dt, A, B, C, D, seq), cot


def _fns(impl, chunk, cot):
  fn = {"kernels": functools.partial(ssd_gpu.ssd_gpu, interpret=jax.default_backend() == "cpu"),
        "xla": functools.partial(ssd.ssd_chunked, form="parallel")}[impl]

  def fwd(x, dt, A, B, C, D, seq):
    return fn(x, dt, A, B, C, chunk, D=D, seq_idx=seq)[0]

  def loss(x, dt, A, B, C, D, seq):
    return jnp.sum(fwd(x, dt, A, B, C, D, seq).astype(F32) * cot)
  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=tuple(range(6))))


def check(shape, dtype) -> dict:
  """The kernels against the XLA form on this device: forward and every gradient,
  relative to the largest entry. bfloat16 inputs: both forms round; the float32
  figures are the ones that say the kernels are right."""
  _, b, l, h, p, g, n = shape
  args, cot = _inputs(b, l, h, p, g, n, dtype, seed=1)
  out = {}
  kf, kb = _fns("kernels", XLA_CHUNK, cot)
  xf, xb = _fns("xla", XLA_CHUNK, cot)
  out["y"] = rel_error(kf(*args), xf(*args))
  for name, a, r in zip("x dt A B C D".split(), kb(*args), xb(*args)):
    out["d" + name] = rel_error(a, r)
  return out


def bench(args) -> list[dict]:
  rf = roofline.measure(args, {})
  dtype = jnp.dtype(args.dtype)
  rows = []
  for shape in (DRY_SHAPES if args.dry_run else SHAPES):
    name, b, l, h, p, g, n = shape
    inputs, cot = _inputs(b, l, h, p, g, n, dtype)
    tokens = b * l
    for impl, mode, sec, info in time_forms(lambda impl: _fns(impl, XLA_CHUNK, cot), inputs, args.repeats):
      q = ssd_gpu.kernel_chunk(XLA_CHUNK) if impl == "kernels" else XLA_CHUNK
      fl = ssd_flops_per_token(h, p, n, g, q, l, "parallel") * (3 if mode == "fwd+bwd" else 1) * tokens
      rows.append({"bench": "gpu_ssd", "shape": name, "impl": impl, "mode": mode, "chunk": q,
                   "batch": b, "seq_len": l, "heads": h, "dtype": args.dtype, "seconds": sec,
                   "tokens_per_s": tokens / sec, "gflops": fl / sec / 1e9,
                   "frac_matmul_peak": fl / sec / rf["matmul_flops"], **info})
      log(f"  {name} {impl:8s} {mode:8s} chunk {q}: {tokens / sec:12.0f} tok/s, "
          f"{fl / sec / 1e9:8.1f} GFLOP/s, {100 * fl / sec / rf['matmul_flops']:.1f}% of matmul, "
          f"compile {info['compile_s']:.1f} s")
    add_speedups(rows, name)
  return rows


def trace(args, out_dir: str) -> None:
  name, b, l, h, p, g, n = (DRY_SHAPES if args.dry_run else SHAPES)[-1]
  inputs, cot = _inputs(b, l, h, p, g, n, jnp.dtype(args.dtype))
  fns = [_fns(impl, XLA_CHUNK, cot)[1] for impl in ("kernels", "xla")]
  for fn in fns:
    jax.block_until_ready(fn(*inputs))  # compiled outside the trace
  with jax.profiler.trace(out_dir):
    for fn in fns:
      jax.block_until_ready(fn(*inputs))
  log(f"  jax.profiler trace of the {name} SSD forward+backward (kernels, then XLA): {out_dir}")


def table(rows: list[dict]) -> list[str]:
  lines = ["| shape | impl | mode | chunk | tokens/s | GFLOP/s | of matmul peak | compile s | kernels / xla |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['shape']} | {r['impl']} | {r['mode']} | {r['chunk']} | {r['tokens_per_s']:,.0f} | "
                 f"{r['gflops']:,.0f} | {100 * r['frac_matmul_peak']:.1f}% | {r['compile_s']:.2g} | "
                 + (f"{r['kernels_speedup']:.2f}x |" if r["impl"] == "kernels" else " |"))
  return lines


def main(argv=None):
  return kernels_main(argv, prog="python -m benchmarks.gpu_ssd", description=__doc__.split("\n")[0],
                      shapes=SHAPES, dry_shapes=DRY_SHAPES, check=check, checked="kernels vs XLA",
                      bench=bench, table=table, trace=trace)


if __name__ == "__main__":
  main()
