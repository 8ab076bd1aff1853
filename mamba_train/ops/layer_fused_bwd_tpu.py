"""The fused Mamba-2 layer's backward kernel (`mixer_fused_bwd`): a reverse walk over
each head block's chunks, recomputing the forward's chunk on chip and writing the
gradients of in_proj's outputs and the small parameter gradients; where the chunks'
entering states fit VMEM (`merged`), after a walk in order that passes them as the
forward kernel does, so none is written to HBM or read back. The design:
`layer_fused_tpu`'s module doc; the shared helpers and layouts: `layer_fused_fwd_tpu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mamba_train.ops import ssd_tpu
from mamba_train.ops.layer_fused_fwd_tpu import (
  _F32,
  _NT,
  _bc_rows,
  _conv,
  _conv_silu_bc,
  _conv_silu_x,
  _dt,
  _flops,
  _heads_in,
  _heads_out,
  _masks,
  _pass_state,
  _rows,
  _sigmoid,
  _specs,
  _ssd_head,
  _Value,
)
from mamba_train.ops.layer_math import dsilu


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


def _joined_writes(dzx_hbm, out_scr, sems, cols, zi, ci, q, bi):
  """dz's and dx's blocks into the joined (b, l, 2i) cotangent in HBM, as in_proj's
  GEMMs read it: one BlockSpec writes one block a step, and these are two, i columns
  apart, so the kernel copies them itself. Each step's two copies run while the next
  step computes (two slots, waited a step later; the chunk walk's last step waits its
  own). cols: the blocks' first columns (z's, x's); bi: the sequence. Returns (start,
  wait_previous, wait_own)."""
  width = out_scr.shape[-1]
  slot = zi % 2

  def copy(s, j, chunk):
    return pltpu.make_async_copy(out_scr.at[s, j], dzx_hbm.at[bi, pl.ds(chunk * q, q), pl.ds(cols[j], width)],
                                 sems.at[s, j])

  def start():
    for j in range(2):
      copy(slot, j, ci).start()

  def wait_previous():
    for j in range(2):
      copy(1 - slot, j, ci + 1).wait()

  def wait_own():
    for j in range(2):
      copy(slot, j, ci).wait()

  return start, wait_previous, wait_own


def _bwd_kernel(*refs, hb, k, seq, length, dt_limit, xcol, c, merged):
  n_in = 30 if seq else 24
  ins, outs = refs[:n_in], refs[n_in:]
  (x_ref, z_ref, dtr_ref, b_ref, c_ref, wx_ref, bx_ref, wb_ref, bb_ref, wc_ref, bcb_ref, dtb_ref, a_ref, d_ref,
   st_ref, fx_ref, fb_ref, fc_ref, dg_ref, dssq_ref, dfin_ref, xp_ref, bp_ref, cp_ref) = ins[:24]
  row_ref, col_ref, in_ref, end_ref, tap_row, tap_col = ins[24:] if seq else (None,) * 6
  outs, carried = (outs[:-5], outs[-5:]) if merged else (outs, None)
  # The grid's indices, read here: Pallas' interpreter reads none under a `pl.when`.
  step = pl.program_id(3)
  at = (pl.program_id(0), pl.program_id(1) * pl.num_programs(2) + pl.program_id(2))  # sequence, head block
  if not merged:  # the entering states were written by the forward kernel (st_ref)
    _bwd_step(ins, outs, step, at, lambda ci, i: st_ref[i], hb=hb, k=k, seq=seq,
              length=length, dt_limit=dt_limit, xcol=xcol, c=c)
    return
  hs_scr = carried[0]

  @pl.when(step < c)
  def _():  # the first c steps: the forward's state passing, each chunk's entering state kept in VMEM
    _states_step(ins, carried, step, hb=hb, k=k, seq=seq, length=length, dt_limit=dt_limit)

  @pl.when(step >= c)
  def _():  # then the backward's reverse walk, reading them there
    _bwd_step(ins, outs, step - c, at, lambda ci, i: hs_scr[ci, i], hb=hb, k=k, seq=seq, length=length,
              dt_limit=dt_limit, xcol=xcol, c=c)


def _states_step(ins, carried, ci, *, hb, k, seq, length, dt_limit):
  """The merged backward's first pass, chunk ci in order: the forward kernel's state
  passing (`layer_fused_fwd_tpu._kernel`'s conv, dt and state update, through the same
  helpers, so the states are the ones it would have saved), each
  chunk's entering state written to VMEM (hs_scr) rather than to HBM and back."""
  (x_ref, _, dtr_ref, b_ref, c_ref, wx_ref, bx_ref, wb_ref, bb_ref, wc_ref, bcb_ref, dtb_ref, a_ref, _,
   st_ref, fx_ref, fb_ref, fc_ref) = ins[:18]
  row_ref, col_ref, in_ref, end_ref, tap_row, tap_col = ins[24:] if seq else (None,) * 6
  hs_scr, h_scr, px_scr, pb_scr, pc_scr = carried
  cdt = x_ref.dtype
  row_mask, col_mask = _masks(seq, tap_row, tap_col)

  @pl.when(ci == 0)
  def _():  # the initial state and the conv's fronts (the previous chunk of the first)
    for scr, ref in ((h_scr, st_ref), (px_scr, fx_ref), (pb_scr, fb_ref), (pc_scr, fc_ref)):
      scr[...] = ref[...].astype(scr.dtype)

  bmat = _conv_silu_bc(b_ref, pb_scr, wb_ref, bb_ref, k, col_mask, cdt)
  cmat = _conv_silu_bc(c_ref, pc_scr, wc_ref, bcb_ref, k, col_mask, cdt)
  dt, _, _ = _dt(dtr_ref, dtb_ref, ci, length, dt_limit)
  a = dt * a_ref[...]
  *_, through, w = ssd_tpu._chunk_terms(_Value(a), _Value(bmat), _Value(cmat), row_ref, col_ref, in_ref, end_ref)
  xs = _heads_in(x_ref, hb)
  for i in range(hb):
    xf = _conv_silu_x(xs[i], px_scr, i, wx_ref, bx_ref, k, row_mask, cdt)
    hs_scr[ci, i] = _pass_state(h_scr, i, xf, dt[i:i + 1, :], w[i:i + 1, :], through[i:i + 1, :], bmat, cdt)


