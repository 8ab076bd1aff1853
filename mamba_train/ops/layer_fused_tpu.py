"""The Mamba-2 layer between in_proj and out_proj as one Pallas TPU kernel (Mosaic).

Same arguments and results as the plain form `layer_math.mixer_core` (the
reference, and what CPUs run): from in_proj's outputs z, x, B|C (before the conv)
and dt (before its softplus) to the gated SSD output y * silu(z) and each row's
sums of squares per norm group, which the model folds into the norm and out_proj
(`mamba2.mixer`: out = (g * rsqrt(ssq / width + eps) * w) @ W_out, XLA fusing the
row scaling into out_proj's operand).

Why one kernel: separate kernels at the layer's natural boundaries (conv | SSD |
norm) materialise their operands in HBM, and under remat their recomputed forward
needs them again (docs/bench/tpu_ssd.md). Here, per chunk and head block, on chip:

- prologue: the causal depthwise conv + bias + SiLU of x and of B and C, from their
  raw in_proj values; the k - 1 positions before a chunk come from the previous
  chunk's raw block, kept in VMEM (the grid walks each head block's chunks in
  order, as the one-pass SSD does), shifted in by lane (x, positions on lanes) or
  sublane (B, C) rotations; dt = clip(softplus(dt_raw + dt_bias)) and a = dt A;
- the one-pass SSD of `ssd_tpu` (its per-chunk math, the state carried in VMEM),
  y + D x;
- epilogue: the gate y * silu(z), written once in the compute dtype, and the
  per-head sums of its squares over p (float32, (c, b, h, q): 1/p of y's elements),
  summed per group in XLA.

Between in_proj's output and out_proj's input only the gated y is written (and the
final state). The backward pass is, for now, the plain form's VJP
(`jax.custom_vjp`): under remat the backward pass recomputes the layer in XLA and
the one-pass SSD kernels, as `layer_impl` 'xla' does; the forward alone moves
fewer bytes (docs/bench/fused_layer.md says how many, predicted and measured).

Supported: documents (seq_idx), initial states (the SSM state, and the conv's front
of earlier inputs, which the first chunk reads as its previous chunk), any length
(padded to whole chunks, dt 0 on the padding), ngroups dividing the heads. Not: a
padding mask, a window, a split sequence; those run the plain forms (`table.build`,
`mamba2.mixer`).

`interpret=True` runs the kernel in Pallas' interpreter (the CPU tests). Imports of
the package: the plain forms and the one-pass SSD's per-chunk math.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mamba_train.ops import ssd_tpu
from mamba_train.ops.layer_math import mixer_core
from mamba_train.ops.ssd import chunk_documents

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # dot_general: a @ b.T


class _Value:
  """An array where `ssd_tpu._chunk_terms` reads a ref (`v[...]`, `v.shape`): the
  chunk's log decays a = dt A are computed here, not read."""

  def __init__(self, value):
    self.value, self.shape = value, value.shape

  def __getitem__(self, idx):
    return self.value


def _silu(v):
  return v / (1.0 + jnp.exp(-v))


def _softplus(v):
  # jax.nn.softplus's form: log1p keeps small results (dt near dt_min, e^-7) exact.
  return jnp.maximum(v, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(v)))


def _shift(cur, prev, s: int, axis: int):
  """cur shifted s positions later along `axis`, prev's last s filling the front:
  the conv's tap reading position t - s."""
  idx = jax.lax.broadcasted_iota(jnp.int32, cur.shape, axis)
  return jnp.where(idx >= s, pltpu.roll(cur, s, axis), pltpu.roll(prev, s, axis))


