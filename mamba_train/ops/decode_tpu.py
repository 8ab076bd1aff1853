"""One decoding step of a Mamba-2 block as three Pallas TPU kernels: the pre-norm
and in_proj, the step between the matmuls, out_proj and the residual add.

`mamba2.mixer_step` (the reference, and what CPUs and GPUs run) takes one token
through in_proj, the conv-state shift with the depthwise conv and SiLU (x and
B|C), dt's softplus and clamp, the SSD recurrence step (`ssd.ssd_step`) with the D
skip, the gate and grouped RMSNorm, and out_proj. Compiled for a TPU, the chain
between the matmuls is about 40 launches a layer (fusions, unfused scalar ops,
copies: docs/bench/decode_tpu.md); at batch 1 each moves a few kilobytes, so a
small model's token is launch-bound. `mixer_step_fused` is that chain as one
kernel: it reads in_proj's outputs, the layer's small parameters and its states,
and writes the normed y (what out_proj reads) and the new conv and SSM states in
place (`input_output_aliases`). `norm_in_proj` and `out_proj_residual` (at the end
of this file) are the matmuls around it, each streaming its weight from HBM in
tiles, so a layer launches these three kernels and nothing else.

Layout: everything a row of the batch holds is a row of lanes, (1, channels), as
in_proj writes it; the SSM state is (h*p, n), heads and head dim on the sublanes.
The step needs x, dt and the decay per state row (a column) and y per channel (a
row): rather than transposing between the two, the kernel forms them on the matrix
unit with one-hot matrices built from iotas (exact at HIGHEST precision: each
product is a value times 1). Per group g and row j of a head block:
    dt*x (x) B:  X[j, n] = sum_g onehot[g, j] dt_j x_j  B[g, n]   (a (gp, R)^T (gp, n) matmul)
    decay:       E[j, n] = sum_g onehot[g, j] exp(dt_j A_j)       (the same with ones)
    state:       H <- H * E + X
    y:           y[j] = sum_g onehot[g, j] (C H^T)[g, j]         (a (gp, n) (R, n)^T matmul)
and dt, the decay and D go from heads to channels (lanes) through a one-hot (h, h*p)
matmul. The state is walked in blocks of R rows (whole heads, at most 1 MiB of
float32 each), so the temporaries stay small at any width.

Numerics are `mixer_step`'s: states, dt, A, the decay, the conv and the norms float32;
in_proj's z|x|B|C arrive in the compute dtype and the conv state is widened from
it, as `layer_math.causal_conv` does. The grid runs over the batch, one row a step.

`interpret=True` runs the kernel in Pallas' interpreter (the CPU tests). This
module imports nothing of the package.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # dot_general: a @ b.T
_TN = (((0,), (0,)), ((), ()))  # dot_general: a.T @ b
# The most float32 state rows one block of the step holds (1 MiB at n = 128).
_BLOCK_BYTES = 1 << 20


def _dot(a, b, dims):
  return jax.lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=_F32)


def in_hbm(x, hbm: bool = True):
  """x, for a kernel operand, kept in HBM (when `hbm`). Without the constraint XLA
  prefetches a Pallas call's small and mid-sized operands into VMEM with DMAs of
  its own before the call (one op each, a large weight in 4 MB pieces and a join),
  which the kernel's own pipeline then copies again, VMEM to VMEM; constrained,
  the kernel's DMAs are the only ones. Not for an operand that is a slice XLA makes
  (a layer's weight in a layer scan): held to HBM, the slice is written out before
  the kernel reads it, where unconstrained XLA DMAs it straight into VMEM. (jax
  releases without the primitive: unconstrained.)"""
  constrain = getattr(pltpu, "with_memory_space_constraint", None)
  return constrain(x, pltpu.HBM) if hbm and constrain is not None else x


def _head_rows(h: int, p: int, n: int) -> int:
  """Heads per block of the state: the most whose (rows, n) float32 block fits
  _BLOCK_BYTES, dividing h, with a multiple of 128 rows (lane-aligned slices of
  the per-channel rows) unless the block is all heads."""
  for hb in range(h, 0, -1):
    if h % hb == 0 and (hb == h or (hb * p) % 128 == 0) and hb * p * n * 4 <= _BLOCK_BYTES:
      return hb
  return h


def pack_small(w) -> jax.Array:
  """A layer's small parameters as one float32 array (2k+6, W), made once before a
  decode loop, so the kernel takes one operand (one DMA) for all of them: rows of
  conv_x (k, i), conv_x_bias, gate_norm, conv_bc as (k, 2 g*n) (B's taps, then C's),
  conv_bc_bias, dt_bias, A_log, D; lanes padded to W = max(i, 2 g*n, h).
  Leading (stacked-layer) axes are kept."""
  k, i = w["conv_x"].shape[-2:]
  gn = w["conv_bc"].shape[-1]
  lead = w["conv_x"].shape[:-2]
  h = w["D"].shape[-1]
  width = max(i, 2 * gn, h)

  def row(a, rows):
    a = a.astype(_F32).reshape(*lead, rows, -1)
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])])
  parts = [row(w["conv_x"], k), row(w["conv_x_bias"], 1), row(w["gate_norm"], 1),
           row(w["conv_bc"], k), row(w["conv_bc_bias"], 1),
           row(w["dt_bias"], 1), row(w["A_log"], 1), row(w["D"], 1)]
  return jnp.concatenate(parts, axis=-2)


def _conv_taps(state, new, taps, bias):
  """The causal conv at the newest position: bias + sum_j w[j] * window[j] over the
  window (the k-1 stored inputs, then `new`), in `layer_math.causal_conv`'s order.
  Returns the conv (float32) and the window's last k-1 entries (the new state)."""
  window = state + [new]
  out = bias
  for j, w in enumerate(taps):
    out = out + window[j] * w
  return out, window[1:]


def _kernel(proj_ref, cx_ref, cbc_ref, ssm_ref, small_ref, y_ref, cx_out, cbc_out, ssm_out, *,
            g, p, hb, eps, dt_limit, cd, k, static_row):
  bi = 0 if static_row else pl.program_id(0)
  i = y_ref.shape[-1]
  gn = cbc_ref.shape[-1]
  n = ssm_ref.shape[-1]
  hp = ssm_ref.shape[-2]
  h = hp // p
  silu = lambda v: v * jax.nn.sigmoid(v)
  small = lambda r, width: small_ref[r:r + 1, 0:width]  # (1, width)
  widen = lambda v: v.astype(cd).astype(_F32)  # a value as the compute dtype holds it

  # in_proj's row z | x | B | C | dt (float32); z|x|B|C rounded as in_proj rounds them.
  proj = proj_ref[pl.ds(bi, 1), :]
  z, xr = widen(proj[:, 0:i]), widen(proj[:, i:2 * i])
  Br, Cr = widen(proj[:, 2 * i:2 * i + gn]), widen(proj[:, 2 * i + gn:2 * i + 2 * gn])
  dt_raw = proj[:, 2 * i + 2 * gn:2 * i + 2 * gn + h]

  # conv-state shift, depthwise conv and SiLU: x (1, i), B and C (1, g*n). The state
  # was written from in_proj's rounded values; widened from them again, as
  # `layer_math.causal_conv` joins the state in the input's dtype.
  conv, window = _conv_taps([widen(cx_ref[j, pl.ds(bi, 1), :]) for j in range(k - 1)], xr,
                            [small(j, i) for j in range(k)], small(k, i))
  for j in range(k - 1):
    cx_out[j, pl.ds(bi, 1), :] = window[j]
  x = silu(conv)
  bc_state = [widen(cbc_ref[j]) for j in range(k - 1)]  # (2, g*n) each: B, C
  taps = [small(k + 2 + j, 2 * gn) for j in range(k)]
  bias = small(2 * k + 2, 2 * gn)
  convB, winB = _conv_taps([s[0:1] for s in bc_state], Br, [t[:, :gn] for t in taps], bias[:, :gn])
  convC, winC = _conv_taps([s[1:2] for s in bc_state], Cr, [t[:, gn:] for t in taps], bias[:, gn:])
  row2 = jax.lax.broadcasted_iota(jnp.int32, (2, gn), 0)
  for j in range(k - 1):
    cbc_out[j] = jnp.where(row2 == 0, winB[j], winC[j])
  B, C = silu(convB), silu(convC)

  # dt, the decay and D per head (1, h), then per channel (1, h*p) by a one-hot matmul.
  dt = jax.nn.softplus(dt_raw + small(2 * k + 3, h))
  lo, hi = dt_limit
  if lo > 0.0 or hi < math.inf:
    dt = jnp.clip(dt, lo, hi)
  decay = jnp.exp(dt * -jnp.exp(small(2 * k + 4, h)))
  row8 = jax.lax.broadcasted_iota(jnp.int32, (8, h), 0)
  per_head = jnp.where(row8 == 0, dt, jnp.where(row8 == 1, decay, jnp.where(row8 == 2, small(2 * k + 5, h), 0.0)))
  head_of = jax.lax.broadcasted_iota(jnp.int32, (h, hp), 0)
  lane = jax.lax.broadcasted_iota(jnp.int32, (h, hp), 1)
  expand = ((lane >= head_of * p) & (lane < head_of * p + p)).astype(_F32)
  per_chan = _dot(per_head, expand, (((1,), (0,)), ((), ())))  # (8, h*p)
  dt_c, decay_c, d_c = per_chan[0:1], per_chan[1:2], per_chan[2:3]
  xdt = dt_c * x

  # B and C as (gp, n) rows per group (gp: g padded to 8 sublanes), zeros below.
  gp = max(8, -(-g // 8) * 8)
  grow = jax.lax.broadcasted_iota(jnp.int32, (gp, n), 0)
  Bg = jnp.zeros((gp, n), _F32)
  Cg = jnp.zeros((gp, n), _F32)
  for gi in range(g):
    Bg = jnp.where(grow == gi, B[:, gi * n:(gi + 1) * n], Bg)
    Cg = jnp.where(grow == gi, C[:, gi * n:(gi + 1) * n], Cg)
  ones = (grow < g).astype(_F32)

  # The SSD step over blocks of hb heads (R rows of the state).
  R = hb * p
  rows_per_group = hp // g
  ys = []
  for r0 in range(0, hp, R):
    sl = slice(r0, r0 + R)
    gr = jax.lax.broadcasted_iota(jnp.int32, (gp, R), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (gp, R), 1) + r0
    onehot = ((col >= gr * rows_per_group) & (col < gr * rows_per_group + rows_per_group)).astype(_F32)
    X = _dot(onehot * xdt[:, sl], Bg, _TN)  # (R, n): dt x_j B[g(j)]
    E = _dot(onehot * decay_c[:, sl], ones, _TN)  # (R, n): the decay of row j's head
    H = ssm_ref[sl, :] * E + X
    ssm_out[sl, :] = H
    ys.append(jnp.sum(onehot * _dot(Cg, H, _NT), axis=0, keepdims=True))  # (1, R)
  y = (ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=1)) + d_c * x

  # Gate and grouped RMSNorm (`layer_math.gated_rms_norm`), times the weight.
  v = y * silu(z)
  per = i // g
  lane_i = jax.lax.broadcasted_iota(jnp.int32, (1, i), 1)
  scale = jnp.zeros((1, i), _F32)
  for gi in range(g):
    mine = (lane_i >= gi * per) & (lane_i < gi * per + per)
    ms = jnp.sum(jnp.where(mine, v * v, 0.0), axis=1, keepdims=True) / per
    scale = jnp.where(mine, jax.lax.rsqrt(ms + eps), scale)
  y_ref[pl.ds(bi, 1), :] = (v * scale * small(k + 1, i)).astype(y_ref.dtype)


def mixer_step_fused(proj, conv_x, conv_bc, ssm, small, *, ngroups: int, eps: float,
                     dt_limit=(0.0, math.inf), compute_dtype=jnp.float32, interpret: bool = False,
                     hbm: bool = True):
  """The mixer's step between in_proj and out_proj, as `mamba2.mixer_step` computes it.

  proj: (b, 2i + 2g*n + h) float32, in_proj's output z | x | B | C | dt (z|x|B|C
  are rounded to `compute_dtype` here, as the plain step rounds them). conv_x:
  (b, k-1, i), conv_bc: (b, k-1, 2, g*n), ssm: (b, h, p, n), the layer's states,
  float32. small: the layer's small parameters, `pack_small`.
  Returns the gated, normed y (b, i) (what out_proj reads: in the compute dtype at
  batch 1, else float32, which out_proj rounds as it would anyway: a bfloat16 row
  at a dynamic sublane is a store Mosaic cannot prove aligned, two rows sharing a
  sublane) and the new conv_x, conv_bc and ssm (written over the old ones' buffers
  when they are donated). hbm: the states and parameters held in HBM (`in_hbm`).
  """
  b, i = proj.shape[0], conv_x.shape[-1]
  _, h, p, n = ssm.shape
  k = conv_x.shape[1] + 1
  gn = conv_bc.shape[-1]
  cd = jnp.dtype(compute_dtype)
  hb = _head_rows(h, p, n)
  # conv_x as (k-1, b, i), whole: XLA lays a (b, k-1, i) state out with k-1 major
  # (no padding of the k-1 rows to a sublane tile), which the kernel's per-row
  # (k-1, i) block would copy into (8, 128) tiles and back on every call; seen
  # with the batch in the middle it is those bytes in that order.
  keep = lambda a: in_hbm(a, hbm and not interpret)
  args = (proj.astype(_F32), keep(jnp.swapaxes(conv_x, 0, 1)), keep(conv_bc), keep(ssm.reshape(b, h * p, n)),
          keep(small))
  row = lambda *blk: pl.BlockSpec((None, *blk), lambda bi: (bi,) + (0,) * len(blk))
  whole = lambda a: pl.BlockSpec(a.shape, lambda bi: (0,) * a.ndim)
  in_specs = [whole(args[0]), whole(args[1]), row(k - 1, 2, gn), row(h * p, n), whole(small)]
  out_shape = (jax.ShapeDtypeStruct((b, i), cd if b == 1 else _F32), jax.ShapeDtypeStruct(args[1].shape, _F32),
               jax.ShapeDtypeStruct(conv_bc.shape, _F32), jax.ShapeDtypeStruct((b, h * p, n), _F32))
  out_specs = (whole(out_shape[0]), whole(args[1]), row(k - 1, 2, gn), row(h * p, n))
  gp = max(8, -(-ngroups // 8) * 8)
  cost = pl.CostEstimate(
      # per row: the one-hot expansion (8 x h x hp), per state row three matmuls
      # over gp groups and n, the update, the conv taps and the norm.
      flops=int(b * (2 * 8 * h * h * p + 3 * 2 * gp * h * p * n + 3 * h * p * n
                     + 2 * k * (i + 2 * gn) + 12 * i)),
      transcendentals=int(b * (i + 2 * gn + 3 * h + i)),
      bytes_accessed=int(sum(a.size * a.dtype.itemsize for a in args)
                         + sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in out_shape)))
  y, cx, cbc, s = pl.pallas_call(
      functools.partial(_kernel, g=ngroups, p=p, hb=hb, eps=float(eps),
                        dt_limit=(float(dt_limit[0]), float(dt_limit[1])), cd=cd, k=k, static_row=b == 1),
      out_shape=out_shape, grid=(b,), in_specs=in_specs, out_specs=out_specs,
      input_output_aliases={1: 1, 2: 2, 3: 3},
      # One row a step; the batch axis is sequential ("arbitrary") because every
      # step writes its row of the one resident y block.
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      cost_estimate=cost, interpret=interpret, name="mamba2_decode_step")(*args)
  return y, jnp.swapaxes(cx, 0, 1), cbc, s.reshape(b, h, p, n)


# ----------------------------------------------------------------------------
# The projections around the step: pre-norm + in_proj, and out_proj + residual.
#
# Each is one kernel over a grid of weight tiles, a tile a block of output columns
# (rows of in_proj's transposed weight, columns of out_proj's): Pallas' pipeline DMAs
# tile j+1 from HBM while the matrix unit multiplies tile j, so the weight is read
# once, in its stored dtype, and nothing but the (b, columns) result leaves the
# chip. XLA's form of the same (`mamba2.block_step` on the plain weights) is a
# matvec fusion each plus the norm's scalar ops, a result reshape and the weight's
# prefetch DMAs in pieces; a layer becomes these two kernels and the step's.

# The most bytes one weight tile holds (two are in VMEM at once, double-buffered).
_TILE_BYTES = 2 << 20


def _col_tile(rows: int, cols: int, itemsize: int) -> int:
  """Output columns a weight tile holds: a multiple of 128 (a lane tile of the
  result) with rows x columns within _TILE_BYTES (rows: the contracted length), or
  all of them when they fit. The last tile may run past the weight's end: Pallas
  clips its DMA, and the result's columns past the end are not written."""
  tn = max(128, (_TILE_BYTES // max(1, rows * itemsize)) // 128 * 128)
  return cols if cols <= tn else tn


def _norm_in_kernel(h_ref, *refs, eps, cd):
  *nw_ref, w_ref, o_ref = refs
  x = h_ref[...].astype(_F32)
  if nw_ref:  # `mamba2.rms_norm`, recomputed per tile: (b, d) is a few KB
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * nw_ref[0][...]
  # The weight tile is (columns, d): x w^T, as attention's q k^T.
  o_ref[...] = jax.lax.dot_general(x.astype(cd), w_ref[...].astype(cd), _NT, preferred_element_type=_F32)


def norm_in_proj(h, w_t, norm_weight=None, *, eps: float = 1e-5, compute_dtype=jnp.float32,
                 interpret: bool = False, hbm: bool = True):
  """in_proj of one position, with the block's pre-norm: rms_norm(h) @ w_t^T.

  h: (b, d) float32 (the residual stream); norm_weight: (1, d) float32, or None for
  no norm; w_t: (W, d), in_proj's weight transposed, in the compute dtype (made
  once before the loop). Stored so, a tile of rows is contiguous and neither
  dimension pads (W is a multiple of 8, d of 128, in the released models; XLA lays
  a (d, W) weight out column-major to avoid W's padding, which a kernel reading it
  row-major would copy every token). The norm is float32, rounded to the compute
  dtype for the product (float32 accumulation), as `mamba2.rms_norm` then
  `matmul.linear` compute it. hbm: the weights held in HBM (`in_hbm`). Returns
  (b, W) float32."""
  b, d = h.shape
  W = w_t.shape[0]
  cd = jnp.dtype(compute_dtype)
  tn = _col_tile(d, W, w_t.dtype.itemsize)
  tiles = pl.cdiv(W, tn)
  args, specs = [h.astype(_F32)], [pl.BlockSpec((b, d), lambda j: (0, 0))]
  if norm_weight is not None:
    args.append(in_hbm(norm_weight.astype(_F32).reshape(1, d), hbm and not interpret))
    specs.append(pl.BlockSpec((1, d), lambda j: (0, 0)))
  cost = pl.CostEstimate(flops=int(2 * b * d * W + 4 * b * d * tiles), transcendentals=int(b * tiles),
                         bytes_accessed=int(w_t.size * w_t.dtype.itemsize + 4 * (b * d + d + b * W)))
  return pl.pallas_call(
      functools.partial(_norm_in_kernel, eps=float(eps), cd=cd),
      out_shape=jax.ShapeDtypeStruct((b, W), _F32), grid=(tiles,),
      in_specs=specs + [pl.BlockSpec((tn, d), lambda j: (j, 0))],
      out_specs=pl.BlockSpec((b, tn), lambda j: (0, j)),
      # Tiles are independent: a chip with two cores (v5p) splits them.
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      cost_estimate=cost, interpret=interpret, name="mamba2_decode_in_proj")(*args, in_hbm(w_t, hbm and not interpret))


def _out_res_kernel(y_ref, w_ref, *refs, cd, mult):
  *h_ref, o_ref = refs
  out = jnp.dot(y_ref[...].astype(cd), w_ref[...].astype(cd), preferred_element_type=_F32)
  if h_ref:
    out = h_ref[0][...] + (out if mult == 1.0 else mult * out)
  o_ref[...] = out


def out_proj_residual(y, w, h=None, *, residual_multiplier: float = 1.0, compute_dtype=jnp.float32,
                      interpret: bool = False, hbm: bool = True):
  """out_proj of one position, with the block's residual add: h + m * (y @ w).

  y: (b, i) (the step's normed y); w: (i, d) in the compute dtype; h: (b, d) float32,
  the residual stream, or None for out_proj alone. y is rounded to the compute
  dtype for the product (float32 accumulation), as `matmul.linear` does; the sum
  is float32 (`mamba2.residual`). hbm: the weight held in HBM (`in_hbm`). Returns
  (b, d) float32."""
  b, i = y.shape
  d = w.shape[-1]
  cd = jnp.dtype(compute_dtype)
  tn = _col_tile(i, d, w.dtype.itemsize)
  args = [y, in_hbm(w, hbm and not interpret)]
  specs = [pl.BlockSpec((b, i), lambda j: (0, 0)), pl.BlockSpec((i, tn), lambda j: (0, j))]
  if h is not None:
    args.append(h.astype(_F32))
    specs.append(pl.BlockSpec((b, tn), lambda j: (0, j)))
  resid = 0 if h is None else 4 * b * d
  cost = pl.CostEstimate(flops=int(2 * b * i * d + 2 * b * d), transcendentals=0,
                         bytes_accessed=int(w.size * w.dtype.itemsize + y.size * y.dtype.itemsize + 4 * b * d + resid))
  return pl.pallas_call(
      functools.partial(_out_res_kernel, cd=cd, mult=float(residual_multiplier)),
      out_shape=jax.ShapeDtypeStruct((b, d), _F32), grid=(pl.cdiv(d, tn),),
      in_specs=specs, out_specs=pl.BlockSpec((b, tn), lambda j: (0, j)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      cost_estimate=cost, interpret=interpret, name="mamba2_decode_out_proj")(*args)