def _bwd_step(ins, outs, zi, at, state_at, *, hb, k, seq, length, dt_limit, xcol, c):
  """One step of the reverse walk (zi counts from 0 at the last chunk); at: the
  program's sequence and head block (among all groups'); state_at(ci, i): head i's
  state entering chunk ci."""
  (x_ref, z_ref, dtr_ref, b_ref, c_ref, wx_ref, bx_ref, wb_ref, bb_ref, wc_ref, bcb_ref, dtb_ref, a_ref, d_ref,
   _, fx_ref, fb_ref, fc_ref, dg_ref, dssq_ref, dfin_ref, xp_ref, bp_ref, cp_ref) = ins[:24]
  row_ref, col_ref, in_ref, end_ref, tap_row, tap_col = ins[24:] if seq else (None,) * 6
  (dzx_hbm, dbp_ref, dcp_ref, ddtr_ref, da_ref, dd_ref, dinit_ref, dwx_ref, dbx_ref, dwb_ref, dbb_ref,
   dwc_ref, dbcb_ref, dfx_ref, dfb_ref, dfc_ref,
   dh_scr, nx_scr, nb_scr, nc_scr, ntr_scr, ntc_scr, ddt_scr, dar_scr, dcs_scr, dte_scr, out_scr, sems) = outs
  ci = c - 1 - zi  # the chunk of this step: the walk is in reverse
  q = dtr_ref.shape[-1]
  # dz's and dx's blocks: this head block's columns of z and of x in the joined z|x.
  width = out_scr.shape[-1]
  zcol = at[1] * width
  start, wait_previous, wait_own = _joined_writes(dzx_hbm, out_scr, sems, (zcol, zcol + xcol * width), zi, ci, q,
                                                  at[0])

  @pl.when(zi > 0)
  def _():  # the previous step's copies, before their slot is written again
    wait_previous()
  cdt = x_ref.dtype
  row_mask, col_mask = _masks(seq, tap_row, tap_col)
  next_row, next_col = _masks(seq, ntr_scr, ntc_scr)
  # The (l, i)-sized operands arrive row-major, as the GEMMs write and read them.
  xs, zs, dgs, xps = (_heads_in(ref, hb) for ref in (x_ref, z_ref, dg_ref, xp_ref))

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
  dxs, dzs = [], []
  for i in range(hb):
    row = pl.ds(i, 1)
    cur = xs[i]
    acc, taps = _conv(cur, prev(fx_ref[i], xps[i]), lambda j: wx_ref[j, i], bx_ref[i], k, 1, row_mask)
    sig = _sigmoid(acc)
    xf = (acc * sig).astype(cdt).astype(_F32)
    dt_i, d_i = dt[i:i + 1, :], d_ref[row, :]
    lmat = ssd_tpu._decay(a[i:i + 1, :], upto, after, keep)
    state, dout = state_at(ci, i), dh_scr[i]  # the entering state, the leaving one's cotangent
    y = _ssd_head(xf, dt_i, d_i, cb, lmat, state, cmat, decay_in[i:i + 1, :], cdt)
    # The gate's backward: the gated y's cotangent plus its sum of squares' (2 gated dssq).
    yr = y.astype(cdt).astype(_F32)
    zf = zs[i]
    sz = _sigmoid(zf)
    dgated = dgs[i] + 2.0 * (yr * zf * sz) * dssq
    dzs.append(dgated * yr * dsilu(zf, sz))
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
    dxs.append(dxr)
    for j in range(k):
      dwx_ref[j, i] += dw[j]
    dbx_ref[i] += dbias
    nx_scr[i] = dpre

    @pl.when(ci == 0)
    def _():
      dfx_ref[i] = dfront

  slot = zi % 2
  out_scr[slot, 0] = _heads_out(dzs, out_scr.dtype)
  out_scr[slot, 1] = _heads_out(dxs, out_scr.dtype)
  start()
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

  @pl.when(zi == c - 1)
  def _():
    dinit_ref[...] = dh_scr[...]
    wait_own()


