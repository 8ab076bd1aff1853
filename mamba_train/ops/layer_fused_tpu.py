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
final state).

The backward (the forward's `jax.custom_vjp`) is one kernel too, `_bwd_call`, on the
forward's grid with the chunks innermost, sequential and in reverse. Under
differentiation the forward kernel also writes each chunk's entering state
(b, g, r, c, p, n) float32 (`mixer_fused_save`, as `ssd_tpu`'s one-pass kernel does).
Per chunk and head block the backward kernel recomputes, from in_proj's raw outputs,
the conv + SiLU of x, B and C (reading the previous chunk's raw block, or the front,
for the conv's reach back), dt, the chunk's SSD output and the gate; then takes the
gate's gradient (the gated y's cotangent plus 2 gated times its sum of squares'), the
SSD chunk's (`ssd_tpu._outputs_head_bwd`, `_states_head_bwd`, the state's cotangent
carried in VMEM from the final state's back to the initial state's), SiLU's and the
conv's. Walking in reverse, an input's conv gradient needs the pre-activation
cotangents of the k - 1 positions after it, which may sit in the next chunk: that
chunk's are kept in VMEM (the halo). It writes the gradients of in_proj's outputs (x,
z, dt; B and C as per-head-block float32 partials, B and C being shared by a group's
heads across blocks, summed outside; everything after dB, dC is linear in them), and
the small ones: the conv weights and biases per sequence (and head block), rows of
A's and D's to sum, the initial state's and the fronts'. Nothing (l, d_inner)-sized
crosses HBM but its inputs (x, z, the gated y's cotangent and the previous chunk's x)
and its outputs (dx, dz); docs/bench/fused_layer.md has the counts, predicted and
measured.

Supported: documents (seq_idx), initial states (the SSM state, and the conv's front
of earlier inputs, which the first chunk reads as its previous chunk), any length
(padded to whole chunks, dt 0 on the padding), ngroups dividing the heads. Not: a
padding mask, a window, a split sequence; those run the plain forms (`table.build`,
`mamba2.mixer`).

`interpret=True` runs the kernels in Pallas' interpreter (the CPU tests). Imports of
the package: SiLU's derivative of the plain forms, and the one-pass SSD's per-chunk
math, forward and backward.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mamba_train.ops import ssd_tpu
from mamba_train.ops.layer_math import dsilu
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


def _sigmoid(v):
  return 1.0 / (1.0 + jnp.exp(-v))


def _conv(cur, prev, w_at, bias, k, axis, mask):
  """The causal conv's pre-activation of one block (float32) from its raw inputs cur
  and the previous block's prev, and its k - 1 shifted taps (tap s reads position
  t - s, times `mask(s)`, its document mask, unless None): the weights' gradients
  read them. w_at(j): tap j's weights, broadcasting against the block."""
  acc = bias + w_at(k - 1) * cur
  taps = []
  for s in range(1, k):
    tap = _shift(cur, prev, s, axis)
    if mask(s) is not None:
      tap = tap * mask(s)
    taps.append(tap)
    acc = acc + w_at(k - 1 - s) * tap
  return acc, taps


def _conv_bwd(dpre, nxt, cur, taps, w_at, k, axis, mask, next_mask):
  """`_conv`'s gradients, the chunks walked in reverse: dpre is the block's
  pre-activation cotangent, nxt the next block's (zeros after the last). Tap s of
  position t read t - s, so the input at u gets w_{k-1-s} dpre[u + s], from the next
  block where u + s passes the end (its masks `next_mask`). Returns the inputs'
  gradient, the k taps' weight gradients and the bias's (summed over `axis`), and
  what reaches the inputs before the block (at the end of a block-sized array: the
  front's gradient, for the first chunk)."""
  size = dpre.shape[axis]
  red = lambda v: jnp.sum(v, axis=axis, keepdims=True)
  din = w_at(k - 1) * dpre
  dw = [None] * (k - 1) + [red(dpre * cur)]
  dfront = jnp.zeros_like(dpre)
  for s in range(1, k):
    early = jax.lax.broadcasted_iota(jnp.int32, dpre.shape, axis) < size - s
    md = dpre if mask(s) is None else dpre * mask(s)
    mn = nxt if next_mask(s) is None else nxt * next_mask(s)
    rolled = pltpu.roll(md, size - s, axis)  # rolled[u] = md[u + s], wrapping
    din = din + w_at(k - 1 - s) * jnp.where(early, rolled, pltpu.roll(mn, size - s, axis))
    dfront = dfront + w_at(k - 1 - s) * jnp.where(early, 0.0, rolled)
    dw[k - 1 - s] = red(dpre * taps[s - 1])  # the taps carry their masks
  return din, dw, red(dpre), dfront


def _dt(dtr_ref, dtb_ref, chunk, length, dt_limit):
  """dt = clip(softplus(dt_raw + dt_bias)), 0 on the padding to whole chunks: (hb, q)
  float32; with its argument v and the mask of where d dt / d v = sigmoid(v)."""
  q = dtr_ref.shape[-1]
  v = dtr_ref[...] + dtb_ref[...]
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, q), 1)
  passes = chunk * q + lane < length
  dt = _softplus(v)
  lo, hi = dt_limit
  if lo > 0.0 or hi < float("inf"):
    passes = passes & (dt > lo) & (dt < hi)
    dt = jnp.clip(dt, lo, hi)
  return jnp.where(chunk * q + lane < length, dt, 0.0), v, passes


