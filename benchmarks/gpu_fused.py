"""The Mamba-2 layer between in_proj and out_proj on an NVIDIA GPU: the fused Triton
kernels (`layer_fused_gpu.mixer_core_gpu`, what `layer_impl=auto` runs on a GPU)
against the plain layer over the SSD kernel (`layer_math.mixer_core` with
`ssd_gpu`: XLA's conv, dt and gate around the Triton SSD), forward and
forward+backward, at the 130m and 1.3b layers' shapes (4 x 2048 a GPU, packed
documents), after checking on the device that the two agree (the fused kernels were
written and tested on CPU in Pallas' interpreter; the GPU is where their Triton code
first runs).

  python -m benchmarks.gpu_fused --out DIR     # on a GPU
  python -m benchmarks.gpu_fused --dry_run     # any host: small shapes, interpreter

Each row: median of --repeats after a warm-up, compile timed apart; tokens/s, the
bytes the fused kernels' cost estimates say they move over the time (GB/s) against
this run's copy bandwidth, and the fused layer's speed over the plain one's
(`common.byte_rows`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import roofline
from benchmarks.common import F32, byte_rows, byte_table, kernels_main, rel_error
from mamba_train.ops import layer_fused_gpu, layer_math, ssd_gpu

# (name, b, l, heads, head size, groups, state, chunk): a layer of each model at 4 x 2048 a GPU.
SHAPES = [("130m", 4, 2048, 24, 64, 1, 128, 64), ("1.3b", 4, 2048, 64, 64, 1, 128, 64)]
DRY_SHAPES = [("dry", 1, 48, 4, 16, 2, 16, 16)]


def _inputs(b, l, h, p, g, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  r = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
  i, k = h * p, 4
  zx, bc = r(b, l, 2 * i).astype(dtype), r(b, l, 2, g * n).astype(dtype)
  dt_raw = r(b, l, h) - 2.0
  w = dict(conv_x=0.5 * r(k, i), conv_x_bias=0.1 * r(i), conv_bc=0.5 * r(k, 2, g * n), conv_bc_bias=0.1 * r(2, g * n),
           dt_bias=0.1 * r(h), A_log=jnp.log(jnp.linspace(1.0, 8.0, h)), D=r(h))
  seq = jnp.asarray(np.sort(rng.integers(0, 4, (b, l)), axis=1), jnp.int32)  # packed documents
  return (zx, bc, dt_raw, w, seq), (r(b, l, i), r(b, l, g))


def _fns(impl, cot, chunk, g):
  """The layer between the matmuls, forward and the gradient of a weighted sum of its
  outputs (the gated y and the squares) with respect to every input."""
  interp = jax.default_backend() == "cpu"
  fn = {"kernels": functools.partial(layer_fused_gpu.mixer_core_gpu, interpret=interp),
        "xla": functools.partial(layer_math.mixer_core, ssd=functools.partial(ssd_gpu.ssd_gpu, interpret=interp))}[impl]

  def fwd(zx, bc, dt_raw, w, seq):
    gated, ssq, _ = fn(zx, bc, dt_raw, w, chunk, ngroups=g, seq_idx=seq)
    return gated, ssq

  def loss(*a):
    gated, ssq = fwd(*a)
    return jnp.sum(gated.astype(F32) * cot[0]) + jnp.sum(ssq * cot[1])
  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def check(shape, dtype) -> dict:
  """The fused kernels against the plain layer on this device: outputs and every
  gradient, relative to the largest entry."""
  _, b, l, h, p, g, n, q = shape
  args, cot = _inputs(b, l, h, p, g, n, dtype, seed=1)
  (kf, kb), (xf, xb) = _fns("kernels", cot, q, g), _fns("xla", cot, q, g)
  out = {f"out{j}": rel_error(a, r) for j, (a, r) in enumerate(zip(kf(*args), xf(*args)))}
  grads = zip(jax.tree_util.tree_flatten_with_path(kb(*args))[0], jax.tree.leaves(xb(*args)))
  out.update({"d" + jax.tree_util.keystr(path): rel_error(a, r) for (path, a), r in grads})
  return out


def bench(args) -> list[dict]:
  rf = roofline.measure(args, {})
  dtype = jnp.dtype(args.dtype)
  rows = []
  for shape in (DRY_SHAPES if args.dry_run else SHAPES):
    name, b, l, h, p, g, n, q = shape
    inputs, cot = _inputs(b, l, h, p, g, n, dtype)
    rows += byte_rows("gpu_fused", name, lambda impl: _fns(impl, cot, q, g), inputs, b * l, args.repeats,
                      rf["copy_bytes_per_s"], batch=b, seq_len=l, d_inner=h * p, dtype=args.dtype)
  return rows


def table(rows: list[dict]) -> list[str]:
  return byte_table(rows, {"kernels": "fused", "xla": "plain + SSD kernel"}, "fused / plain")


def main(argv=None):
  return kernels_main(argv, prog="python -m benchmarks.gpu_fused", description=__doc__.split("\n")[0],
                      shapes=SHAPES, dry_shapes=DRY_SHAPES, check=check,
                      checked="fused layer vs plain layer", bench=bench, table=table)


if __name__ == "__main__":
  main()
