"""The Mamba-2 layer's elementwise chain as Pallas kernels for TPUs (Mosaic).

Two kernels, each with the arguments and results of its plain form in `layer_math`
(the reference, and what CPUs run) and of its GPU twin in `layer_gpu`, forward and
backward (`jax.custom_vjp`):

- `causal_conv_silu_tpu`: the depthwise causal conv + bias + SiLU between in_proj and
  the SSD, reading in_proj's x (or B|C) output in its natural (b, l, c) layout;
- `gated_rms_norm_tpu`: y * silu(z), RMS over groups of i / g channels, times the
  weight, between the SSD and out_proj.

Why kernels: XLA splits each chain into several fusions whose float32 intermediates
(the conv's pre-activation and float32 input gradient, y * silu(z), the conv taps
for the weight gradient) cross HBM (docs/bench/tpu_ssd.md, "The layer's elementwise
chain"). Here each kernel reads its inputs once and writes its outputs once, in the
input's dtype; the backward recomputes what the forward did not keep (the
pre-activation, the row's RMS) from the same inputs. What that buys depends on
remat (docs/bench/tpu_ssd.md): without it, 3.5e9 fewer bytes for two scanned 1.3b
layers; under `save_in_proj` the kernels' operands are materialised and their forward
reruns in the backward pass where XLA fuses the recompute into its consumers, and the
scanned step counts about as many bytes as XLA's fusions, so `auto` keeps those on TPU.

Mosaic's rules shape the blocks: the last two dims of a block are multiples of
(8, 128) (16 rows for bfloat16) or the whole axis. The conv's k-1 taps reach back
before a block of positions: the kernel reads x a second time as a 16-row block
ending where its own block starts (the front of earlier inputs for the first block),
and its backward reads the 16 rows after its block (x, the output's cotangent and
the document masks) the same way. Shifted taps are static sublane-offset reads of a
VMEM scratch holding [halo, block]. The document masks (tap s of position t
counts when position t - s is in t's document) are one small int32 of bits per
position, computed in XLA, read as a (1, positions) row and turned into a column in
the kernel (a masked lane sum: Mosaic has no (1, n) -> (n, 1) reshape).

Numerics as the plain forms: float32 arithmetic inside, the result in the input's
dtype. Reductions over rows (the conv's weight and bias, the norm's weight) are
per-program float32 partial sums added in XLA, so they do not depend on the order
programs run in; the norm's per-group sums are a 0/1 matmul at HIGHEST precision
(sums of the terms, float32) when there are several groups. `interpret=True` runs
the kernels in Pallas' interpreter on any backend (the CPU tests). Imports of the
package: its reference forms only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mamba_train.ops.layer_math import causal_conv_silu, dsilu, pad_axis

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # dot_general: a @ b.T

# The conv: a program owns CONV_ROWS positions of one sequence and a channel block
# (CONV_CHANNELS, or the whole axis when it is not a multiple of 128). HALO rows
# around a block: a multiple of bfloat16's 16-row tile, at least k - 1.
CONV_ROWS = 256
CONV_CHANNELS = 512
HALO = 16
# The norm: a program owns whole rows (all groups), at most NORM_ELEMENTS elements a
# block: (128, 4096) does not fit v5p's default 16 MiB of scoped VMEM with the
# backward's float32 temporaries (Mosaic's CompileTimeScopedVmemOom at the 1.3b
# width); (64, 4096) with several groups (their 0/1 matrices) needs 17 MiB, so the
# norm asks for NORM_VMEM (compiled for v5p and v6e in tests/test_layer_tpu.py).
NORM_ROWS = 128
NORM_ELEMENTS = 64 * 4096
NORM_VMEM = 32 * 1024 * 1024


def _round_up(v: int, m: int) -> int:
  return -(-v // m) * m


def _sigmoid(a):
  return 1.0 / (1.0 + jnp.exp(-a))


# ----------------------------------------------------------------------------
# Causal conv + bias + SiLU over x (b, L, C): output position t reads x[t - s] with
# weight w[k-1-s] for s = 0..k-1; bits[t] has bit s-1 set when x[t - s] is in t's
# document (all set without documents).


def _column(row, n):
  """A (1, T) int32 row as a (T, 1) column, its first n rows: a masked lane sum."""
  t = row.shape[-1]
  eye = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0) == jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
  return jnp.sum(jnp.where(eye, row, 0), axis=1, keepdims=True)[:n]


def _ok(bits, s):
  """(rows, 1) bool: tap s counts (its input is in the output position's document)."""
  return ((bits >> (s - 1)) & 1) == 1


def _pre(xs_ref, w_ref, b_ref, bits, start, rows, k):
  """The pre-activation at `rows` output positions whose inputs sit at xs_ref rows
  [start, start + rows) (the k-1 before them at lower rows): (rows, Cb) float32."""
  a = b_ref[...] + w_ref[pl.ds(k - 1, 1), :] * xs_ref[pl.ds(start, rows), :]
  for s in range(1, k):
    tap = w_ref[pl.ds(k - 1 - s, 1), :] * xs_ref[pl.ds(start - s, rows), :]
    a = a + (tap if bits is None else jnp.where(_ok(bits, s), tap, 0.0))
  return a


def _conv_fwd_kernel(*refs, k, seq):
  if seq:
    x_ref, prev_ref, front_ref, w_ref, b_ref, bits_ref, y_ref, xs_ref = refs
  else:
    x_ref, prev_ref, front_ref, w_ref, b_ref, y_ref, xs_ref = refs
    bits_ref = None
  t = x_ref.shape[0]
  first = pl.program_id(2) == 0
  # xs = [the HALO inputs before the block, the block]: the front for the first block.
  xs_ref[pl.ds(0, HALO), :] = jnp.where(first, front_ref[...], prev_ref[...]).astype(_F32)
  xs_ref[pl.ds(HALO, t), :] = x_ref[...].astype(_F32)
  bits = None if bits_ref is None else _column(bits_ref[...], t)
  a = _pre(xs_ref, w_ref, b_ref, bits, HALO, t, k)
  y_ref[...] = (a * _sigmoid(a)).astype(y_ref.dtype)


def _conv_bwd_kernel(*refs, k, seq):
  """dx[t] = sum_s w[k-1-s] ok_s[t+s] da[t+s] (the outputs that read x[t]), da = dy
  silu'(a), a recomputed at this block's positions and the HALO after it;
  dw[k-1-s] = sum_t ok_s[t] da[t] x[t - s], db = sum_t da[t] over this block."""
  if seq:
    (x_ref, prev_ref, next_ref, front_ref, w_ref, b_ref, dy_ref, dyn_ref, bits_ref, bitsn_ref,
     dx_ref, dw_ref, db_ref, xs_ref, m_ref) = refs
  else:
    (x_ref, prev_ref, next_ref, front_ref, w_ref, b_ref, dy_ref, dyn_ref,
     dx_ref, dw_ref, db_ref, xs_ref, m_ref) = refs
    bits_ref = bitsn_ref = None
  t = x_ref.shape[0]
  ti = pl.program_id(2)
  xs_ref[pl.ds(0, HALO), :] = jnp.where(ti == 0, front_ref[...], prev_ref[...]).astype(_F32)
  xs_ref[pl.ds(HALO, t), :] = x_ref[...].astype(_F32)
  xs_ref[pl.ds(HALO + t, HALO), :] = next_ref[...].astype(_F32)
  bits = None if bits_ref is None else _column(bits_ref[...], t)
  bitsn = None if bitsn_ref is None else _column(bitsn_ref[...], HALO)

  def da_at(start, rows, b, dy):
    a = _pre(xs_ref, w_ref, b_ref, b, start, rows, k)
    return dy.astype(_F32) * dsilu(a, _sigmoid(a))

  da = da_at(HALO, t, bits, dy_ref[...])
  # Past the last block there are no outputs: the next rows' da is zero there.
  da_n = jnp.where(ti < pl.num_programs(2) - 1, da_at(HALO + t, HALO, bitsn, dyn_ref[...]), 0.0)
  dx = w_ref[pl.ds(k - 1, 1), :] * da
  dws = [None] * k
  dws[k - 1] = jnp.sum(da * xs_ref[pl.ds(HALO, t), :], axis=0, keepdims=True)
  for s in range(1, k):
    # m = ok_s da at this block's rows and the HALO after: dx[t] reads m[t + s].
    m_ref[pl.ds(0, t), :] = da if bits is None else jnp.where(_ok(bits, s), da, 0.0)
    m_ref[pl.ds(t, HALO), :] = da_n if bitsn is None else jnp.where(_ok(bitsn, s), da_n, 0.0)
    dx = dx + w_ref[pl.ds(k - 1 - s, 1), :] * m_ref[pl.ds(s, t), :]
    dws[k - 1 - s] = jnp.sum(m_ref[pl.ds(0, t), :] * xs_ref[pl.ds(HALO - s, t), :], axis=0, keepdims=True)
  dx_ref[...] = dx.astype(dx_ref.dtype)
  for j in range(k):
    dw_ref[pl.ds(j, 1), :] = dws[j]
  db_ref[...] = jnp.sum(da, axis=0, keepdims=True)


def _conv_tiles(l: int, c: int) -> tuple[int, int, int]:
  """(positions a block, padded length, channels a block)."""
  t = min(CONV_ROWS, _round_up(l, HALO))
  bc = c
  if c % 128 == 0:
    bc = next(v for v in (CONV_CHANNELS, 256, 128) if c % v == 0)
  return t, _round_up(l, t), bc


def _conv_specs(t, bc, k):
  hb = t // HALO  # a block's length in HALO-row units
  own = pl.BlockSpec((None, t, bc), lambda bi, ci, ti: (bi, ti, ci))
  prev = pl.BlockSpec((None, HALO, bc), lambda bi, ci, ti: (bi, jnp.maximum(ti * hb - 1, 0), ci))
  front = pl.BlockSpec((None, HALO, bc), lambda bi, ci, ti: (bi, 0, ci))
  w = pl.BlockSpec((k, bc), lambda bi, ci, ti: (0, ci))
  bias = pl.BlockSpec((1, bc), lambda bi, ci, ti: (0, ci))
  bits = pl.BlockSpec((None, 1, t), lambda bi, ci, ti: (bi, 0, ti))
  return own, prev, front, w, bias, bits


def _params():
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))