# The merged backward keeps every chunk's entering state of a head block in VMEM, (c,
# hb, p, n) float32: at most this much (8 MiB at TPU's chunk 128, 16 heads of 64 x 128
# and l 2048; 16 at l 4096); longer sequences take the states from the forward kernel
# through HBM (`mixer_fused_save`).
MERGED_STATES_VMEM = 16 * 1024 * 1024
# What the merged kernel asks of VMEM: the states, and the unmerged kernel's blocks and
# scratch (within Mosaic's 16 MiB default at the 16-head blocks) beside them.
_MERGED_VMEM_BASE = 24 * 1024 * 1024


def _states_vmem(d) -> int:
  """Bytes of a head block's entering states, every chunk's, float32 (the merged kernel's scratch)."""
  return d.c * d.hb * d.p * d.n * 4


def merged(d) -> bool:
  """Whether the backward kernel runs the forward's state passing itself (`_bwd_call`
  without states): every chunk's entering state of a head block fits VMEM."""
  return _states_vmem(d) <= MERGED_STATES_VMEM


def _bwd_call(d, args, states, dg, dssq, dfinal, dt_limit, interpret):
  """The backward kernel on the forward's grid, the chunks in reverse (see the module
  doc). states: the states entering each chunk (`mixer_fused_save`'s), or None where
  `merged(d)`: the kernel then walks each head block's chunks twice, in order to pass
  the states as the forward does, keeping them in VMEM, then in reverse. Returns, in
  the kernels' layouts: dz|dx joined as z|x, (b, l, 2i) row-major, B's and
  C's raw gradients per head block (b, head blocks, l, g n) float32, dt_raw's (c,
  b, g, r, q), the rows of d A (times A: A_log's) and d D to sum, the initial state's,
  the conv weights' and biases' per sequence (and head block for B, C), and the
  fronts' (at the end of a chunk-sized block)."""
  b, g, r, p, n, k, q, c, hb, nblk = d.b, d.g, d.r, d.p, d.n, d.k, d.q, d.c, d.hb, d.nblk
  zx, dtc, init = args[0], args[2], args[14]
  bsize = b * c * q * g * n  # B's (or C's) elements, padded
  seq = len(args) > 18
  fuse = states is None
  cdt = zx.dtype
  isz = jnp.dtype(cdt).itemsize
  xsize = b * c * q * d.i  # an (l, i)-sized activation's elements, padded
  if fuse:
    # Steps 0..c-1 pass the states over chunks 0..c-1, steps c..2c-1 walk c-1..0.
    # Operands only the reverse walk reads (late) stay on its first block during the
    # first pass, so the pipeline fetches them once; its per-chunk outputs likewise
    # (written back once the walk moves off them, after it has written them).
    both = lambda zi: jnp.where(zi < c, zi, 2 * c - 1 - zi)
    late = lambda zi: jnp.minimum(2 * c - 1 - zi, c - 1)
  else:
    both = late = lambda zi: c - 1 - zi
  earlier = lambda zi: jnp.maximum(late(zi) - 1, 0)  # the previous chunk (the conv's reach back)
  spec = pl.BlockSpec
  common, walk = _specs(d, both, seq), _specs(d, late, seq)
  state_spec = (common[14] if fuse else
                spec((None, None, hb, None, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, late(zi), 0, 0)))
  in_specs = (common[:1] + walk[1:2] + common[2:14] + [state_spec] + common[15:18]
              + [_rows(d, late), spec((None, None, None, 1, q), lambda bi, gi, ri, zi: (late(zi), bi, gi, 0, 0)),
                 common[14], _rows(d, earlier, d.xcol),
                 _bc_rows(d, earlier, 0), _bc_rows(d, earlier, 1)]
              + common[18:])
  ins = (args[:14] + [init if fuse else states] + args[15:18] + [dg, dssq, dfinal, args[0], args[3], args[4]]
         + args[18:])
  f32 = lambda s: jax.ShapeDtypeStruct(s, _F32)
  part = (b, nblk, c * q, g * n)  # B's (C's) gradient per head block, laid out as B|C's planes
  out_shape = [jax.ShapeDtypeStruct(zx.shape, cdt), f32(part), f32(part),
               f32(dtc.shape), f32(dtc.shape), f32(dtc.shape), f32(init.shape), f32((b, k, g, r, p, 1)),
               f32((b, g, r, p, 1)), f32((b, g, nblk, k, n)), f32((b, g, nblk, 1, n)), f32((b, g, nblk, k, n)),
               f32((b, g, nblk, 1, n)), f32((b, g, r, p, q)), f32((b, g, nblk, q, n)), f32((b, g, nblk, q, n))]
  blk = lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0)
  partial = spec((None, None, q, n), lambda bi, gi, ri, zi: (bi, ri, late(zi), gi))
  out_specs = [spec(memory_space=pl.ANY), partial, partial, walk[2], walk[2], walk[2], common[14],
               spec((None, k, None, hb, p, 1), lambda bi, gi, ri, zi: (bi, 0, gi, ri, 0, 0)),
               spec((None, None, hb, p, 1), blk), spec((None, None, None, k, n), blk),
               spec((None, None, None, 1, n), blk), spec((None, None, None, k, n), blk),
               spec((None, None, None, 1, n), blk), spec((None, None, hb, p, q), blk),
               spec((None, None, None, q, n), blk), spec((None, None, None, q, n), blk)]
  scratch = [pltpu.VMEM((hb, p, n), _F32), pltpu.VMEM((hb, p, q), _F32), pltpu.VMEM((q, n), _F32),
             pltpu.VMEM((q, n), _F32), pltpu.VMEM((k - 1, q), _F32), pltpu.VMEM((q, k - 1), _F32)]
  scratch += [pltpu.VMEM((hb, q), _F32)] * 4  # d dt, d a (segment sums'), d cs, d to_end rows
  scratch += [pltpu.VMEM((2, 2, q, hb * p), cdt), pltpu.SemaphoreType.DMA((2, 2))]  # dz, dx blocks in flight
  if fuse:  # the states entering each chunk; the state passed on, the previous raw x, B, C blocks
    scratch += [pltpu.VMEM((c, hb, p, n), _F32), pltpu.VMEM((hb, p, n), _F32), pltpu.VMEM((hb, p, q), cdt),
                pltpu.VMEM((q, n), cdt), pltpu.VMEM((q, n), cdt)]
  rows = c * b * d.h * q * 4  # one (.., q) float32 row per head and chunk
  cost = pl.CostEstimate(
      # The SSD's backward (ssd_tpu._one_pass_bwd_call's count) and its forward's
      # outputs again (the gate needs y), the conv's forward and backward for x, B, C;
      # merged, the forward's state passing too (the conv's, C B^T and the states').
      flops=_flops(d, 4 * q ** 3 + 10 * p * q * n + 4 * p * q * q + 16 * q * q + 24 * p * q + 6 * p * n
                   + 2 * q * q * p + 2 * q * n * p + 14 * q * q + (12 * k + 30) * q * p
                   + ((4 * k + 12) * q * p + 2 * q * n * p + 4 * q * q if fuse else 0),
                   6 * q * q * n + 8 * hb * q * q + 2 * 2 * (12 * k + 12) * q * n
                   + (2 * q * q * n + 2 * (4 * k + 8) * q * n if fuse else 0)),
      transcendentals=int(c * b * d.h * (q * q + 3 * q + 3 * p * q) + c * b * g * nblk * 2 * q * n
                          + (c * b * d.h * (2 * q + p * q) + c * b * g * nblk * 2 * q * n if fuse else 0)),
      # x, z, dg and the previous chunk's x read, dx and dz written; dt_raw read and
      # three rows written; B and C (and the previous chunk's) read per head block and
      # their float32 partials written; the entering states read (merged: x, B, C and
      # dt_raw read once more by the first pass, and the initial state).
      bytes_accessed=int(6 * xsize * isz + 4 * rows + 4 * bsize * isz * nblk + 2 * bsize * 4 * nblk
                         + (xsize * isz + rows + 2 * bsize * isz * nblk + init.size * 4 if fuse
                            else c * init.size * 4)
                         + 2 * init.size * 4 + c * b * g * q * 4 * nblk
                         + (d.i * (k + 1) + 3 * d.h) * 4 * b * 2 + 2 * g * (k + 1) * n * 4 * b * nblk * 2
                         + (c * b * q * 4 * (4 + 2 * (k - 1)) * g * nblk if seq else 0)))
  kernel = functools.partial(_bwd_kernel, hb=hb, k=k, seq=seq, length=d.l, dt_limit=tuple(dt_limit), xcol=d.xcol,
                             c=c, merged=fuse)
  params = dict(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
  if fuse:
    params["vmem_limit_bytes"] = _MERGED_VMEM_BASE + _states_vmem(d)
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(b, g, nblk, 2 * c if fuse else c), in_specs=in_specs,
      out_specs=tuple(out_specs), scratch_shapes=scratch, compiler_params=pltpu.CompilerParams(**params),
      cost_estimate=cost, interpret=interpret, name="mixer_fused_bwd")(*ins)