def _ssd_head(xf, dt_i, d_i, cb, lmat, state, cmat, decay_row, cdt):
  """One head's chunk output y (p, t) float32, as `ssd_tpu._one_pass_kernel`."""
  m = (cb * lmat).astype(cdt)
  y = jax.lax.dot_general((xf * dt_i).astype(cdt), m, _NT, preferred_element_type=_F32)
  y = y + jax.lax.dot_general(state.astype(cdt), cmat, _NT, preferred_element_type=_F32) * decay_row
  return y + xf * d_i


def _masks(seq, tap_row, tap_col):
  """Tap s's document masks: along lanes (x, (1, q)) and sublanes (B, C, (q, 1))."""
  if not seq:
    return (lambda s: None), (lambda s: None)
  return (lambda s: tap_row[s - 1:s, :]), (lambda s: tap_col[:, s - 1:s])


def _kernel(*refs, hb, k, seq, length, dt_limit, save):
  n_in = 24 if seq else 18
  ins, outs = refs[:n_in], refs[n_in:]
  (x_ref, z_ref, dtr_ref, b_ref, c_ref, wx_ref, bx_ref, wb_ref, bb_ref, wc_ref, bcb_ref,
   dtb_ref, a_ref, d_ref, init_ref, fx_ref, fb_ref, fc_ref) = ins[:18]
  # The SSD's document masks, then the conv taps' (tap s: position t - s in t's document).
  row_ref, col_ref, in_ref, end_ref, tap_row, tap_col = ins[18:] if seq else (None,) * 6
  g_ref, ssq_ref, final_ref = outs[:3]
  st_ref = outs[3] if save else None
  h_scr, px_scr, pb_scr, pc_scr = outs[3 + save:]
  zi = pl.program_id(3)
  cdt = x_ref.dtype
  row_mask, col_mask = _masks(seq, tap_row, tap_col)

  @pl.when(zi == 0)
  def _():
    h_scr[...] = init_ref[...]
    # The conv's front (the inputs before position 0) as the previous chunk's last positions.
    px_scr[...] = fx_ref[...]
    pb_scr[...] = fb_ref[...]
    pc_scr[...] = fc_ref[...]

  if save:  # the entering states, the backward kernel's residual (one float32 write)
    st_ref[...] = h_scr[...]

  def conv_bc(raw_ref, prev_scr, w_ref, bias_ref):
    """silu(conv) of B or C, (q, n), positions on sublanes, from raw inputs."""
    acc, _ = _conv(raw_ref[...].astype(_F32), prev_scr[...].astype(_F32), lambda j: w_ref[j:j + 1, :],
                   bias_ref[...], k, 0, col_mask)
    prev_scr[...] = raw_ref[...]
    return _silu(acc).astype(cdt)

  # B and C as the SSD takes them (the compute dtype), then the chunk's shared terms.
  bmat = conv_bc(b_ref, pb_scr, wb_ref, bb_ref)
  cmat = conv_bc(c_ref, pc_scr, wc_ref, bcb_ref)
  dt, _, _ = _dt(dtr_ref, dtb_ref, zi, length, dt_limit)
  a = dt * a_ref[...]
  after, upto, keep, cb, a, decay_in, through, w = ssd_tpu._chunk_terms(
      _Value(a), _Value(bmat), _Value(cmat), row_ref, col_ref, in_ref, end_ref)
  for i in range(hb):
    # Prologue: x's conv + SiLU for head i, (p, q) with positions on lanes.
    acc, _ = _conv(x_ref[i].astype(_F32), px_scr[i].astype(_F32), lambda j: wx_ref[j, i], bx_ref[i], k, 1,
                   row_mask)
    px_scr[i] = x_ref[i]
    xf = _silu(acc).astype(cdt).astype(_F32)  # x as the SSD reads it (compute dtype)
    # The one-pass SSD's chunk for head i (ssd_tpu._one_pass_kernel).
    dt_i = dt[i:i + 1, :]
    state = h_scr[i]
    y = _ssd_head(xf, dt_i, d_ref[pl.ds(i, 1), :], cb, ssd_tpu._decay(a[i:i + 1, :], upto, after, keep), state,
                  cmat, decay_in[i:i + 1, :], cdt)
    own = jax.lax.dot((xf * dt_i * w[i:i + 1, :]).astype(cdt), bmat, preferred_element_type=_F32)
    h_scr[i] = state * through[i:i + 1, :] + own
    # Epilogue: the gate, and the sum of squares over this head's p channels.
    gated = y.astype(cdt).astype(_F32) * _silu(z_ref[i].astype(_F32))
    g_ref[i] = gated.astype(g_ref.dtype)
    ssq_ref[pl.ds(i, 1), :] = jnp.sum(gated * gated, axis=0, keepdims=True)

  @pl.when(zi == pl.num_programs(3) - 1)
  def _():
    final_ref[...] = h_scr[...]