def _conv_fwd_call(x, front, w, bias, bits, interpret):
  b, L, C = x.shape
  k = w.shape[0]
  t, _, bc = _conv_tiles(L, C)
  own, prev, fspec, wspec, bspec, bitspec = _conv_specs(t, bc, k)
  isz = jnp.dtype(x.dtype).itemsize
  nt, nc = L // t, C // bc
  cost = pl.CostEstimate(
      # k multiply-adds, the masks' selects and the SiLU (~5 ops) per output
      flops=int(b * L * C * (3 * k + 5)), transcendentals=int(b * L * C),
      # x read once and written once as y, the halo and front blocks, the masks once
      # per channel block
      bytes_accessed=int(2 * x.size * isz + 2 * b * nt * HALO * C * isz
                         + (0 if bits is None else bits.size * 4 * nc)))
  specs, args = [own, prev, fspec, wspec, bspec], [x, x, front, w, bias]
  if bits is not None:
    specs, args = specs + [bitspec], args + [bits]
  return pl.pallas_call(
      functools.partial(_conv_fwd_kernel, k=k, seq=bits is not None),
      out_shape=jax.ShapeDtypeStruct((b, L, C), x.dtype), grid=(b, nc, nt),
      in_specs=specs, out_specs=own, scratch_shapes=[pltpu.VMEM((t + HALO, bc), _F32)],
      compiler_params=_params(), cost_estimate=cost, interpret=interpret, name="conv_silu_tpu_fwd")(*args)


