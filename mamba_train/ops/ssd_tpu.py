"""The chunked SSD with each chunk's (t, s) terms kept on chip: Pallas kernels.

Same function, arguments and numerical rules as `ssd.ssd_chunked` (the reference,
and what CPUs run): float32 decays, segment sums as sums of the terms they cover,
matmuls in the dtype of x with float32 accumulation. Letters as in `ssd.py`.

The XLA form writes every chunk's (t, s) decay and score matrices to HBM and reads
them back. Here they live in VMEM only (the kernels follow Mosaic TPU's tiling
rules; they were never compiled for a GPU).

The forward (`ssd_fused`) is one kernel, `_one_pass_call`: its grid walks each head
block's chunks in order (the chunk axis innermost and sequential) and carries the
block's state, (hb, p, n) float32, in a VMEM scratch buffer from chunk to chunk. Per
chunk it computes the diagonal block, the entering state's output and the D skip,
writes y, then moves the state across the chunk (H <- exp(chunk's total decay) H +
the chunk's own end state, with the document resets of `ssd_chunked`'s scan form).
It reads x, dt, a, B, C and the initial state once and writes y and the final
state once: no per-chunk states in HBM.

The backward (the forward's `jax.custom_vjp`): under differentiation the
forward kernel (`ssd_one_pass_save`) also writes each chunk's entering state,
(b, g, r, c, p, n) float32, once (recomputing them would read x, dt, a and B
again and write the same states); the backward is one kernel,
`_one_pass_bwd_call`, on the forward's grid with the chunks innermost, sequential
and in reverse, carrying the cotangent of the state leaving the chunk, (hb, p, n)
float32, in VMEM from the final state's cotangent back to the initial state's. Per
chunk it recomputes the (t, s) terms, takes the gradients of the chunk's outputs
(given the saved entering state) and of the state leaving it (H_out = exp(total
decay) H_in + the chunk's own end state, the document masks as in the forward),
and passes the entering state's cotangent on. No per-chunk states go through
plain JAX. B and C are shared by a group's heads but the head blocks are not the
last grid axis, so each head block writes its own (q, n) float32 partial of their
gradients, summed outside (small: nblk partials of B's size).

x and y travel as (.., p, q) blocks: positions on the 128 lanes (a (q, p) block
would pad p = 64 to 128 lanes and double their bytes).

Each grid step takes one chunk, one sequence, one group and a block of `hb` heads,
so B and C (shared by a group's heads) are read once per head block; the cost
estimates count those re-reads.

Each kernel computes a chunk's (t, s) terms in VMEM from its inputs (the backward
recomputes them), under the forward's numerical rules: the gradient of a segment
sum is again a masked 0/1 matmul at HIGHEST, a sum of the terms it covers. The
kernels share their per-chunk math (`_chunk_terms`, `_decay`; in the backward
`_outputs_head_bwd`, `_states_head_bwd`).

`interpret=True` runs the kernels with Pallas' interpreter (any backend; the CPU
tests). This module imports nothing of the package but the plain form's layout
helpers (`ssd.to_chunks`, `ssd.chunk_documents`), so both read the same layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mamba_train.ops.ssd import chunk_documents, to_chunks

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # dot_general: a @ b.T
_TN = (((0,), (0,)), ((), ()))  # dot_general: a.T @ b


def _head_block(r: int) -> int:
  # A TPU block's second-to-last dim must be a multiple of 8 or the whole axis:
  # 8 heads a step where r allows (VMEM stays small at any width), else all r.
  return 8 if r % 8 == 0 else r


def _tri(q, strict: bool):
  """(q, q) masks from iotas (inside a kernel): row >= col, or row > col."""
  row = jax.lax.broadcasted_iota(jnp.int32, (q, q), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (q, q), 1)
  return (row > col) if strict else (row >= col), row == col


def _spec(shape, index_map):
  return pl.BlockSpec(shape, index_map)


# Per-chunk math shared by the kernels (inside a kernel; q the chunk length).


def _masks(q, seq, row_ref=None, col_ref=None):
  """A chunk's masks: after[k, s] = k > s (float32, the 0/1 matrix of the sums to
  the chunk end), upto[t, k] = k <= t (bool, the prefix sums), keep[t, s] = t >= s
  within one document."""
  after, _ = _tri(q, strict=True)
  upto, _ = _tri(q, strict=False)
  keep = upto
  if seq:
    keep = keep & (col_ref[...] == row_ref[...])  # (t, 1) == (1, s): one document
  return after.astype(_F32), upto, keep


def _prefix(a, upto):
  """cs[h, t] = sum_{k <= t} a[h, k] for a block's (hb, q) rows: one matmul at HIGHEST."""
  return jax.lax.dot(a, upto.T.astype(_F32), precision=_HIGHEST, preferred_element_type=_F32)