def _bwd_kernel(*refs, hb, k, seq, length, dt_limit):
  n_in = 30 if seq else 24
  ins, outs = refs[:n_in], refs[n_in:]
  (x_ref, z_ref, dtr_ref, b_ref, c_ref, wx_ref, bx_ref, wb_ref, bb_ref, wc_ref, bcb_ref, dtb_ref, a_ref, d_ref,
   st_ref, fx_ref, fb_ref, fc_ref, dg_ref, dssq_ref, dfin_ref, xp_ref, bp_ref, cp_ref) = ins[:24]
  row_ref, col_ref, in_ref, end_ref, tap_row, tap_col = ins[24:] if seq else (None,) * 6
  (dx_ref, dz_ref, dbp_ref, dcp_ref, ddtr_ref, da_ref, dd_ref, dinit_ref, dwx_ref, dbx_ref, dwb_ref, dbb_ref,
   dwc_ref, dbcb_ref, dfx_ref, dfb_ref, dfc_ref,
   dh_scr, nx_scr, nb_scr, nc_scr, ntr_scr, ntc_scr, ddt_scr, dar_scr, dcs_scr, dte_scr) = outs
  zi = pl.program_id(3)
  ci = pl.num_programs(3) - 1 - zi  # the chunk of this step: the walk is in reverse
  q = x_ref.shape[-1]
  cdt = x_ref.dtype
  row_mask, col_mask = _masks(seq, tap_row, tap_col)
  next_row, next_col = _masks(seq, ntr_scr, ntc_scr)

  # dh_scr: the cotangent of the state leaving this chunk, from the final state's;
  # n*_scr: the next chunk's conv pre-activation cotangents (zeros after the last) and
  # its tap masks; the weights' gradients accumulate over the chunks in their blocks.
  @pl.when(zi == 0)
  def _():
    dh_scr[...] = dfin_ref[...]
    for ref in (nx_scr, nb_scr, nc_scr, ntr_scr, ntc_scr, dwx_ref, dbx_ref, dwb_ref, dbb_ref, dwc_ref, dbcb_ref):
      ref[...] = jnp.zeros(ref.shape, ref.dtype)

  # The previous chunk's raw inputs (the conv's reach back), or the front for the first.
  first = 1.0 - jnp.minimum(ci, 1).astype(_F32)
  prev = lambda front, other: first * front.astype(_F32) + (1.0 - first) * other.astype(_F32)

  def conv_bc(raw_ref, front_ref, prev_ref, w_ref, bias_ref):
    cur = raw_ref[...].astype(_F32)
    acc, taps = _conv(cur, prev(front_ref[...], prev_ref[...]), lambda j: w_ref[j:j + 1, :], bias_ref[...], k,
                      0, col_mask)
    sig = _sigmoid(acc)
    return acc, sig, cur, taps, (acc * sig).astype(cdt)

  # The forward's chunk, recomputed as it computes it.
  bconv = conv_bc(b_ref, fb_ref, bp_ref, wb_ref, bb_ref)
  cconv = conv_bc(c_ref, fc_ref, cp_ref, wc_ref, bcb_ref)
  bmat, cmat = bconv[-1], cconv[-1]
  dt, v, passes = _dt(dtr_ref, dtb_ref, ci, length, dt_limit)
  A = a_ref[...]
  after, upto, keep, cb, a, decay_in, through, w = ssd_tpu._chunk_terms(
      _Value(dt * A), _Value(bmat), _Value(cmat), row_ref, col_ref, in_ref, end_ref)
  last = jax.lax.broadcasted_iota(jnp.int32, (1, q), 1) == q - 1
  dssq = dssq_ref[...]  # (1, q): the group's sum of squares' cotangent, each head's too
  dcb = jnp.zeros((q, q), _F32)
  dcm = jnp.zeros(cmat.shape, _F32)
  dbm = jnp.zeros(bmat.shape, _F32)
  for i in range(hb):
    row = pl.ds(i, 1)
    cur = x_ref[i].astype(_F32)
    acc, taps = _conv(cur, prev(fx_ref[i], xp_ref[i]), lambda j: wx_ref[j, i], bx_ref[i], k, 1, row_mask)
    sig = _sigmoid(acc)
    xf = (acc * sig).astype(cdt).astype(_F32)
    dt_i, d_i = dt[i:i + 1, :], d_ref[row, :]
    lmat = ssd_tpu._decay(a[i:i + 1, :], upto, after, keep)
    state, dout = st_ref[i], dh_scr[i]  # the entering state, the leaving one's cotangent
    y = _ssd_head(xf, dt_i, d_i, cb, lmat, state, cmat, decay_in[i:i + 1, :], cdt)
    # The gate's backward: the gated y's cotangent plus its sum of squares' (2 gated dssq).
    yr = y.astype(cdt).astype(_F32)
    zf = z_ref[i].astype(_F32)
    sz = _sigmoid(zf)
    dgated = dg_ref[i].astype(_F32) + 2.0 * (yr * zf * sz) * dssq
    dz_ref[i] = (dgated * yr * dsilu(zf, sz)).astype(dz_ref.dtype)
    dy = (dgated * zf * sz).astype(cdt)
    # The SSD chunk's backward (ssd_tpu._one_pass_bwd_kernel): its outputs, then the state leaving it.
    dx, ddt, da, dd, dcs, dh_in, dc_i, dl = ssd_tpu._outputs_head_bwd(
        dy, xf, dt_i, d_i, cb, lmat, state.astype(cdt), cmat, decay_in[i:i + 1, :], after, upto)
    dx_s, ddt_s, dte, db_i = ssd_tpu._states_head_bwd(dout.astype(cdt), bmat, xf, dt_i, w[i:i + 1, :])
    ddt_scr[row, :], dar_scr[row, :], dd_ref[row, :], dte_scr[row, :] = ddt + ddt_s, da, dd, dte
    dthrough = jnp.sum(jnp.sum(dout * state, axis=1, keepdims=True), axis=0, keepdims=True)
    dcs_scr[row, :] = dcs + jnp.where(last, dthrough * through[i:i + 1, :], 0.0)
    dh_scr[i] = dout * through[i:i + 1, :] + dh_in
    dcm, dcb, dbm = dcm + dc_i, dcb + dl, dbm + db_i
    # x's SiLU and conv backward (x reached the SSD in the compute dtype).
    dpre = (dx + dx_s).astype(cdt).astype(_F32) * dsilu(acc, sig)
    dxr, dw, dbias, dfront = _conv_bwd(dpre, nx_scr[i], cur, taps, lambda j: wx_ref[j, i], k, 1, row_mask,
                                       next_row)
    dx_ref[i] = dxr.astype(dx_ref.dtype)
    for j in range(k):
      dwx_ref[j, i] += dw[j]
    dbx_ref[i] += dbias
    nx_scr[i] = dpre

    @pl.when(ci == 0)
    def _():
      dfx_ref[i] = dfront

  # dt's: d a_k += sum_{t >= k} dcs[t] + sum_{s < k} d to_end[s] (masked matmuls at
  # HIGHEST, as ssd_tpu's), a = dt A, dt = clip(softplus(v)).
  da = (dar_scr[...]
        + jax.lax.dot(dcs_scr[...], upto.astype(_F32), precision=ssd_tpu._HIGHEST, preferred_element_type=_F32)
        + jax.lax.dot_general(dte_scr[...], after, _NT, precision=ssd_tpu._HIGHEST, preferred_element_type=_F32))
  da_ref[...] = da * dt  # A's, summed outside
  ddtr_ref[...] = jnp.where(passes, (ddt_scr[...] + da * A) * _sigmoid(v), 0.0)
  # C B^T is shared by the group's heads: its cotangent to C and B, then their SiLU and
  # conv backward. This head block's part only (the blocks' partials are summed outside;
  # everything after dB, dC is linear in them).
  dcb = dcb.astype(cdt)
  dcm = dcm + jax.lax.dot(dcb, bmat, preferred_element_type=_F32)
  dbm = dbm + jax.lax.dot_general(dcb, cmat, ssd_tpu._TN, preferred_element_type=_F32)

  def conv_bc_bwd(conv, dmat, w_ref, n_scr, dp_ref, dw_ref, dbias_ref, df_ref):
    acc, sig, cur, taps, _ = conv
    dpre = dmat * dsilu(acc, sig)
    din, dw, dbias, dfront = _conv_bwd(dpre, n_scr[...], cur, taps, lambda j: w_ref[j:j + 1, :], k, 0, col_mask,
                                       next_col)
    dp_ref[...] = din
    for j in range(k):
      dw_ref[j:j + 1, :] += dw[j]
    dbias_ref[...] += dbias
    n_scr[...] = dpre

    @pl.when(ci == 0)
    def _():
      df_ref[...] = dfront

  conv_bc_bwd(bconv, dbm, wb_ref, nb_scr, dbp_ref, dwb_ref, dbb_ref, dfb_ref)
  conv_bc_bwd(cconv, dcm, wc_ref, nc_scr, dcp_ref, dwc_ref, dbcb_ref, dfc_ref)
  if seq:
    ntr_scr[...] = tap_row[...]
    ntc_scr[...] = tap_col[...]

  @pl.when(zi == pl.num_programs(3) - 1)
  def _():
    dinit_ref[...] = dh_scr[...]

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