def _kernel(*refs, hb, k, seq, length, dt_limit):
  n_in = 24 if seq else 18
  ins, outs = refs[:n_in], refs[n_in:]
  (x_ref, z_ref, dtr_ref, b_ref, c_ref, wx_ref, bx_ref, wb_ref, bb_ref, wc_ref, bcb_ref,
   dtb_ref, a_ref, d_ref, init_ref, fx_ref, fb_ref, fc_ref) = ins[:18]
  row_ref = col_ref = in_ref = end_ref = tap_row = tap_col = None
  if seq:  # the SSD's document masks, then the conv taps' (tap s: position t - s in t's document)
    row_ref, col_ref, in_ref, end_ref, tap_row, tap_col = ins[18:]
  g_ref, ssq_ref, final_ref, h_scr, px_scr, pb_scr, pc_scr = outs
  zi = pl.program_id(3)
  q = x_ref.shape[-1]
  cdt = x_ref.dtype

  @pl.when(zi == 0)
  def _():
    h_scr[...] = init_ref[...]
    # The conv's front (the inputs before position 0) as the previous chunk's last positions.
    px_scr[...] = fx_ref[...]
    pb_scr[...] = fb_ref[...]
    pc_scr[...] = fc_ref[...]

  def conv_bc(raw_ref, prev_scr, w_ref, bias_ref):
    """silu(conv) of B or C, (q, n), positions on sublanes, from raw inputs."""
    cur, prev = raw_ref[...].astype(_F32), prev_scr[...].astype(_F32)
    acc = bias_ref[...] + w_ref[k - 1:k, :] * cur
    for s in range(1, k):
      tap = _shift(cur, prev, s, 0)
      if seq:
        tap = tap * tap_col[:, s - 1:s]  # (q, 1): position t - s in t's document
      acc = acc + w_ref[k - 1 - s:k - s, :] * tap
    prev_scr[...] = raw_ref[...]
    return _silu(acc).astype(cdt)

  # B and C as the SSD takes them (the compute dtype), then the chunk's shared terms.
  bmat = conv_bc(b_ref, pb_scr, wb_ref, bb_ref)
  cmat = conv_bc(c_ref, pc_scr, wc_ref, bcb_ref)
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, q), 1)
  valid = zi * q + lane < length  # padding to whole chunks: dt 0 there, no input
  dt = _softplus(dtr_ref[...] + dtb_ref[...])  # (hb, q) float32
  lo, hi = dt_limit
  if lo > 0.0 or hi < float("inf"):
    dt = jnp.clip(dt, lo, hi)
  dt = jnp.where(valid, dt, 0.0)
  a = dt * a_ref[...]
  after, upto, keep, cb, a, decay_in, through, w = ssd_tpu._chunk_terms(
      _Value(a), _Value(bmat), _Value(cmat), row_ref, col_ref, in_ref, end_ref)
  for i in range(hb):
    # Prologue: x's conv + SiLU for head i, (p, q) with positions on lanes.
    cur, prev = x_ref[i].astype(_F32), px_scr[i].astype(_F32)
    acc = bx_ref[i] + wx_ref[k - 1, i] * cur  # (p, 1) weights and bias
    for s in range(1, k):
      tap = _shift(cur, prev, s, 1)
      if seq:
        tap = tap * tap_row[s - 1:s, :]
      acc = acc + wx_ref[k - 1 - s, i] * tap
    px_scr[i] = x_ref[i]
    xf = _silu(acc).astype(cdt).astype(_F32)  # x as the SSD reads it (compute dtype)
    # The one-pass SSD's chunk for head i (ssd_tpu._one_pass_kernel).
    m = (cb * ssd_tpu._decay(a[i:i + 1, :], upto, after, keep)).astype(cdt)
    xdt = xf * dt[i:i + 1, :]
    y = jax.lax.dot_general(xdt.astype(cdt), m, _NT, preferred_element_type=_F32)  # (p, t)
    state = h_scr[i]
    y = y + jax.lax.dot_general(state.astype(cdt), cmat, _NT, preferred_element_type=_F32) * decay_in[i:i + 1, :]
    y = y + xf * d_ref[pl.ds(i, 1), :]
    own = jax.lax.dot((xdt * w[i:i + 1, :]).astype(cdt), bmat, preferred_element_type=_F32)
    h_scr[i] = state * through[i:i + 1, :] + own
    # Epilogue: the gate, and the sum of squares over this head's p channels.
    gated = y.astype(cdt).astype(_F32) * _silu(z_ref[i].astype(_F32))
    g_ref[i] = gated.astype(g_ref.dtype)
    ssq_ref[pl.ds(i, 1), :] = jnp.sum(gated * gated, axis=0, keepdims=True)

  @pl.when(zi == pl.num_programs(3) - 1)
  def _():
    final_ref[...] = h_scr[...]