def _to_end(a, after):
  """to_end[h, s] = sum_{k > s} a[h, k] for a block's (hb, q) rows: one matmul at HIGHEST."""
  return jax.lax.dot(a, after, precision=_HIGHEST, preferred_element_type=_F32)


def _decay(a_row, upto, after, keep):
  """One head's L[t, s] = exp(sum_{s < k <= t} a_k) where keep, else 0: the segment
  sums as a masked 0/1 matmul at HIGHEST (sums of the terms covered, never differences)."""
  seg = jax.lax.dot(jnp.where(upto, a_row, 0.0), after, precision=_HIGHEST, preferred_element_type=_F32)
  return jnp.where(keep, jnp.exp(seg), 0.0)


def _chunk_terms(a_ref, b_ref, c_ref, row_ref=None, col_ref=None, in_ref=None, end_ref=None):
  """What a chunk's kernels share, for a block of hb heads: the masks (`_masks`),
  C B^T (t, s) float32, a (hb, q) float32, decay_in (hb, t) = exp(cs) (0 where t is
  outside the entering state's document), through (hb, 1) = its last column (the
  chunk's whole decay, 0 where the chunk ends outside that document) and w (hb, s)
  = exp(to_end) (0 where s is outside the chunk end's document)."""
  q = a_ref.shape[-1]
  after, upto, keep = _masks(q, row_ref is not None, row_ref, col_ref)
  cb = jax.lax.dot_general(c_ref[...], b_ref[...], _NT, preferred_element_type=_F32)  # (t, s)
  a = a_ref[...].astype(_F32)  # (hb, q)
  decay_in = jnp.exp(_prefix(a, upto))  # every head of the block in one matmul
  if in_ref is not None:
    decay_in = decay_in * in_ref[...]  # (1, t)
  w = jnp.exp(_to_end(a, after))
  if end_ref is not None:
    w = w * end_ref[...]  # (1, s)
  return after, upto, keep, cb, a, decay_in, decay_in[:, q - 1:q], w


