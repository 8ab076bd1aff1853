"""The routed experts' grouped matmuls by megablox, JAX's Pallas TPU grouped matmul
(forward and backward stay grouped: gmm and tgmm), where libtpu lowers
`jax.lax.ragged_dot` on some chips to a product over every local expert
(docs/bench/moe.md). Same arguments and result as `experts.expert_mlp_xla`.

The row tile. megablox's gmm walks (n tiles, row tiles, k tiles) with k innermost and
its pipeline copies a block only when the block's index changes. So where the
contraction takes more than one k tile an expert's (tk, tn) weight blocks are read
again for every row tile (its cost estimate says so for every call: an expert's matrix
times row tiles + experts - 1); a row tile of 512 reads them a quarter as often as
one of 128. tgmm (the weights' gradient) walks the rows innermost and keeps an
expert's (tk, tn) result in VMEM, so its traffic does not depend on the row tile and
its VMEM is mostly that result: it keeps the small one. Hence our own VJP around
megablox's two kernels, which asks for a tiling per kernel (megablox's `ops.gmm`
gives both one)."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

try:  # JAX's Pallas TPU grouped matmul's kernels (the module: the package's `gmm` is its VJP)
  megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
except ImportError:  # pragma: no cover - an experimental path that may move
  megablox = None

from mamba_train.ops.experts import grouped, split_gate

# What one gmm grid step's blocks may take of scoped VMEM (`gmm_vmem`). megablox keeps
# Mosaic's default scoped limit, 16 MiB on v5p (more on v6e, where every tiling below
# compiles): compiled for v5p, blocks of 15.4 MiB by `gmm_vmem` fit and of 15.8 did
# not (Mosaic keeps some for itself; docs/bench/moe.md, "megablox's row tile").
VMEM_BUDGET = 15 * 1024 * 1024
ROW_TILES = (512, 256, 128)
# Output tiles tried for a contraction of several k tiles, whose weights are re-read
# every row tile: a narrower one that lets a larger row tile fit is worth it.
NARROW = (1024, 896, 768, 640, 512)


def _gmm_tm(m: int) -> int:
  """megablox's smallest row tile for m rows: 128, or m rounded up to 16 (a bfloat16
  sublane tile) below that; the rows are padded to a multiple of it."""
  return 128 if m >= 128 else -(-m // 16) * 16


def _gmm_tile(d: int) -> int:
  """A contraction / output tile for a dimension d: d itself up to 1024; else the
  largest multiple of 128 up to 1024 that divides d (2688 = 21 x 128 -> 896); else d
  itself up to 4096 (a block the full dimension wide needs no 128 multiple: 1856);
  else 512, whose ragged last tile megablox masks."""
  if d <= 1024:
    return d
  for t in range(1024, 127, -128):
    if d % t == 0:
      return t
  return d if d <= 4096 else 512


def gmm_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
  """megablox's (tm, tk, tn) for an (m, k) x (e, k, n) problem with the smallest row
  tile: the weights' gradient (tgmm) takes it as is; gmm a larger row tile where
  VMEM has room (`row_tiling`)."""
  return _gmm_tm(m), _gmm_tile(k), _gmm_tile(n)


def _lanes(d: int) -> int:
  return -(-d // 128) * 128  # a block's last dimension is laid out in 128-wide lanes


def gmm_vmem(tm: int, tk: int, tn: int, lhs: int, rhs: int, out: int) -> int:
  """Bytes of VMEM one gmm grid step holds: the (tm, tk) rows, (tk, tn) weights and
  (tm, tn) result blocks twice (the pipeline's double buffers) and the float32
  accumulator, each block's last dimension padded to lanes of 128. lhs, rhs, out:
  bytes an element. (The transposed weights of the rows' gradient, (tn, tk), take as
  much within a few lanes.)"""
  blocks = tm * _lanes(tk) * lhs + tk * _lanes(tn) * rhs + tm * _lanes(tn) * out
  return 2 * blocks + 4 * tm * _lanes(tn)


def row_tiling(m: int, k: int, n: int, lhs: int = 2, rhs: int = 2, out: int = 4) -> tuple[int, int, int]:
  """gmm's (tm, tk, tn): `gmm_tiling`'s, with the largest row tile of `ROW_TILES` that
  divides the (padded) m and whose blocks fit `VMEM_BUDGET`. Where the contraction
  takes several k tiles (each expert's weights then read once a row tile) a narrower
  output tile of `NARROW` is taken if a larger row tile then fits; with one k tile
  the weights stay in VMEM across an expert's row tiles, and the widest output tile
  reads the rows fewest times."""
  tm, tk, tn = gmm_tiling(m, k, n)
  several = tk < k
  for t in ROW_TILES:
    if t < tm or m % t:
      continue
    for w in (tn, *(w for w in NARROW if several and w < tn)):
      if t == tm or gmm_vmem(t, tk, w, lhs, rhs, out) <= VMEM_BUDGET:
        return t, tk, w
  return tm, tk, tn


def _size(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def _forward(lhs, rhs, sizes, out_dtype, interpret):
  m, k = lhs.shape
  tiles = row_tiling(m, k, rhs.shape[2], _size(lhs.dtype), _size(rhs.dtype), _size(out_dtype))
  return megablox.gmm(lhs, rhs, sizes, out_dtype, tiles, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gmm(lhs, rhs, sizes, out_dtype, interpret: bool = False):
  """megablox's gmm of lhs (m, k) by rhs (e, k, n) in row groups of `sizes`, the result
  in out_dtype, differentiable: the rows' gradient by gmm on the transposed weights,
  the weights' by tgmm, each with its own tiling (the module's docstring)."""
  return _forward(lhs, rhs, sizes, out_dtype, interpret)


def _gmm_fwd(lhs, rhs, sizes, out_dtype, interpret):
  return _forward(lhs, rhs, sizes, out_dtype, interpret), (lhs, rhs, sizes)


def _gmm_bwd(out_dtype, interpret, res, g):
  del out_dtype
  lhs, rhs, sizes = res
  (m, k), n = lhs.shape, rhs.shape[2]
  # the rows' gradient: (m, n) x (e, k, n)^T, whose contraction is n
  tiles = row_tiling(m, n, k, _size(g.dtype), _size(rhs.dtype), _size(lhs.dtype))
  d_lhs = megablox.gmm(g, rhs, sizes, lhs.dtype, tiles, transpose_rhs=True, interpret=interpret)
  d_rhs = megablox.tgmm(lhs.swapaxes(0, 1), g, sizes, rhs.dtype, gmm_tiling(m, k, n), interpret=interpret)
  return d_lhs, d_rhs, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def expert_mlp_megablox(rows, up, down, sizes, cd, *, interpret: bool = False):
  """`experts.expert_mlp_xla` by megablox's grouped matmul, whose rows must be a
  multiple of its row tile. Results in the compute dtype `cd` (float32 accumulation
  inside), as tokamax's (`experts_gpu`): the cotangents flowing back into the
  backward kernels are then in it too, so with bfloat16 they read half the bytes and
  multiply at bfloat16's rate (megablox multiplies in float32 where either operand
  is), and their blocks leave room for 512-row tiles (docs/bench/moe.md)."""
  if megablox is None:
    raise ImportError("moe_impl='megablox' needs jax.experimental.pallas.ops.tpu.megablox, which this "
                      "jax lacks; use moe_impl='xla'")
  gate, up = split_gate(up)
  sizes = sizes.astype(jnp.int32)
  m = rows.shape[0]
  mm = lambda a, w: gmm(a, w, sizes, cd, interpret)
  return grouped(rows, up, gate, down, sizes, cd, mm, -(-m // _gmm_tm(m)) * _gmm_tm(m) - m)