def _chunks(v, q, pad, shape, axes):
  """(b, l, ...) -> chunk-major `axes` order, padded with zeros to whole chunks."""
  if pad:
    v = jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
  return v.reshape(shape).transpose(axes)


def _tap_masks(seq_idx, k):
  """(b, l, k-1) float32: tap s (reading t - s) of position t counts (same document;
  before position 0 the front is zeros, so those taps count)."""
  l = seq_idx.shape[1]
  cols = []
  for s in range(1, k):
    back = jnp.concatenate([seq_idx[:, :1].repeat(min(s, l), 1), seq_idx[:, :max(l - s, 0)]], axis=1)[:, :l]
    cols.append((back == seq_idx).astype(_F32))
  return jnp.stack(cols, -1)


def _call(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx, interpret):
  b, l, i = xr.shape
  h = dt_raw.shape[-1]
  g, p, k = ngroups, i // h, w["conv_x"].shape[0]
  r, gn = h // g, bc.shape[-1]
  n = gn // g
  q = chunk
  pad = (-l) % q
  c = (l + pad) // q
  hb = ssd_tpu._head_block(r)
  nblk = r // hb
  seq = seq_idx is not None
  cdt = xr.dtype
  # The kernel's layouts: x and z (c, b, g, r, p, q), positions on lanes; B, C
  # (c, b, g, q, n); dt (c, b, g, r, q). XLA writes them so from in_proj's GEMMs.
  heads = lambda v: _chunks(v, q, pad, (b, c, q, g, r, p), (1, 0, 3, 4, 5, 2))
  xc, zc = heads(xr), heads(z)
  bcc = _chunks(bc, q, pad, (b, c, q, 2, g, n), (3, 1, 0, 4, 2, 5))  # (2, c, b, g, q, n)
  dtc = _chunks(dt_raw.astype(_F32), q, pad, (b, c, q, g, r), (1, 0, 3, 4, 2))
  wx = w["conv_x"].astype(_F32).reshape(k, g, r, p, 1)
  bx = w["conv_x_bias"].astype(_F32).reshape(g, r, p, 1)
  wbc = w["conv_bc"].astype(_F32).reshape(k, 2, g, n).transpose(1, 2, 0, 3)  # (2, g, k, n)
  bbc = w["conv_bc_bias"].astype(_F32).reshape(2, g, 1, n)
  col = lambda v: v.astype(_F32).reshape(g, r, 1)
  A = -jnp.exp(w["A_log"].astype(_F32))
  D = w["D"] if w.get("D") is not None else jnp.zeros((h,), _F32)
  init = (jnp.zeros((b, g, r, p, n), _F32) if initial_state is None
          else initial_state.astype(_F32).reshape(b, g, r, p, n))
  # The fronts placed at the end of a chunk of zeros: what the first chunk's taps read
  # as "the previous chunk" (read once per sequence and head block, 1/c of x).
  at_end = lambda f: jnp.pad(f.astype(cdt), [(0, 0), (q - (k - 1), 0)] + [(0, 0)] * (f.ndim - 2))
  fx = at_end(front_x).reshape(b, q, g, r, p).transpose(0, 2, 3, 4, 1)  # (b, g, r, p, q)
  fbc = at_end(front_bc).reshape(b, q, 2, g, n).transpose(2, 0, 3, 1, 4)  # (2, b, g, q, n)

  grid = (b, g, nblk, c)
  heads6 = lambda bi, gi, ri, zi: (zi, bi, gi, ri, 0, 0)
  head = lambda bi, gi, ri, zi: (zi, bi, gi, ri, 0)
  group = lambda bi, gi, ri, zi: (zi, bi, gi, 0, 0)
  state = lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0)
  per_head_w = lambda bi, gi, ri, zi: (0, gi, ri, 0, 0)
  per_group_w = lambda bi, gi, ri, zi: (gi, 0, 0)
  per_head = lambda bi, gi, ri, zi: (gi, ri, 0)
  spec = pl.BlockSpec
  in_specs = [spec((None, None, None, hb, p, q), heads6), spec((None, None, None, hb, p, q), heads6),
              spec((None, None, None, hb, q), head),
              spec((None, None, None, q, n), group), spec((None, None, None, q, n), group),
              spec((k, None, hb, p, 1), per_head_w), spec((None, hb, p, 1), lambda bi, gi, ri, zi: (gi, ri, 0, 0)),
              spec((None, k, n), per_group_w), spec((None, 1, n), per_group_w),
              spec((None, k, n), per_group_w), spec((None, 1, n), per_group_w),
              spec((None, hb, 1), per_head), spec((None, hb, 1), per_head), spec((None, hb, 1), per_head),
              spec((None, None, hb, p, n), state), spec((None, None, hb, p, q), state),
              spec((None, None, q, n), lambda bi, gi, ri, zi: (bi, gi, 0, 0)),
              spec((None, None, q, n), lambda bi, gi, ri, zi: (bi, gi, 0, 0))]
  args = [xc, zc, dtc, bcc[0], bcc[1], wx, bx, wbc[0], bbc[0], wbc[1], bbc[1],
          col(w["dt_bias"]), col(A), col(D), init, fx, fbc[0], fbc[1]]
  if seq:
    sq, doc_in = chunk_documents(seq_idx.astype(jnp.int32), q)  # (c, b, s), (c, b)
    keep_in = (sq == doc_in[..., None]).astype(_F32)[:, :, None, :]
    end = (sq == sq[:, :, -1:]).astype(_F32)[:, :, None, :]
    per_seq = lambda bi, gi, ri, zi: (zi, bi, 0, 0)
    in_specs += [spec((None, None, 1, q), per_seq), spec((None, None, q, 1), per_seq),
                 spec((None, None, 1, q), per_seq), spec((None, None, 1, q), per_seq),
                 spec((None, None, k - 1, q), per_seq), spec((None, None, q, k - 1), per_seq)]
    taps = _chunks(_tap_masks(seq_idx.astype(jnp.int32), k), q, pad, (b, c, q, k - 1), (1, 0, 3, 2))
    args += [sq[:, :, None, :], sq[:, :, :, None], keep_in, end, taps, taps.transpose(0, 1, 3, 2)]
  isz = jnp.dtype(cdt).itemsize
  cost = pl.CostEstimate(
      # The one-pass SSD's count (ssd_tpu._one_pass_call) plus the prologue (the
      # conv's k taps, SiLU and softplus) and the epilogue (gate, squares).
      flops=int(c * b * (g * nblk * 2 * q * q * n + h * (2 * q ** 3 + 4 * q * q + 2 * q * q * p + 4 * q * n * p
                                                          + 2 * p * n + 14 * q * q + 10 * q * p
                                                          + (4 * k + 12) * q * p))
                + c * b * g * nblk * 2 * (4 * k + 8) * q * n),
      transcendentals=int(c * b * h * (q * q + 2 * q + 3 * p * q) + c * b * g * nblk * 2 * q * n),
      # x, z read and the gated y written once; dt raw read, sums of squares written;
      # B and C once per head block; the states; the small weights per head block.
      bytes_accessed=int(3 * xc.size * isz + dtc.size * 4 * 2 + bcc.size * isz * nblk + 2 * init.size * 4
                         + fx.size * isz + fbc.size * isz * nblk
                         + (wx.size + bx.size + 3 * h) * 4 * b + wbc.size * 4 * b * nblk
                         + (c * b * q * 4 * (4 + 2 * (k - 1)) * g * nblk if seq else 0)))
  out_shape = (jax.ShapeDtypeStruct(xc.shape, cdt), jax.ShapeDtypeStruct(dtc.shape, _F32),
               jax.ShapeDtypeStruct(init.shape, _F32))
  out_specs = (spec((None, None, None, hb, p, q), heads6), spec((None, None, None, hb, q), head),
               spec((None, None, hb, p, n), state))
  scratch = [pltpu.VMEM((hb, p, n), _F32), pltpu.VMEM((hb, p, q), cdt), pltpu.VMEM((q, n), cdt),
             pltpu.VMEM((q, n), cdt)]
  kernel = functools.partial(_kernel, hb=hb, k=k, seq=seq, length=l, dt_limit=tuple(dt_limit))
  gated, ssq, final = pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name="mixer_fused")(*args)
  # Back to (b, l, ...): the gated y channels-minor (out_proj's operand), the squares per group.
  gated = gated.transpose(1, 0, 5, 2, 3, 4).reshape(b, c * q, i)[:, :l]
  ssq = ssq.transpose(1, 0, 4, 2, 3).reshape(b, c * q, g, r).sum(-1)[:, :l]
  return gated, ssq, final.reshape(b, h, p, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 12))
