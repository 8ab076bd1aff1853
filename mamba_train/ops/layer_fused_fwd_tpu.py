"""The fused Mamba-2 layer's forward kernel (`mixer_fused`, and `mixer_fused_save`,
which also writes the states entering each chunk for the backward kernel), and what
the forward and backward kernels share: the in-kernel conv, softplus and per-head SSD
helpers, the kernels' dims, their operands' layouts (`_prep`) and BlockSpecs.

The layer's design, its contract and what it supports: `layer_fused_tpu` (the entry,
`mixer_core_tpu`); the backward kernel: `layer_fused_bwd_tpu`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mamba_train.ops import ssd_tpu
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

def _dt(dtr_ref, dtb_ref, chunk, length, dt_limit):
  """dt = clip(softplus(dt_raw + dt_bias)), 0 on the padding to whole chunks: (hb, q)
  float32; with its argument v and the mask of where d dt / d v = sigmoid(v)."""
  q = dtr_ref.shape[-1]
  v = dtr_ref[...] + dtb_ref[...]
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, q), 1)
  inside = chunk * q + lane < length
  passes = inside
  dt = _softplus(v)
  lo, hi = dt_limit
  if lo > 0.0 or hi < float("inf"):
    passes = passes & (dt > lo) & (dt < hi)
    dt = jnp.clip(dt, lo, hi)
  return jnp.where(inside, dt, 0.0), v, passes


def _ssd_head(xf, dt_i, d_i, cb, lmat, state, cmat, decay_row, cdt):
  """One head's chunk output y (p, t) float32, as `ssd_tpu._one_pass_kernel`."""
  m = (cb * lmat).astype(cdt)
  y = jax.lax.dot_general((xf * dt_i).astype(cdt), m, _NT, preferred_element_type=_F32)
  y = y + jax.lax.dot_general(state.astype(cdt), cmat, _NT, preferred_element_type=_F32) * decay_row
  return y + xf * d_i


def _conv_silu_bc(raw_ref, prev_scr, w_ref, bias_ref, k, col_mask, cdt):
  """silu(conv) of B or C, (q, n), positions on sublanes, from raw inputs, in the
  compute dtype (as the SSD takes them); the raw block kept as the next chunk's
  previous one (the forward kernel's, and the backward kernel's first walk)."""
  acc, _ = _conv(raw_ref[...].astype(_F32), prev_scr[...].astype(_F32), lambda j: w_ref[j:j + 1, :],
                 bias_ref[...], k, 0, col_mask)
  prev_scr[...] = raw_ref[...]
  return _silu(acc).astype(cdt)


def _conv_silu_x(x_i, px_scr, i, wx_ref, bx_ref, k, row_mask, cdt):
  """x's conv + SiLU for head i, (p, q) with positions on lanes, as the SSD reads it
  (rounded to the compute dtype, in float32); the raw block kept (exact: x arrived in
  the compute dtype)."""
  acc, _ = _conv(x_i, px_scr[i].astype(_F32), lambda j: wx_ref[j, i], bx_ref[i], k, 1, row_mask)
  px_scr[i] = x_i.astype(cdt)
  return _silu(acc).astype(cdt).astype(_F32)


def _pass_state(h_scr, i, xf, dt_i, w_i, through_i, bmat, cdt):
  """Head i's state past the chunk (decayed through it, plus the chunk's inputs);
  returns the state entering it."""
  state = h_scr[i]
  own = jax.lax.dot((xf * dt_i * w_i).astype(cdt), bmat, preferred_element_type=_F32)
  h_scr[i] = state * through_i + own
  return state


def _masks(seq, tap_row, tap_col):
  """Tap s's document masks: along lanes (x, (1, q)) and sublanes (B, C, (q, 1))."""
  if not seq:
    return (lambda s: None), (lambda s: None)
  return (lambda s: tap_row[s - 1:s, :]), (lambda s: tap_col[:, s - 1:s])