def _outputs_head_bwd(dy, xf, dt_i, d_i, cb, lmat, state, cmat, decay_row, after, upto):
  """One head's gradients of y = (x dt) M^T + (H C^T) * decay_in + x D, M = (C B^T) * L.

  dy (p, t) and state (p, n) in the compute dtype; xf (p, s), dt_i, d_i, decay_row
  (1, q) float32. Returns dx (p, s), the rows (1, q) of d dt, d a (the segment sums'
  part), d D and d cs (the prefix sums', before their transpose), the entering
  state's cotangent (p, n), this head's part of dC (t, n) and dL * L (t, s), the
  cotangent of C B^T (summed over the group's heads by the caller)."""
  cdt = dy.dtype
  dyf = dy.astype(_F32)
  xdt = (xf * dt_i).astype(cdt)
  m = (cb * lmat).astype(cdt)
  dd = jnp.sum(dyf * xf, axis=0, keepdims=True)  # D skip: y += x D
  # Entering state: y += (H C^T) * decay_in.
  sc = jax.lax.dot_general(state, cmat, _NT, preferred_element_type=_F32)  # (p, t)
  dcs = jnp.sum(dyf * sc, axis=0, keepdims=True) * decay_row
  dsc = (dyf * decay_row).astype(cdt)  # (p, t)
  dh = jax.lax.dot(dsc, cmat, preferred_element_type=_F32)  # (p, n)
  dc = jax.lax.dot_general(dsc, state, _TN, preferred_element_type=_F32)  # (t, n)
  # Diagonal block: y += (x dt) M^T.
  dm = jax.lax.dot_general(dy, xdt, _TN, preferred_element_type=_F32)  # (t, s)
  dxdt = jax.lax.dot(dy, m, preferred_element_type=_F32)  # (p, s)
  dl = dm * lmat  # zero where the mask cuts
  # seg[t, s] = sum_{s < k <= t} a_k, so d a_k = sum_{t >= k} sum_{s < k} dseg[t, s]:
  # a masked matmul at HIGHEST, then a masked column sum (sums of the terms covered).
  per_k = jax.lax.dot_general(dl * cb, after, _NT, precision=_HIGHEST, preferred_element_type=_F32)
  da = jnp.sum(jnp.where(upto, per_k, 0.0), axis=0, keepdims=True)
  dx = dyf * d_i + dxdt * dt_i
  ddt = jnp.sum(dxdt * xf, axis=0, keepdims=True)
  return dx, ddt, da, dd, dcs, dh, dc, dl


def _states_head_bwd(dout, bmat, xf, dt_i, w_i):
  """One head's gradients of its chunk end state S = ((x dt) * w) B, given S's
  cotangent dout (p, n) in the compute dtype; w_i (1, s) = exp(to_end), document
  mask included. Returns dx (p, s), the rows (1, q) of d dt and d to_end (before
  its transpose to d a), and this head's part of dB (s, n)."""
  xdt = xf * dt_i
  dxw = jax.lax.dot_general(dout, bmat, _NT, preferred_element_type=_F32)  # (p, s)
  dx = dxw * dt_i * w_i
  ddt = jnp.sum(dxw * xf, axis=0, keepdims=True) * w_i
  # d to_end[s] (w carries the document mask, so masked positions get zero).
  dte = jnp.sum(dxw * xdt, axis=0, keepdims=True) * w_i
  db = jax.lax.dot_general((xdt * w_i).astype(dout.dtype), dout, _TN, preferred_element_type=_F32)
  return dx, ddt, dte, db


# ----------------------------------------------------------------------------
# One pass: outputs and the state passing in one kernel, the state carried on chip.


def _one_pass_kernel(*refs, hb, seq, save):
  n_in = 11 if seq else 7
  ins, outs = refs[:n_in], refs[n_in:]
  if seq:
    x_ref, dt_ref, a_ref, b_ref, c_ref, init_ref, d_ref, row_ref, col_ref, in_ref, end_ref = ins
  else:
    x_ref, dt_ref, a_ref, b_ref, c_ref, init_ref, d_ref = ins
    row_ref = col_ref = in_ref = end_ref = None
  if save:
    y_ref, final_ref, st_ref, h_scr = outs
  else:
    y_ref, final_ref, h_scr = outs
  zi = pl.program_id(3)

  # The chunk axis is innermost and sequential: h_scr holds the state entering
  # this chunk for the block's heads, (hb, p, n) float32, from chunk to chunk.
  @pl.when(zi == 0)
  def _():
    h_scr[...] = init_ref[...]

  if save:  # the entering states, the backward's residual (one float32 write)
    st_ref[...] = h_scr[...]

  cdt = x_ref.dtype
  # through: the entering state reaches the chunk end only if the chunk ends in its document.
  after, upto, keep, cb, a, decay_in, through, w = _chunk_terms(a_ref, b_ref, c_ref, row_ref, col_ref,
                                                                in_ref, end_ref)
  bmat, cmat = b_ref[...], c_ref[...]  # (q, n)
  for i in range(hb):
    m = (cb * _decay(a[i:i + 1, :], upto, after, keep)).astype(cdt)  # (t, s)
    xf = x_ref[i].astype(_F32)  # (p, s): positions on lanes
    xdt = xf * dt_ref[pl.ds(i, 1), :].astype(_F32)
    y = jax.lax.dot_general(xdt.astype(cdt), m, _NT, preferred_element_type=_F32)  # (p, t)
    state = h_scr[i]  # (p, n) float32: the state entering the chunk
    y = y + jax.lax.dot_general(state.astype(cdt), cmat, _NT, preferred_element_type=_F32) * decay_in[i:i + 1, :]
    y = y + xf * d_ref[pl.ds(i, 1), :].astype(_F32)
    y_ref[i] = y.astype(y_ref.dtype)
    # The chunk's own end state from its inputs, then the state leaving the chunk.
    own = jax.lax.dot((xdt * w[i:i + 1, :]).astype(cdt), bmat, preferred_element_type=_F32)  # (p, n)
    h_scr[i] = state * through[i:i + 1, :] + own

  @pl.when(zi == pl.num_programs(3) - 1)
  def _():
    final_ref[...] = h_scr[...]