class _Dims(NamedTuple):
  b: int
  l: int
  i: int
  h: int
  g: int
  r: int
  p: int
  n: int
  k: int
  q: int
  c: int
  pad: int
  hb: int
  nblk: int


def _prep(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, initial_state, seq_idx):
  """The kernels' shapes and their operands in the kernels' layouts: x and z (c, b, g,
  r, p, q), positions on lanes; B, C (c, b, g, q, n); dt (c, b, g, r, q). XLA writes
  x and z so from in_proj's GEMMs (`mamba2._mixer_fused`)."""
  b, l, i = xr.shape
  h = dt_raw.shape[-1]
  g, k, q = ngroups, w["conv_x"].shape[0], chunk
  r, p, n = h // g, i // h, bc.shape[-1] // g
  pad = (-l) % q
  hb = ssd_tpu._head_block(r)
  d = _Dims(b, l, i, h, g, r, p, n, k, q, (l + pad) // q, pad, hb, r // hb)
  c, cdt = d.c, xr.dtype
  heads = lambda v: _chunks(v, q, pad, (b, c, q, g, r, p), (1, 0, 3, 4, 5, 2))
  bcc = _chunks(bc, q, pad, (b, c, q, 2, g, n), (3, 1, 0, 4, 2, 5))  # (2, c, b, g, q, n)
  wbc = w["conv_bc"].astype(_F32).reshape(k, 2, g, n).transpose(1, 2, 0, 3)  # (2, g, k, n)
  bbc = w["conv_bc_bias"].astype(_F32).reshape(2, g, 1, n)
  col = lambda v: v.astype(_F32).reshape(g, r, 1)
  D = w["D"] if w.get("D") is not None else jnp.zeros((h,), _F32)
  init = initial_state.astype(_F32).reshape(b, g, r, p, n)
  # The fronts placed at the end of a chunk of zeros: what the first chunk's taps read
  # as "the previous chunk" (read once per sequence and head block, 1/c of x).
  at_end = lambda f: jnp.pad(f.astype(cdt), [(0, 0), (q - (k - 1), 0)] + [(0, 0)] * (f.ndim - 2))
  fbc = at_end(front_bc).reshape(b, q, 2, g, n).transpose(2, 0, 3, 1, 4)  # (2, b, g, q, n)
  args = [heads(xr), heads(z), _chunks(dt_raw.astype(_F32), q, pad, (b, c, q, g, r), (1, 0, 3, 4, 2)),
          bcc[0], bcc[1], w["conv_x"].astype(_F32).reshape(k, g, r, p, 1),
          w["conv_x_bias"].astype(_F32).reshape(g, r, p, 1), wbc[0], bbc[0], wbc[1], bbc[1],
          col(w["dt_bias"]), col(-jnp.exp(w["A_log"].astype(_F32))), col(D), init,
          at_end(front_x).reshape(b, q, g, r, p).transpose(0, 2, 3, 4, 1), fbc[0], fbc[1]]
  if seq_idx is not None:
    sq, doc_in = chunk_documents(seq_idx.astype(jnp.int32), q)  # (c, b, s), (c, b)
    keep_in = (sq == doc_in[..., None]).astype(_F32)[:, :, None, :]
    end = (sq == sq[:, :, -1:]).astype(_F32)[:, :, None, :]
    taps = _chunks(_tap_masks(seq_idx.astype(jnp.int32), k), q, pad, (b, c, q, k - 1), (1, 0, 3, 2))
    args += [sq[:, :, None, :], sq[:, :, :, None], keep_in, end, taps, taps.transpose(0, 1, 3, 2)]
  return d, args


def _specs(d, chunk_of, seq):
  """The BlockSpecs of `_prep`'s operands on the grid (b, g, head blocks, steps);
  chunk_of(step) is the chunk a step takes (in order forward, reversed backward)."""
  hb, p, q, n, k = d.hb, d.p, d.q, d.n, d.k
  heads6 = lambda bi, gi, ri, zi: (chunk_of(zi), bi, gi, ri, 0, 0)
  head = lambda bi, gi, ri, zi: (chunk_of(zi), bi, gi, ri, 0)
  group = lambda bi, gi, ri, zi: (chunk_of(zi), bi, gi, 0, 0)
  state = lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0)
  per_head = lambda bi, gi, ri, zi: (gi, ri, 0)
  per_group = lambda bi, gi, ri, zi: (gi, 0, 0)
  front_bc = lambda bi, gi, ri, zi: (bi, gi, 0, 0)
  spec = pl.BlockSpec
  specs = [spec((None, None, None, hb, p, q), heads6), spec((None, None, None, hb, p, q), heads6),
           spec((None, None, None, hb, q), head),
           spec((None, None, None, q, n), group), spec((None, None, None, q, n), group),
           spec((k, None, hb, p, 1), lambda bi, gi, ri, zi: (0, gi, ri, 0, 0)),
           spec((None, hb, p, 1), lambda bi, gi, ri, zi: (gi, ri, 0, 0)),
           spec((None, k, n), per_group), spec((None, 1, n), per_group),
           spec((None, k, n), per_group), spec((None, 1, n), per_group),
           spec((None, hb, 1), per_head), spec((None, hb, 1), per_head), spec((None, hb, 1), per_head),
           spec((None, None, hb, p, n), state), spec((None, None, hb, p, q), state),
           spec((None, None, q, n), front_bc), spec((None, None, q, n), front_bc)]
  if seq:
    per_seq = lambda bi, gi, ri, zi: (chunk_of(zi), bi, 0, 0)
    specs += [spec((None, None, 1, q), per_seq), spec((None, None, q, 1), per_seq),
              spec((None, None, 1, q), per_seq), spec((None, None, 1, q), per_seq),
              spec((None, None, k - 1, q), per_seq), spec((None, None, q, k - 1), per_seq)]
  return specs


