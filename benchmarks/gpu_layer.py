"""A Mamba-2 layer's elementwise chain on an NVIDIA GPU: the layer kernels
(`layer_gpu`: conv + SiLU on x and B|C, the gated RMSNorm) against the plain forms
XLA fuses (`layer_math`), forward and forward+backward, at the 130m and 1.3b layers'
shapes (4 x 2048 a GPU, packed documents), after checking on the device that the
kernels agree with the plain forms (they were written and tested on CPU in Pallas'
interpreter; the GPU is where their Triton code first runs).

  python -m benchmarks.gpu_layer --out DIR     # on a GPU
  python -m benchmarks.gpu_layer --dry_run     # any host: small shapes, interpreter

Each row: median of --repeats after a warm-up, compile timed apart; tokens/s, the
bytes the kernels' cost estimates say they move over the time (GB/s) against this
run's copy bandwidth, and the kernels' speed over XLA's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import roofline
from benchmarks.common import F32, byte_rows, byte_table, kernels_main, rel_error
from mamba_train.ops import layer_gpu, layer_math

# (name, b, l, d_inner, ngroups * d_state): a layer of each model at 4 x 2048 a GPU.
SHAPES = [("130m", 4, 2048, 1536, 128), ("1.3b", 4, 2048, 4096, 128)]
DRY_SHAPES = [("dry", 1, 96, 64, 16)]


def _inputs(b, l, i, gn, dtype, seed=0):
  rng = np.random.default_rng(seed)
  r = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
  x, bc, z = r(b, l, i).astype(dtype), r(b, l, 2, gn).astype(dtype), r(b, l, i).astype(dtype)
  seq = jnp.asarray(np.sort(rng.integers(0, 4, (b, l)), axis=1), jnp.int32)  # packed documents
  weights = (0.5 * r(4, i), r(i), 0.5 * r(4, 2, gn), r(2, gn), 1.0 + 0.1 * r(i))
  fronts = (jnp.zeros((b, 3, i), F32), jnp.zeros((b, 3, 2, gn), F32))
  return (x, bc, z, seq) + weights + fronts, r(b, l, i)


def _fns(impl, cot):
  """The chain between in_proj and out_proj less the SSD: conv + SiLU of x and B|C,
  the gated RMSNorm of silu(conv(x)) with z (the SSD's place taken by its input)."""
  interp = jax.default_backend() == "cpu"
  conv, norm = {"kernels": (functools.partial(layer_gpu.causal_conv_silu_gpu, interpret=interp),
                            functools.partial(layer_gpu.gated_rms_norm_gpu, interpret=interp)),
                "xla": (layer_math.causal_conv_silu, layer_math.gated_rms_norm)}[impl]

  def fwd(x, bc, z, seq, wx, bx, wbc, bbc, gw, fx, fbc):
    xs, _ = conv(x, wx, bx, fx, seq)
    bcs, _ = conv(bc, wbc, bbc, fbc, seq)
    return norm(xs.astype(x.dtype), z, gw, 1, 1e-5).astype(x.dtype), bcs.astype(x.dtype)

  def loss(*a):
    out, bcs = fwd(*a)
    return jnp.sum(out.astype(F32) * cot) + jnp.sum(bcs.astype(F32))
  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4, 5, 6, 7, 8)))


def check(shape, dtype) -> dict:
  """The kernels against the plain forms on this device: outputs and every gradient,
  relative to the largest entry."""
  _, b, l, i, gn = shape
  args, cot = _inputs(b, l, i, gn, dtype, seed=1)
  (kf, kb), (xf, xb) = _fns("kernels", cot), _fns("xla", cot)
  out = {f"out{j}": rel_error(a, r) for j, (a, r) in enumerate(zip(kf(*args), xf(*args)))}
  names = "x bc z w_x b_x w_bc b_bc norm_w".split()
  out.update({"d" + n: rel_error(a, r) for n, a, r in zip(names, kb(*args), xb(*args))})
  return out


def bench(args) -> list[dict]:
  rf = roofline.measure(args, {})
  dtype = jnp.dtype(args.dtype)
  rows = []
  for shape in (DRY_SHAPES if args.dry_run else SHAPES):
    name, b, l, i, gn = shape
    inputs, cot = _inputs(b, l, i, gn, dtype)
    rows += byte_rows("gpu_layer", name, lambda impl: _fns(impl, cot), inputs, b * l, args.repeats,
                      rf["copy_bytes_per_s"], batch=b, seq_len=l, d_inner=i, dtype=args.dtype)
  return rows


def table(rows: list[dict]) -> list[str]:
  return byte_table(rows, {"kernels": "kernels", "xla": "xla"}, "kernels / xla")


def main(argv=None):
  return kernels_main(argv, prog="python -m benchmarks.gpu_layer", description=__doc__.split("\n")[0],
                      shapes=SHAPES, dry_shapes=DRY_SHAPES, check=check,
                      checked="layer kernels vs plain forms", bench=bench, table=table)


if __name__ == "__main__":
  main()