def _heads_in(ref, hb):
  """A row-major (q, hb p) block of (b, l, i) (channels on lanes, as the GEMMs write
  it) as (hb, p, q) float32, positions on lanes, the orientation of the per-head math:
  one transpose on chip, where XLA would relay the whole tensor through HBM."""
  q, width = ref.shape
  return ref[...].astype(_F32).T.reshape(hb, width // hb, q)


def _heads_out(heads, dtype):
  """`_heads_in`'s inverse: the hb heads' (p, q) blocks as one (q, hb p) row-major block."""
  return jnp.concatenate(heads, axis=0).T.astype(dtype)


def _kernel(*refs, hb, k, seq, length, dt_limit, save, zero_start):
  base = 14 if zero_start else 18
  n_in = base + 6 if seq else base
  ins, outs = refs[:n_in], refs[n_in:]
  (x_ref, z_ref, dtr_ref, b_ref, c_ref, wx_ref, bx_ref, wb_ref, bb_ref, wc_ref, bcb_ref,
   dtb_ref, a_ref, d_ref) = ins[:14]
  init_ref, fx_ref, fb_ref, fc_ref = (None,) * 4 if zero_start else ins[14:18]
  # The SSD's document masks, then the conv taps' (tap s: position t - s in t's document).
  row_ref, col_ref, in_ref, end_ref, tap_row, tap_col = ins[base:] if seq else (None,) * 6
  g_ref, ssq_ref, final_ref = outs[:3]
  st_ref = outs[3] if save else None
  h_scr, px_scr, pb_scr, pc_scr = outs[3 + save:]
  zi = pl.program_id(3)
  cdt = x_ref.dtype
  row_mask, col_mask = _masks(seq, tap_row, tap_col)
  xs, zs = _heads_in(x_ref, hb), _heads_in(z_ref, hb)

  @pl.when(zi == 0)
  def _():
    # The entering state, and the conv's front (the inputs before position 0) as the
    # previous chunk's last positions; zeros made on chip where the caller gave none.
    for scr, ref in ((h_scr, init_ref), (px_scr, fx_ref), (pb_scr, fb_ref), (pc_scr, fc_ref)):
      scr[...] = jnp.zeros(scr.shape, scr.dtype) if zero_start else ref[...]

  if save:  # the entering states, the backward kernel's residual (one float32 write)
    st_ref[...] = h_scr[...]

  # B and C as the SSD takes them (the compute dtype), then the chunk's shared terms.
  bmat = _conv_silu_bc(b_ref, pb_scr, wb_ref, bb_ref, k, col_mask, cdt)
  cmat = _conv_silu_bc(c_ref, pc_scr, wc_ref, bcb_ref, k, col_mask, cdt)
  dt, _, _ = _dt(dtr_ref, dtb_ref, zi, length, dt_limit)
  a = dt * a_ref[...]
  after, upto, keep, cb, a, decay_in, through, w = ssd_tpu._chunk_terms(
      _Value(a), _Value(bmat), _Value(cmat), row_ref, col_ref, in_ref, end_ref)
  gates = []
  for i in range(hb):
    xf = _conv_silu_x(xs[i], px_scr, i, wx_ref, bx_ref, k, row_mask, cdt)  # the prologue
    # The one-pass SSD's chunk for head i (ssd_tpu._one_pass_kernel).
    dt_i = dt[i:i + 1, :]
    state = _pass_state(h_scr, i, xf, dt_i, w[i:i + 1, :], through[i:i + 1, :], bmat, cdt)
    y = _ssd_head(xf, dt_i, d_ref[pl.ds(i, 1), :], cb, ssd_tpu._decay(a[i:i + 1, :], upto, after, keep), state,
                  cmat, decay_in[i:i + 1, :], cdt)
    # Epilogue: the gate, and the sum of squares over this head's p channels.
    gated = y.astype(cdt).astype(_F32) * _silu(zs[i])
    gates.append(gated)
    ssq_ref[pl.ds(i, 1), :] = jnp.sum(gated * gated, axis=0, keepdims=True)
  g_ref[...] = _heads_out(gates, g_ref.dtype)

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
  zcol: int  # where z's and x's head blocks start in the joined z|x, in (hb p)-wide blocks
  xcol: int


def head_block(r: int) -> int:
  """Heads a program takes: 16 where a group's heads allow (B and C are read, and their
  gradients' float32 partials written, once per head block: half as often as with
  `ssd_tpu`'s 8), else `ssd_tpu._head_block`'s."""
  return 16 if r % 16 == 0 else ssd_tpu._head_block(r)


def _prep(zx, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, initial_state, seq_idx):
  """The kernels' shapes and their operands in the kernels' layouts: z|x as in_proj's
  GEMM writes it, (b, l, 2i) row-major (padded to whole chunks), passed twice and read
  in (q, hb p) blocks, z's from column 0 and x's from column i (`_rows`); B|C as its
  GEMM writes it, (b, 2, l, g n) (XLA lays in_proj_bc's (b, l, 2, g n) output out with
  the pair major to positions), passed twice and read in (q, n) blocks, B's from plane
  0 and C's from plane 1 (`_bc_rows`); dt (c, b, g, r, q)."""
  b, l, i2 = zx.shape
  i, h = i2 // 2, dt_raw.shape[-1]
  g, k, q = ngroups, w["conv_x"].shape[0], chunk
  r, p, n = h // g, i // h, bc.shape[-1] // g
  pad = (-l) % q
  hb = head_block(r)
  # i is g r p = (g nblk) (hb p): x's first block sits g nblk blocks in.
  d = _Dims(b, l, i, h, g, r, p, n, k, q, (l + pad) // q, pad, hb, r // hb, 0, g * (r // hb))
  c, cdt = d.c, zx.dtype
  heads = lambda v: jnp.pad(v, [(0, 0), (0, pad), (0, 0)]) if pad else v
  bcr = bc.transpose(0, 2, 1, 3)  # (b, 2, l, g n): a bitcast of the GEMM's output
  bcr = jnp.pad(bcr, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else bcr
  wbc = w["conv_bc"].astype(_F32).reshape(k, 2, g, n).transpose(1, 2, 0, 3)  # (2, g, k, n)
  bbc = w["conv_bc_bias"].astype(_F32).reshape(2, g, 1, n)
  col = lambda v: v.astype(_F32).reshape(g, r, 1)
  D = w["D"] if w.get("D") is not None else jnp.zeros((h,), _F32)
  init = initial_state.astype(_F32).reshape(b, g, r, p, n)
  # The fronts placed at the end of a chunk of zeros: what the first chunk's taps read
  # as "the previous chunk" (read once per sequence and head block, 1/c of x).
  at_end = lambda f: jnp.pad(f.astype(cdt), [(0, 0), (q - (k - 1), 0)] + [(0, 0)] * (f.ndim - 2))
  fbc = at_end(front_bc).reshape(b, q, 2, g, n).transpose(2, 0, 3, 1, 4)  # (2, b, g, q, n)
  args = [heads(zx), heads(zx), _chunks(dt_raw.astype(_F32), q, pad, (b, c, q, g, r), (1, 0, 3, 4, 2)),
          bcr, bcr, w["conv_x"].astype(_F32).reshape(k, g, r, p, 1),
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


def _rows(d, chunk_of, col=0):
  """The BlockSpec of an (l, i)-sized activation, row-major: a chunk's positions of a
  head block's channels, (q, hb p), the blocks starting `col` blocks in (x's in the
  joined z|x: i columns in, so Mosaic needs hb p a multiple of 128)."""
  return pl.BlockSpec((None, d.q, d.hb * d.p), lambda bi, gi, ri, zi: (bi, chunk_of(zi), col + gi * d.nblk + ri))


def _bc_rows(d, chunk_of, plane):
  """The BlockSpec of B (plane 0) or C (plane 1) read in place from B|C (b, 2, l, g n):
  a chunk's positions of the group's n state channels, (q, n). Mosaic needs n a
  multiple of 128 or the whole row (one group): `layer_fused_tpu.joins`."""
  return pl.BlockSpec((None, None, d.q, d.n), lambda bi, gi, ri, zi: (bi, plane, chunk_of(zi), gi))


def _specs(d, chunk_of, seq):
  """The BlockSpecs of `_prep`'s operands on the grid (b, g, head blocks, steps);
  chunk_of(step) is the chunk a step takes (in order forward, reversed backward)."""
  hb, p, q, n, k = d.hb, d.p, d.q, d.n, d.k
  head = lambda bi, gi, ri, zi: (chunk_of(zi), bi, gi, ri, 0)
  state = lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0)
  per_head = lambda bi, gi, ri, zi: (gi, ri, 0)
  per_group = lambda bi, gi, ri, zi: (gi, 0, 0)
  front_bc = lambda bi, gi, ri, zi: (bi, gi, 0, 0)
  spec = pl.BlockSpec
  specs = [_rows(d, chunk_of, d.xcol), _rows(d, chunk_of, d.zcol),
           spec((None, None, None, hb, q), head),
           _bc_rows(d, chunk_of, 0), _bc_rows(d, chunk_of, 1),
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


def _call(d, args, dt_limit, interpret, save=False, zero_start=False):
  """The forward kernel: the gated y (b, l, i) row-major, the per-head sums of squares
  (c, b, g, r, q), the final state (b, g, r, p, n); with `save` the states entering
  each chunk (b, g, r, c, p, n) float32 as well (the backward kernel's residual).
  zero_start: the initial state and the conv's fronts are zeros (the caller gave
  none), made in VMEM rather than read: `args`' four such operands are left out."""
  b, g, r, p, n, k, q, c, hb, nblk = d.b, d.g, d.r, d.p, d.n, d.k, d.q, d.c, d.hb, d.nblk
  zx, dtc, init, fx = args[0], args[2], args[14], args[15]
  bsize = b * c * q * g * n  # B's (or C's) elements, padded
  seq = len(args) > 18
  cdt = zx.dtype
  isz = jnp.dtype(cdt).itemsize
  # The entering state and the fronts, read once per sequence and head block.
  start_bytes = 0 if zero_start else init.size * 4 + fx.size * isz + 2 * b * g * q * n * isz * nblk
  rows = jax.ShapeDtypeStruct((b, c * q, d.i), cdt)  # an (l, i)-sized activation, padded
  cost = pl.CostEstimate(
      # The one-pass SSD's count (ssd_tpu._one_pass_call) plus the prologue (the
      # conv's k taps, SiLU and softplus) and the epilogue (gate, squares).
      flops=_flops(d, 2 * q ** 3 + 4 * q * q + 2 * q * q * p + 4 * q * n * p + 2 * p * n + 14 * q * q + 10 * q * p
                   + (4 * k + 12) * q * p, 2 * q * q * n + 2 * (4 * k + 8) * q * n),
      transcendentals=int(c * b * d.h * (q * q + 2 * q + 3 * p * q) + c * b * g * nblk * 2 * q * n),
      # x, z read and the gated y written once; dt raw read, sums of squares written;
      # B and C once per head block; the states; the small weights per head block.
      bytes_accessed=int(3 * rows.size * isz + dtc.size * 4 * 2 + 2 * bsize * isz * nblk + init.size * 4
                         + start_bytes
                         + (d.i * (k + 1) + 3 * d.h) * 4 * b + 2 * g * (k + 1) * n * 4 * b * nblk
                         + (c * b * q * 4 * (4 + 2 * (k - 1)) * g * nblk if seq else 0)
                         + (c * init.size * 4 if save else 0)))
  spec = pl.BlockSpec
  out_shape = [rows, jax.ShapeDtypeStruct(dtc.shape, _F32),
               jax.ShapeDtypeStruct(init.shape, _F32)]
  out_specs = [_rows(d, lambda zi: zi),
               spec((None, None, None, hb, q), lambda bi, gi, ri, zi: (zi, bi, gi, ri, 0)),
               spec((None, None, hb, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0))]
  if save:
    out_shape.append(jax.ShapeDtypeStruct((b, g, r, c, p, n), _F32))
    out_specs.append(spec((None, None, hb, None, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, zi, 0, 0)))
  scratch = [pltpu.VMEM((hb, p, n), _F32), pltpu.VMEM((hb, p, q), cdt), pltpu.VMEM((q, n), cdt),
             pltpu.VMEM((q, n), cdt)]
  kernel = functools.partial(_kernel, hb=hb, k=k, seq=seq, length=d.l, dt_limit=tuple(dt_limit), save=save,
                             zero_start=zero_start)
  in_specs = _specs(d, lambda zi: zi, seq)
  if zero_start:
    args, in_specs = args[:14] + args[18:], in_specs[:14] + in_specs[18:]
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(b, g, nblk, c), in_specs=in_specs,
      out_specs=tuple(out_specs), scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name="mixer_fused_save" if save else "mixer_fused")(*args)