def _flops(d, per_head, per_block):
  return int(d.c * d.b * (d.h * per_head + d.g * d.nblk * per_block))


def _call(d, args, dt_limit, interpret, save=False):
  """The forward kernel: the gated y (c, b, g, r, p, q), the per-head sums of squares
  (c, b, g, r, q), the final state (b, g, r, p, n); with `save` the states entering
  each chunk (b, g, r, c, p, n) float32 as well (the backward kernel's residual)."""
  b, g, r, p, n, k, q, c, hb, nblk = d.b, d.g, d.r, d.p, d.n, d.k, d.q, d.c, d.hb, d.nblk
  xc, dtc, bc0, init, fx = args[0], args[2], args[3], args[14], args[15]
  seq = len(args) > 18
  cdt = xc.dtype
  isz = jnp.dtype(cdt).itemsize
  cost = pl.CostEstimate(
      # The one-pass SSD's count (ssd_tpu._one_pass_call) plus the prologue (the
      # conv's k taps, SiLU and softplus) and the epilogue (gate, squares).
      flops=_flops(d, 2 * q ** 3 + 4 * q * q + 2 * q * q * p + 4 * q * n * p + 2 * p * n + 14 * q * q + 10 * q * p
                   + (4 * k + 12) * q * p, 2 * q * q * n + 2 * (4 * k + 8) * q * n),
      transcendentals=int(c * b * d.h * (q * q + 2 * q + 3 * p * q) + c * b * g * nblk * 2 * q * n),
      # x, z read and the gated y written once; dt raw read, sums of squares written;
      # B and C once per head block; the states; the small weights per head block.
      bytes_accessed=int(3 * xc.size * isz + dtc.size * 4 * 2 + 2 * bc0.size * isz * nblk + 2 * init.size * 4
                         + fx.size * isz + 2 * b * g * q * n * isz * nblk
                         + (d.i * (k + 1) + 3 * d.h) * 4 * b + 2 * g * (k + 1) * n * 4 * b * nblk
                         + (c * b * q * 4 * (4 + 2 * (k - 1)) * g * nblk if seq else 0)
                         + (c * init.size * 4 if save else 0)))
  spec = pl.BlockSpec
  heads6 = lambda bi, gi, ri, zi: (zi, bi, gi, ri, 0, 0)
  out_shape = [jax.ShapeDtypeStruct(xc.shape, cdt), jax.ShapeDtypeStruct(dtc.shape, _F32),
               jax.ShapeDtypeStruct(init.shape, _F32)]
  out_specs = [spec((None, None, None, hb, p, q), heads6),
               spec((None, None, None, hb, q), lambda bi, gi, ri, zi: (zi, bi, gi, ri, 0)),
               spec((None, None, hb, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0))]
  if save:
    out_shape.append(jax.ShapeDtypeStruct((b, g, r, c, p, n), _F32))
    out_specs.append(spec((None, None, hb, None, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, zi, 0, 0)))
  scratch = [pltpu.VMEM((hb, p, n), _F32), pltpu.VMEM((hb, p, q), cdt), pltpu.VMEM((q, n), cdt),
             pltpu.VMEM((q, n), cdt)]
  kernel = functools.partial(_kernel, hb=hb, k=k, seq=seq, length=d.l, dt_limit=tuple(dt_limit), save=save)
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(b, g, nblk, c), in_specs=_specs(d, lambda zi: zi, seq),
      out_specs=tuple(out_specs), scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name="mixer_fused_save" if save else "mixer_fused")(*args)