def _conv_bwd_call(x, front, w, bias, bits, dy, interpret):
  b, L, C = x.shape
  k = w.shape[0]
  t, _, bc = _conv_tiles(L, C)
  own, prev, fspec, wspec, bspec, bitspec = _conv_specs(t, bc, k)
  hb, nt, nc = t // HALO, L // t, C // bc
  nxt = pl.BlockSpec((None, HALO, bc), lambda bi, ci, ti: (bi, jnp.minimum((ti + 1) * hb, L // HALO - 1), ci))
  bitsn = pl.BlockSpec((None, 1, t), lambda bi, ci, ti: (bi, 0, jnp.minimum(ti + 1, nt - 1)))
  part = lambda rows: pl.BlockSpec((None, None, rows, bc), lambda bi, ci, ti: (bi, ti, 0, ci))
  out_shape = (jax.ShapeDtypeStruct((b, L, C), x.dtype), jax.ShapeDtypeStruct((b, nt, k, C), _F32),
               jax.ShapeDtypeStruct((b, nt, 1, C), _F32))
  isz = jnp.dtype(x.dtype).itemsize
  cost = pl.CostEstimate(
      # the pre-activation at this block and its halo, SiLU's derivative, k taps of dx
      # and of dw, the masks' selects
      flops=int(b * L * C * (6 * k + 12)), transcendentals=int(b * L * C),
      # x and dy read once, dx written once (plus the halo blocks), the partial sums
      # of dw and db written once, the masks twice per channel block
      bytes_accessed=int(3 * x.size * isz + 3 * b * nt * HALO * C * isz + b * nt * (k + 1) * C * 4
                         + (0 if bits is None else 2 * bits.size * 4 * nc)))
  specs, args = [own, prev, nxt, fspec, wspec, bspec, own, nxt], [x, x, x, front, w, bias, dy, dy]
  if bits is not None:
    specs, args = specs + [bitspec, bitsn], args + [bits, bits]
  return pl.pallas_call(
      functools.partial(_conv_bwd_kernel, k=k, seq=bits is not None),
      out_shape=out_shape, grid=(b, nc, nt), in_specs=specs, out_specs=(own, part(k), part(1)),
      scratch_shapes=[pltpu.VMEM((t + 2 * HALO, bc), _F32), pltpu.VMEM((t + HALO, bc), _F32)],
      compiler_params=_params(), cost_estimate=cost, interpret=interpret, name="conv_silu_tpu_bwd")(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _conv(x, front, w, bias, bits, head_ids, front_ids, interpret):
  return _conv_fwd_call(x, front, w, bias, bits, interpret)


def _conv_fwd(x, front, w, bias, bits, head_ids, front_ids, interpret):
  return _conv_fwd_call(x, front, w, bias, bits, interpret), (x, front, w, bias, bits, head_ids, front_ids)


def _conv_bwd(interpret, res, dy):
  x, front, w, bias, bits, head_ids, front_ids = res
  dy = dy.astype(x.dtype)
  dx, dw, db = _conv_bwd_call(x, front, w, bias, bits, dy, interpret)
  # The front feeds only the first k-1 outputs: its cotangent from the plain form
  # over those (a (b, k-1, C) sliver), rather than a kernel path of its own.
  k = w.shape[0]
  _, vjp = jax.vjp(lambda f: causal_conv_silu(x[:, :k - 1], w, bias[0], f, head_ids, front_ids)[0],
                   front[:, HALO - (k - 1):])
  dfront, = vjp(dy[:, :k - 1].astype(_F32))
  dfront = jnp.pad(dfront, ((0, 0), (HALO - (k - 1), 0), (0, 0)))
  return dx, dfront, jnp.sum(dw, axis=(0, 1)), jnp.sum(db, axis=(0, 1)), None, None, None


_conv.defvjp(_conv_fwd, _conv_bwd)


def _doc_bits(seq_idx, front_idx, k):
  """(b, l) int32: bit s-1 set when position t - s (of the front, for t < s) is in
  position t's document, s = 1..k-1."""
  if front_idx is None:
    front_idx = jnp.repeat(seq_idx[:, :1], k - 1, axis=1)
  l = seq_idx.shape[1]
  ids = jnp.concatenate([front_idx, seq_idx], axis=1).astype(jnp.int32)
  own = seq_idx.astype(jnp.int32)
  bits = jnp.zeros(own.shape, jnp.int32)
  for s in range(1, k):
    bits = bits | ((ids[:, k - 1 - s:k - 1 - s + l] == own).astype(jnp.int32) << (s - 1))
  return bits


def causal_conv_silu_tpu(x, w, bias, front, seq_idx=None, front_idx=None, *, interpret: bool = False):
  """`layer_math.causal_conv_silu` as Pallas Mosaic kernels: its arguments and shapes; the
  activation in x's dtype (float32 inside) and the new front (float32)."""
  b, l = x.shape[:2]
  chan = x.shape[2:]
  k = w.shape[0]
  if not 1 <= k - 1 <= HALO:
    raise ValueError(f"the TPU conv kernel takes d_conv from 2 to {HALO + 1}, got {k}: "
                     f"use runtime.layer_impl='xla'")
  C = math.prod(chan)
  _, L, _ = _conv_tiles(l, C)
  # Padding (none at whole blocks of positions): zero positions after the end.
  xk = pad_axis(x.reshape(b, l, C), 1, L)
  fk = jnp.pad(front.reshape(b, k - 1, C).astype(x.dtype), ((0, 0), (HALO - (k - 1), 0), (0, 0)))
  wk = w.reshape(k, C).astype(_F32)
  bk = bias.reshape(1, C).astype(_F32)
  bits = head_ids = front_ids = None
  if seq_idx is not None:
    bits = pad_axis(_doc_bits(seq_idx, front_idx, k), 1, L)[:, None, :]
    head_ids = pad_axis(seq_idx, 1, L, mode="edge")[:, :k - 1]
    front_ids = jnp.repeat(seq_idx[:, :1], k - 1, axis=1) if front_idx is None else front_idx
  y = _conv(xk, fk, wk, bk, bits, head_ids, front_ids, interpret)[:, :l].reshape(x.shape)
  # The new front: the last k-1 inputs (of the front, too, when l < k - 1).
  tail = x[:, l - (k - 1):] if l >= k - 1 else jnp.concatenate([front.astype(x.dtype), x], 1)[:, l:]
  return y, tail.astype(_F32)


# ----------------------------------------------------------------------------
# Gated RMSNorm: rows (b l) of i channels in g groups of G; a program owns NORM_ROWS
# whole rows.


def _group_sum(v, groups, G):
  """Per-group sums of v's lanes broadcast back over the group, (rows, i) float32."""
  if groups == 1:
    return jnp.sum(v, axis=1, keepdims=True)
  i = v.shape[-1]
  # A (i, 128) 0/1 matrix of channel -> group (the lanes past `groups` unused), so both
  # matmuls have aligned shapes; at HIGHEST they sum float32 terms, no bfloat16 rounding.
  ch = jax.lax.broadcasted_iota(jnp.int32, (i, 128), 0)
  gi = jax.lax.broadcasted_iota(jnp.int32, (i, 128), 1)
  onehot = ((ch >= gi * G) & (ch < gi * G + G)).astype(_F32)
  sums = jax.lax.dot(v, onehot, precision=_HIGHEST, preferred_element_type=_F32)  # (rows, 128)
  return jax.lax.dot_general(sums, onehot, _NT, precision=_HIGHEST, preferred_element_type=_F32)


def _norm_fwd_kernel(y_ref, z_ref, w_ref, o_ref, *, groups, G, eps):
  z = z_ref[...].astype(_F32)
  x = y_ref[...].astype(_F32) * z * _sigmoid(z)
  rstd = jax.lax.rsqrt(_group_sum(x * x, groups, G) / G + eps)
  o_ref[...] = (x * rstd * w_ref[...]).astype(o_ref.dtype)


def _norm_bwd_kernel(y_ref, z_ref, w_ref, do_ref, dy_ref, dz_ref, dw_ref, *, groups, G, eps):
  """out = x r w, x = y silu(z), r = rsqrt(mean(x^2) + eps) over the group: dw += do x r;
  dx = r (g - x r mean(g x r)) with g = do w; dy = dx silu(z); dz = dx y silu'(z).
  r is recomputed from the row (the forward keeps nothing)."""
  y, z = y_ref[...].astype(_F32), z_ref[...].astype(_F32)
  sig = _sigmoid(z)
  x = y * z * sig
  rstd = jax.lax.rsqrt(_group_sum(x * x, groups, G) / G + eps)
  xn = x * rstd
  do = do_ref[...].astype(_F32)
  g = do * w_ref[...]
  dx = rstd * (g - xn * (_group_sum(g * xn, groups, G) / G))
  dy_ref[...] = (dx * z * sig).astype(dy_ref.dtype)
  dz_ref[...] = (dx * y * dsilu(z, sig)).astype(dz_ref.dtype)
  dw_ref[...] = jnp.sum(do * xn, axis=0, keepdims=True)


def _norm_rows(R: int, i: int) -> int:
  """Rows a program owns: at most NORM_ROWS and NORM_ELEMENTS / i, a multiple of 16
  (bfloat16's tile), or all R when fewer (R is padded to a multiple of the result)."""
  rows = max(HALO, min(NORM_ROWS, NORM_ELEMENTS // i) // HALO * HALO)
  return rows if R > rows else _round_up(R, HALO)


def _norm_specs(rows, i):
  return (pl.BlockSpec((rows, i), lambda ri: (ri, 0)), pl.BlockSpec((1, i), lambda ri: (0, 0)))


def _norm_call(y, z, w, groups, G, eps, interpret):
  R, i = y.shape
  row, wspec = _norm_specs(_norm_rows(R, i), i)
  rows = row.block_shape[0]
  isz = jnp.dtype(y.dtype).itemsize
  cost = pl.CostEstimate(
      flops=int(R * i * (8 + (4 * 128 * 6 if groups > 1 else 0))), transcendentals=int(2 * R * i),
      bytes_accessed=int(3 * y.size * isz + w.size * 4))
  return pl.pallas_call(
      functools.partial(_norm_fwd_kernel, groups=groups, G=G, eps=eps),
      out_shape=jax.ShapeDtypeStruct((R, i), y.dtype), grid=(R // rows,),
      in_specs=[row, row, wspec], out_specs=row, cost_estimate=cost,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=NORM_VMEM),
      interpret=interpret, name="gated_norm_tpu_fwd")(y, z, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _norm(y, z, w, groups, G, eps, interpret):
  return _norm_call(y, z, w, groups, G, eps, interpret)


def _norm_fwd(y, z, w, groups, G, eps, interpret):
  return _norm_call(y, z, w, groups, G, eps, interpret), (y, z, w)


def _norm_bwd(groups, G, eps, interpret, res, do):
  y, z, w = res
  R, i = y.shape
  row, wspec = _norm_specs(_norm_rows(R, i), i)
  nr = R // row.block_shape[0]
  isz = jnp.dtype(y.dtype).itemsize
  cost = pl.CostEstimate(
      flops=int(R * i * (24 + (8 * 128 * 6 if groups > 1 else 0))), transcendentals=int(2 * R * i),
      # y, z and the output's cotangent read once, dy and dz written once, the
      # weight's partial sums (one row per program) written once
      bytes_accessed=int(5 * y.size * isz + nr * i * 4 + w.size * 4))
  dy, dz, dw = pl.pallas_call(
      functools.partial(_norm_bwd_kernel, groups=groups, G=G, eps=eps),
      out_shape=(jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(z.shape, z.dtype),
                 jax.ShapeDtypeStruct((nr, 1, i), _F32)),
      grid=(nr,), in_specs=[row, row, wspec, row],
      out_specs=(row, row, pl.BlockSpec((None, 1, i), lambda ri: (ri, 0, 0))), cost_estimate=cost,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=NORM_VMEM),
      interpret=interpret, name="gated_norm_tpu_bwd")(y, z, w, do.astype(y.dtype))
  return dy, dz, jnp.sum(dw, axis=(0, 1))[None, :]


_norm.defvjp(_norm_fwd, _norm_bwd)


def gated_rms_norm_tpu(y, z, weight, groups, eps, *, interpret: bool = False):
  """`layer_math.gated_rms_norm` as Pallas Mosaic kernels: same arguments; the result
  in the dtype of y and z together (the compute dtype out_proj multiplies in),
  float32 inside. y, z: (..., i); weight: (i,)."""
  i = y.shape[-1]
  if i % groups:
    raise ValueError(f"d_inner ({i}) must be a multiple of groups ({groups})")
  if groups > 128:
    raise ValueError(f"the TPU gated norm takes at most 128 groups, got {groups}: use runtime.layer_impl='xla'")
  dt = jnp.promote_types(y.dtype, z.dtype)
  lead = y.shape[:-1]
  R = math.prod(lead)
  # Zero rows after the end (none when the rows fill whole blocks) are dropped.
  Rp = _round_up(R, _norm_rows(R, i))
  prep = lambda a: pad_axis(a.astype(dt).reshape(R, i), 0, Rp)
  out = _norm(prep(y), prep(z), weight.astype(_F32).reshape(1, i), groups, i // groups, float(eps), interpret)
  return out[:R].reshape(*lead, i)