def _fused(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx, interpret):
  return _call(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx,
               interpret)


def _plain(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx, interpret):
  ssd = functools.partial(ssd_tpu.ssd_fused, interpret=interpret)
  return mixer_core(z, xr, bc, dt_raw, w, chunk, ngroups=ngroups, dt_limit=dt_limit, front_x=front_x,
                    front_bc=front_bc, initial_state=initial_state, seq_idx=seq_idx, ssd=ssd)


def _fused_fwd(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx,
               interpret):
  out = _call(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx,
              interpret)
  return out, (z, xr, bc, dt_raw, w, front_x, front_bc, initial_state, seq_idx)


def _fused_bwd(chunk, ngroups, dt_limit, interpret, res, ct):
  # The plain form's VJP (its SSD the one-pass kernels): recomputes the layer.
  z, xr, bc, dt_raw, w, front_x, front_bc, initial_state, seq_idx = res
  f = lambda z, xr, bc, dt_raw, w, fx, fbc, s: _plain(z, xr, bc, dt_raw, w, fx, fbc, chunk, ngroups, dt_limit,
                                                      s, seq_idx, interpret)
  _, vjp = jax.vjp(f, z, xr, bc, dt_raw, w, front_x, front_bc, initial_state)
  return (*vjp(ct), None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def mixer_core_tpu(z, xr, bc, dt_raw, w, chunk: int, *, ngroups: int, dt_limit=(0.0, float("inf")),
                   front_x=None, front_bc=None, initial_state=None, seq_idx=None, interpret: bool = False):
  """`layer_math.mixer_core` as one Pallas TPU kernel forward (see the module doc)."""
  b, h, k = xr.shape[0], dt_raw.shape[-1], w["conv_x"].shape[0]
  if initial_state is None:
    initial_state = jnp.zeros((b, h, xr.shape[-1] // h, bc.shape[-1] // ngroups), _F32)
  front_x = jnp.zeros((b, k - 1, xr.shape[-1]), _F32) if front_x is None else front_x
  front_bc = jnp.zeros((b, k - 1, *bc.shape[2:]), _F32) if front_bc is None else front_bc
  return _fused(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, tuple(dt_limit), initial_state, seq_idx,
                interpret)