def _bwd_call(d, args, states, dg, dssq, dfinal, dt_limit, interpret):
  """The backward kernel on the forward's grid, the chunks in reverse (see the module
  doc). Returns, in the kernels' layouts: dx, dz (as x), B's and C's raw gradients per
  head block (c, b, g, head blocks, q, n) float32, dt_raw's (c, b, g, r, q), the rows
  of d A (times A: A_log's) and d D to sum, the initial state's, the conv weights' and
  biases' per sequence (and head block for B, C), and the fronts' (at the end of a
  chunk-sized block)."""
  b, g, r, p, n, k, q, c, hb, nblk = d.b, d.g, d.r, d.p, d.n, d.k, d.q, d.c, d.hb, d.nblk
  xc, dtc, bc0, init = args[0], args[2], args[3], args[14]
  seq = len(args) > 18
  cdt = xc.dtype
  isz = jnp.dtype(cdt).itemsize
  rev = lambda zi: c - 1 - zi
  earlier = lambda zi: jnp.maximum(c - 2 - zi, 0)  # the previous chunk (the conv's reach back)
  spec = pl.BlockSpec
  common = _specs(d, rev, seq)
  in_specs = (common[:14] + [spec((None, None, hb, None, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, rev(zi), 0, 0))]
              + common[15:18]
              + [common[0], spec((None, None, None, 1, q), lambda bi, gi, ri, zi: (rev(zi), bi, gi, 0, 0)),
                 common[14], spec((None, None, None, hb, p, q), lambda bi, gi, ri, zi: (earlier(zi), bi, gi, ri, 0, 0)),
                 spec((None, None, None, q, n), lambda bi, gi, ri, zi: (earlier(zi), bi, gi, 0, 0)),
                 spec((None, None, None, q, n), lambda bi, gi, ri, zi: (earlier(zi), bi, gi, 0, 0))]
              + common[18:])
  ins = args[:14] + [states] + args[15:18] + [dg, dssq, dfinal, args[0], args[3], args[4]] + args[18:]
  f32 = lambda s: jax.ShapeDtypeStruct(s, _F32)
  part = (c, b, g, nblk, q, n)
  out_shape = [jax.ShapeDtypeStruct(xc.shape, cdt), jax.ShapeDtypeStruct(xc.shape, cdt), f32(part), f32(part),
               f32(dtc.shape), f32(dtc.shape), f32(dtc.shape), f32(init.shape), f32((b, k, g, r, p, 1)),
               f32((b, g, r, p, 1)), f32((b, g, nblk, k, n)), f32((b, g, nblk, 1, n)), f32((b, g, nblk, k, n)),
               f32((b, g, nblk, 1, n)), f32((b, g, r, p, q)), f32((b, g, nblk, q, n)), f32((b, g, nblk, q, n))]
  blk = lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0)
  partial = spec((None, None, None, None, q, n), lambda bi, gi, ri, zi: (rev(zi), bi, gi, ri, 0, 0))
  out_specs = [common[0], common[0], partial, partial, common[2], common[2], common[2], common[14],
               spec((None, k, None, hb, p, 1), lambda bi, gi, ri, zi: (bi, 0, gi, ri, 0, 0)),
               spec((None, None, hb, p, 1), blk), spec((None, None, None, k, n), blk),
               spec((None, None, None, 1, n), blk), spec((None, None, None, k, n), blk),
               spec((None, None, None, 1, n), blk), spec((None, None, hb, p, q), blk),
               spec((None, None, None, q, n), blk), spec((None, None, None, q, n), blk)]
  scratch = [pltpu.VMEM((hb, p, n), _F32), pltpu.VMEM((hb, p, q), _F32), pltpu.VMEM((q, n), _F32),
             pltpu.VMEM((q, n), _F32), pltpu.VMEM((k - 1, q), _F32), pltpu.VMEM((q, k - 1), _F32)]
  scratch += [pltpu.VMEM((hb, q), _F32)] * 4  # d dt, d a (segment sums'), d cs, d to_end rows
  rows = c * b * d.h * q * 4  # one (.., q) float32 row per head and chunk
  cost = pl.CostEstimate(
      # The SSD's backward (ssd_tpu._one_pass_bwd_call's count) and its forward's
      # outputs again (the gate needs y), the conv's forward and backward for x, B, C.
      flops=_flops(d, 4 * q ** 3 + 10 * p * q * n + 4 * p * q * q + 16 * q * q + 24 * p * q + 6 * p * n
                   + 2 * q * q * p + 2 * q * n * p + 14 * q * q + (12 * k + 30) * q * p,
                   6 * q * q * n + 8 * hb * q * q + 2 * 2 * (12 * k + 12) * q * n),
      transcendentals=int(c * b * d.h * (q * q + 3 * q + 3 * p * q) + c * b * g * nblk * 2 * q * n),
      # x, z, dg and the previous chunk's x read, dx and dz written; dt_raw read and
      # three rows written; B and C (and the previous chunk's) read per head block and
      # their float32 partials written; the entering states read.
      bytes_accessed=int(6 * xc.size * isz + 4 * rows + 4 * bc0.size * isz * nblk + 2 * bc0.size * 4 * nblk
                         + c * init.size * 4 + 2 * init.size * 4 + c * b * g * q * 4 * nblk
                         + (d.i * (k + 1) + 3 * d.h) * 4 * b * 2 + 2 * g * (k + 1) * n * 4 * b * nblk * 2
                         + (c * b * q * 4 * (4 + 2 * (k - 1)) * g * nblk if seq else 0)))
  kernel = functools.partial(_bwd_kernel, hb=hb, k=k, seq=seq, length=d.l, dt_limit=tuple(dt_limit))
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(b, g, nblk, c), in_specs=in_specs, out_specs=tuple(out_specs),
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name="mixer_fused_bwd")(*ins)