def _one_pass_call(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, interpret, save=False):
  """(y, final state), and with `save` the states entering each chunk (b, g, r, c, p, n)."""
  c, b, g, r, p, q = xc.shape
  n = Bc.shape[-1]
  hb = _head_block(r)
  seq = row is not None
  nblk = r // hb
  # Chunks innermost and sequential ("arbitrary"): each head block walks its chunks
  # in order carrying the state; the other axes are independent ("parallel", so
  # a chip with two cores splits them).
  grid = (b, g, nblk, c)
  head = lambda bi, gi, ri, zi: (zi, bi, gi, ri, 0)
  group = lambda bi, gi, ri, zi: (zi, bi, gi, 0, 0)
  heads6 = lambda bi, gi, ri, zi: (zi, bi, gi, ri, 0, 0)
  state = lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0)
  in_specs = [_spec((None, None, None, hb, p, q), heads6),
              _spec((None, None, None, hb, q), head), _spec((None, None, None, hb, q), head),
              _spec((None, None, None, q, n), group), _spec((None, None, None, q, n), group),
              _spec((None, None, hb, p, n), state),
              _spec((None, hb, 1), lambda bi, gi, ri, zi: (gi, ri, 0))]
  args = [xc, dtc, ac, Bc, Cc, init, Dr[..., None]]
  if seq:
    per_seq = lambda bi, gi, ri, zi: (zi, bi, 0, 0)
    in_specs += [_spec((None, None, 1, q), per_seq), _spec((None, None, q, 1), per_seq),
                 _spec((None, None, 1, q), per_seq), _spec((None, None, 1, q), per_seq)]
    args += [row, col, keep_in, end]
  h = g * r
  isz = jnp.dtype(xc.dtype).itemsize
  bc_bytes = (Bc.size + Cc.size) * jnp.dtype(Bc.dtype).itemsize
  cost = pl.CostEstimate(
      # per group and head block: C B^T; per head: segment sums (t x k x s), two
      # prefix-sum matmuls, the diagonal block, the entering state's output, the
      # chunk's own end state, the carry and ~14 elementwise (t, s) ops.
      flops=int(c * b * (g * nblk * 2 * q * q * n
                         + h * (2 * q ** 3 + 4 * q * q + 2 * q * q * p + 4 * q * n * p + 2 * p * n
                                + 14 * q * q + 10 * q * p))),
      transcendentals=int(c * b * h * (q * q + 2 * q)),
      # x and y once, dt and a once, B and C once per head block, the initial and
      # final states once, D and the document masks per head block.
      bytes_accessed=int(2 * xc.size * isz + 2 * dtc.size * 4 + bc_bytes * nblk + 2 * init.size * 4
                         + Dr.size * 4 * b + (4 * c * b * q * 4 * g * nblk if seq else 0)
                         + (c * init.size * 4 if save else 0)))  # the entering states written
  out_shape = [jax.ShapeDtypeStruct(xc.shape, xc.dtype), jax.ShapeDtypeStruct(init.shape, _F32)]
  out_specs = [_spec((None, None, None, hb, p, q), heads6), _spec((None, None, hb, p, n), state)]
  if save:
    out_shape.append(jax.ShapeDtypeStruct((b, g, r, c, p, n), _F32))
    out_specs.append(_spec((None, None, hb, None, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, zi, 0, 0)))
  return pl.pallas_call(
      functools.partial(_one_pass_kernel, hb=hb, seq=seq, save=save),
      out_shape=tuple(out_shape), grid=grid, in_specs=in_specs, out_specs=tuple(out_specs),
      scratch_shapes=[pltpu.VMEM((hb, p, n), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name="ssd_one_pass_save" if save else "ssd_one_pass")(*args)


# The one-pass backward: the chunks in reverse, the state's cotangent carried on chip.


def _one_pass_bwd_kernel(*refs, hb, seq):
  n_in = 13 if seq else 9
  ins, outs = refs[:n_in], refs[n_in:]
  if seq:
    (x_ref, dt_ref, a_ref, b_ref, c_ref, h_ref, d_ref, dy_ref, dfin_ref,
     row_ref, col_ref, in_ref, end_ref) = ins
  else:
    x_ref, dt_ref, a_ref, b_ref, c_ref, h_ref, d_ref, dy_ref, dfin_ref = ins
    row_ref = col_ref = in_ref = end_ref = None
  (dx_ref, ddt_ref, da_ref, db_ref, dc_ref, dinit_ref, dd_ref, dh_scr, dcs_scr, dte_scr) = outs
  zi = pl.program_id(3)

  # Grid step zi is chunk c - 1 - zi: dh_scr holds the cotangent of the state
  # leaving this chunk, (hb, p, n) float32, starting from the final state's.
  @pl.when(zi == 0)
  def _():
    dh_scr[...] = dfin_ref[...]

  q = a_ref.shape[-1]
  cdt = x_ref.dtype
  # The forward kernel's terms, recomputed as it computes them.
  after, upto, keep, cb, a, decay_in, through, w = _chunk_terms(a_ref, b_ref, c_ref, row_ref, col_ref,
                                                                in_ref, end_ref)
  cmat, bmat = c_ref[...], b_ref[...]  # (q, n)
  last = jax.lax.broadcasted_iota(jnp.int32, (1, q), 1) == q - 1
  dcb = jnp.zeros((q, q), _F32)
  dc = jnp.zeros(dc_ref.shape, _F32)
  db = jnp.zeros(db_ref.shape, _F32)
  for i in range(hb):
    row = pl.ds(i, 1)
    xf, dt_i = x_ref[i].astype(_F32), dt_ref[row, :].astype(_F32)
    state, dout = h_ref[i], dh_scr[i]  # (p, n) float32: the entering state, the leaving one's cotangent
    # The chunk's outputs (diagonal block, entering state, D skip) ...
    dx, ddt, da, dd, dcs, dh_in, dc_i, dl = _outputs_head_bwd(
        dy_ref[i], xf, dt_i, d_ref[row, :].astype(_F32), cb,
        _decay(a[i:i + 1, :], upto, after, keep), state.astype(cdt), cmat, decay_in[i:i + 1, :],
        after, upto)
    # ... and the state leaving it, H_out = H_in * through + S (S the chunk's own end state).
    dx_s, ddt_s, dte, db_i = _states_head_bwd(dout.astype(cdt), bmat, xf, dt_i, w[i:i + 1, :])
    dx_ref[i] = (dx + dx_s).astype(dx_ref.dtype)
    ddt_ref[row, :], da_ref[row, :], dd_ref[row, :], dte_scr[row, :] = ddt + ddt_s, da, dd, dte
    # through = exp(cs[q - 1]): its cotangent joins cs's last column.
    dthrough = jnp.sum(jnp.sum(dout * state, axis=1, keepdims=True), axis=0, keepdims=True)
    dcs_scr[row, :] = dcs + jnp.where(last, dthrough * through[i:i + 1, :], 0.0)
    dh_scr[i] = dout * through[i:i + 1, :] + dh_in  # the entering state's cotangent
    dc = dc + dc_i
    dcb = dcb + dl
    db = db + db_i
  # d a_k += sum_{t >= k} dcs[t] (cs = prefix sums) + sum_{s < k} d to_end[s]: masked
  # matmuls at HIGHEST, sums of the terms covered.
  da_ref[...] += (jax.lax.dot(dcs_scr[...], upto.astype(_F32), precision=_HIGHEST, preferred_element_type=_F32)
                  + jax.lax.dot_general(dte_scr[...], after, _NT, precision=_HIGHEST,
                                        preferred_element_type=_F32))
  # C B^T is shared by the group's heads: its cotangent summed over the block's, then to C and B.
  dcb = dcb.astype(cdt)
  dc_ref[...] = dc + jax.lax.dot(dcb, bmat, preferred_element_type=_F32)
  db_ref[...] = db + jax.lax.dot_general(dcb, cmat, _TN, preferred_element_type=_F32)

  @pl.when(zi == pl.num_programs(3) - 1)
  def _():
    dinit_ref[...] = dh_scr[...]


def _one_pass_bwd_call(xc, dtc, ac, Bc, Cc, states, Dr, dy, dfinal, row, col, keep_in, end, interpret):
  """Gradients of the one-pass forward, from the states entering each chunk
  (b, g, r, c, p, n) float32 and the cotangents of y and the final state: x, dt, a,
  the per-head-block partial B and C gradients (c, b, g, head blocks, q, n) float32
  (summed outside), the initial state, and D as (c, b, g, r, q) rows to sum.

  The grid is the forward's, (b, g, head blocks, chunks), the chunks innermost,
  sequential and in reverse (index c - 1 - z), carrying the state's cotangent in
  VMEM. The head blocks are not last, so B's and C's gradients (shared by a group's
  heads) cannot be summed in an output block resident across them: each head block
  writes its own partial."""
  c, b, g, r, p, q = xc.shape
  n = Bc.shape[-1]
  hb = _head_block(r)
  nblk = r // hb
  seq = row is not None
  rev = lambda zi: c - 1 - zi
  heads6 = lambda bi, gi, ri, zi: (rev(zi), bi, gi, ri, 0, 0)
  head = lambda bi, gi, ri, zi: (rev(zi), bi, gi, ri, 0)
  group = lambda bi, gi, ri, zi: (rev(zi), bi, gi, 0, 0)
  state = lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0)
  in_specs = [_spec((None, None, None, hb, p, q), heads6),
              _spec((None, None, None, hb, q), head), _spec((None, None, None, hb, q), head),
              _spec((None, None, None, q, n), group), _spec((None, None, None, q, n), group),
              _spec((None, None, hb, None, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, rev(zi), 0, 0)),
              _spec((None, hb, 1), lambda bi, gi, ri, zi: (gi, ri, 0)),
              _spec((None, None, None, hb, p, q), heads6),
              _spec((None, None, hb, p, n), state)]
  args = [xc, dtc, ac, Bc, Cc, states, Dr[..., None], dy, dfinal]
  if seq:
    per_seq = lambda bi, gi, ri, zi: (rev(zi), bi, 0, 0)
    in_specs += [_spec((None, None, 1, q), per_seq), _spec((None, None, q, 1), per_seq),
                 _spec((None, None, 1, q), per_seq), _spec((None, None, 1, q), per_seq)]
    args += [row, col, keep_in, end]
  h = g * r
  isz = jnp.dtype(xc.dtype).itemsize
  rows = c * b * h * q * 4  # one (.., q) float32 row per head and chunk
  state_bytes = c * b * h * p * n * 4
  part = (c, b, g, nblk, q, n)
  cost = pl.CostEstimate(
      # The chunk outputs' backward (per group and head block: C B^T, dC and dB from
      # dCB, the prefix sums' transpose; per head: segment sums and their transpose,
      # H C^T, dH, dC, dM, d(x dt)), the chunk end state's backward (per head: d(xw)
      # and dB, ~10 (p, q) elementwise ops; per head block: to_end and its transpose),
      # the carry and its cotangent (~6 p x n per head).
      flops=int(c * b * (g * nblk * (6 * q * q * n + 8 * hb * q * q)
                         + h * (4 * q ** 3 + 10 * p * q * n + 4 * p * q * q + 16 * q * q + 24 * p * q
                                + 6 * p * n))),
      transcendentals=int(c * b * h * (q * q + 2 * q)),
      bytes_accessed=int(3 * xc.size * isz  # x and dy read, dx written
                         + 5 * rows  # dt, a read; ddt, da, dD rows written
                         + (Bc.size + Cc.size) * jnp.dtype(Bc.dtype).itemsize * nblk  # re-read per head block
                         + (Bc.size + Cc.size) * 4 * nblk  # dB, dC partials written per head block
                         + state_bytes  # the entering states read
                         + 2 * dfinal.size * 4  # the final state's cotangent read, the initial's written
                         + Dr.size * 4 * b + (4 * c * b * q * 4 * g * nblk if seq else 0)))
  f32 = lambda s: jax.ShapeDtypeStruct(s, _F32)
  out_shape = [jax.ShapeDtypeStruct(xc.shape, xc.dtype), f32(dtc.shape), f32(ac.shape),
               f32(part), f32(part), f32(dfinal.shape), f32(dtc.shape)]
  partial_spec = _spec((None, None, None, None, q, n), lambda bi, gi, ri, zi: (rev(zi), bi, gi, ri, 0, 0))
  out_specs = [_spec((None, None, None, hb, p, q), heads6), _spec((None, None, None, hb, q), head),
               _spec((None, None, None, hb, q), head), partial_spec, partial_spec,
               _spec((None, None, hb, p, n), state), _spec((None, None, None, hb, q), head)]
  return pl.pallas_call(
      functools.partial(_one_pass_bwd_kernel, hb=hb, seq=seq),
      out_shape=out_shape, grid=(b, g, nblk, c), in_specs=in_specs, out_specs=out_specs,
      # the carried cotangent; d cs and d to_end rows, for one matmul each per block
      scratch_shapes=[pltpu.VMEM((hb, p, n), _F32), pltpu.VMEM((hb, q), _F32), pltpu.VMEM((hb, q), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name="ssd_one_pass_bwd")(*args)


# ----------------------------------------------------------------------------
# The scan: the kernels' layouts, and the one-pass kernel with its VJP.


def _chunked(x, dt, A, B, C, q, D, initial_state, seq_idx):
  """The kernels' layouts: (xc, dtc, ac, Bc, Cc, init, Dr) and the document masks
  (row, col, keep_in, end), all None without seq_idx."""
  h, g = x.shape[2], B.shape[-2]
  # Chunk-major, head-major, as `ssd_chunked`: XLA fuses these transposes into the
  # producers (conv, silu) and the consumer (gated norm) of the SSD. x and y as
  # (.., p, q): positions on the lanes (128), where p = 64 would be padded.
  ins = to_chunks(x, dt, A, B, C, q, initial_state, positions_minor=True)
  Dr = (jnp.zeros((h,), _F32) if D is None else D.astype(_F32)).reshape(g, h // g)
  return (*ins, Dr), document_masks(seq_idx, q)


def document_masks(seq_idx, q: int):
  """The kernels' document masks (row (c, b, 1, s), col (c, b, q, 1), keep_in and end
  (c, b, 1, s) float32) from seq_idx (b, l) at chunk q; four Nones without it."""
  if seq_idx is None:
    return (None,) * 4
  sq, doc_in = chunk_documents(seq_idx.astype(jnp.int32), q)  # (c, b, s), (c, b)
  keep_in = (sq == doc_in[..., None]).astype(_F32)[:, :, None, :]  # (c, b, 1, t)
  end = (sq == sq[:, :, -1:]).astype(_F32)[:, :, None, :]  # (c, b, 1, s)
  return sq[:, :, None, :], sq[:, :, :, None], keep_in, end


# The one-pass kernel's VJP: the forward also writes the states entering each chunk
# (one float32 write, (b, g, r, c, p, n); recomputing them would read x, dt, a and B
# again and write them all the same); the backward is one kernel walking the chunks
# in reverse. Per-chunk states never go through a plain-JAX state passing.
@functools.partial(jax.custom_vjp, nondiff_argnums=(11,))
def _one_pass(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, interpret):
  return _one_pass_call(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, interpret)


# Names a remat policy can save (the model's 'save_in_proj_ssd' does): with y and the
# entering states kept, the backward pass need not run the forward kernel again.
SAVE_NAMES = ("ssd_pallas_y", "ssd_pallas_states")


def _one_pass_fwd(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, interpret):
  y, final, states = _one_pass_call(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, interpret,
                                    save=True)
  y, states = checkpoint_name(y, SAVE_NAMES[0]), checkpoint_name(states, SAVE_NAMES[1])
  return (y, final), (xc, dtc, ac, Bc, Cc, states, Dr, row, col, keep_in, end)


def _one_pass_bwd(interpret, res, ct):
  xc, dtc, ac, Bc, Cc, states, Dr, row, col, keep_in, end = res
  dy, dfinal = ct
  dx, ddt, da, dB, dC, dinit, dD = _one_pass_bwd_call(xc, dtc, ac, Bc, Cc, states, Dr, dy.astype(xc.dtype),
                                                      dfinal.astype(_F32), row, col, keep_in, end, interpret)
  return (dx, ddt, da, dB.sum(3).astype(Bc.dtype), dC.sum(3).astype(Cc.dtype), dinit,
          dD.sum((0, 1, 4)), None, None, None, None)


_one_pass.defvjp(_one_pass_fwd, _one_pass_bwd)


def one_pass(xc, dtc, ac, Bc, Cc, init, Dr, masks, interpret: bool = False):
  """The one-pass kernel (and its backward kernel under differentiation) on the chunked
  layout of `ssd.to_chunks(..., positions_minor=True)`: xc (c, b, g, r, p, q), the
  input scale dtc and the log decay ac (c, b, g, r, q) float32, separate (Mamba-3's
  scan scales its inputs by other weights than dt: `ssd3_tpu`), Bc, Cc (c, b, g, q,
  n), init (b, g, r, p, n) float32, Dr (g, r) float32, masks `document_masks`'.
  Returns y (c, b, g, r, p, q) in x's dtype and the final state (b, g, r, p, n)."""
  return _one_pass(xc, dtc, ac, Bc, Cc, init, Dr, *masks, interpret)


def ssd_fused(x, dt, A, B, C, chunk_size: int, *, D=None, initial_state=None, seq_idx=None,
              interpret: bool = False):
  """`ssd.ssd_chunked` with the per-chunk work in Pallas kernels (see the module doc).

  Same arguments and results; `interpret` runs the kernels in Pallas' interpreter.
  """
  b, l, h, p = x.shape
  g, n = B.shape[-2:]
  if h % g:
    raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
  q = chunk_size
  ins, masks = _chunked(x, dt, A, B, C, q, D, initial_state, seq_idx)
  y, final = _one_pass(*ins, *masks, interpret)
  y = y.transpose(1, 0, 5, 2, 3, 4).reshape(b, y.shape[0] * q, h, p)[:, :l]
  return y, final.reshape(b, h, p, n)