def _outputs(d, gated, ssq, final):
  """The forward kernel's outputs back to (b, l, ...): the gated y channels-minor
  (out_proj's operand), the squares per group, the final state (b, h, p, n)."""
  b, c, q, l = d.b, d.c, d.q, d.l
  gated = gated.transpose(1, 0, 5, 2, 3, 4).reshape(b, c * q, d.i)[:, :l]
  ssq = ssq.transpose(1, 0, 4, 2, 3).reshape(b, c * q, d.g, d.r).sum(-1)[:, :l]
  return gated, ssq, final.reshape(b, d.h, d.p, d.n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 12))
def _fused(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx, interpret):
  d, args = _prep(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, initial_state, seq_idx)
  return _outputs(d, *_call(d, args, dt_limit, interpret))


def _fused_fwd(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx,
               interpret):
  d, args = _prep(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, initial_state, seq_idx)
  gated, ssq, final, states = _call(d, args, dt_limit, interpret, save=True)
  return _outputs(d, gated, ssq, final), (z, xr, bc, dt_raw, w, front_x, front_bc, initial_state, seq_idx, states)


def _fused_bwd(chunk, ngroups, dt_limit, interpret, res, ct):
  z, xr, bc, dt_raw, w, front_x, front_bc, initial_state, seq_idx, states = res
  d, args = _prep(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, initial_state, seq_idx)
  b, l, c, q, g, r, k, n = d.b, d.l, d.c, d.q, d.g, d.r, d.k, d.n
  dgated, dssq, dfinal = ct
  dg = _chunks(dgated.astype(xr.dtype), q, d.pad, (b, c, q, g, r, d.p), (1, 0, 3, 4, 5, 2))
  dssq = _chunks(dssq.astype(_F32)[..., None], q, d.pad, (b, c, q, g, 1), (1, 0, 3, 4, 2))
  (dx, dz, dbp, dcp, ddtr, da, dd, dinit, dwx, dbx, dwb, dbb, dwc, dbcb, dfx, dfb, dfc) = _bwd_call(
      d, args, states, dg, dssq, dfinal.astype(_F32).reshape(b, g, r, d.p, n), dt_limit, interpret)
  back = lambda v: v.transpose(1, 0, 5, 2, 3, 4).reshape(b, c * q, d.i)[:, :l]
  dbc = jnp.stack([dbp.sum(3), dcp.sum(3)], 3)  # (c, b, g, 2, q, n)
  dbc = dbc.transpose(1, 0, 4, 3, 2, 5).reshape(b, c * q, 2, g * n)[:, :l]
  ddtr = ddtr.transpose(1, 0, 4, 2, 3).reshape(b, c * q, d.h)[:, :l]
  A = -jnp.exp(w["A_log"].astype(_F32))
  dw = dict(conv_x=dwx.sum(0).reshape(k, d.i), conv_x_bias=dbx.sum(0).reshape(d.i),
            conv_bc=jnp.stack([dwb.sum((0, 2)), dwc.sum((0, 2))], 1).transpose(2, 1, 0, 3).reshape(k, 2, g * n),
            conv_bc_bias=jnp.stack([dbb.sum((0, 2)), dbcb.sum((0, 2))]).reshape(2, g * n),
            dt_bias=ddtr.sum((0, 1)), A_log=da.sum((0, 1, 4)).reshape(d.h) * A,
            D=dd.sum((0, 1, 4)).reshape(d.h) if w.get("D") is not None else None)
  dw = {name: (None if dw[name] is None else dw[name].astype(v.dtype)) for name, v in w.items()}
  # The fronts' gradients sit at the end of their chunk-sized blocks.
  dfx = dfx[..., q - (k - 1):].transpose(0, 4, 1, 2, 3).reshape(b, k - 1, d.i)
  dfbc = jnp.stack([dfb.sum(2), dfc.sum(2)], 2)[:, :, :, q - (k - 1):]  # (b, g, 2, k-1, n)
  dfbc = dfbc.transpose(0, 3, 2, 1, 4).reshape(b, k - 1, 2, g * n)
  like = lambda v, ref: v.astype(ref.dtype)
  return (like(back(dz), z), like(back(dx), xr), like(dbc, bc), like(ddtr, dt_raw), dw, like(dfx, front_x),
          like(dfbc, front_bc), like(dinit.reshape(initial_state.shape), initial_state), None)


_fused.defvjp(_fused_fwd, _fused_bwd)

def mixer_core_tpu(z, xr, bc, dt_raw, w, chunk: int, *, ngroups: int, dt_limit=(0.0, float("inf")),
                   front_x=None, front_bc=None, initial_state=None, seq_idx=None, interpret: bool = False):
  """`layer_math.mixer_core` as one Pallas TPU kernel, forward and backward (see the module doc)."""
  b, h, k = xr.shape[0], dt_raw.shape[-1], w["conv_x"].shape[0]
  if initial_state is None:
    initial_state = jnp.zeros((b, h, xr.shape[-1] // h, bc.shape[-1] // ngroups), _F32)
  front_x = jnp.zeros((b, k - 1, xr.shape[-1]), _F32) if front_x is None else front_x
  front_bc = jnp.zeros((b, k - 1, *bc.shape[2:]), _F32) if front_bc is None else front_bc
  return _fused(z, xr, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, tuple(dt_limit), initial_state, seq_idx,
                interpret)
