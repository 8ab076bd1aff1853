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

The block decomposition as two kernels, with the state passing between them:

  `_chunk_states`: the initial state (slot 0) and each chunk's end state from its
      own inputs (the right low-rank factor), (b, g, r, c+1, p, n) float32; reads
      x, dt, a, B once.
  the state passing between chunks: plain JAX, one (c+1) x (c+1) masked matmul
      per head over those slots, as `ssd_chunked`'s parallel form;
  `_chunk_outputs`: the diagonal block, the entering state's output (the left
      factor) and the D skip, written once as y in the compute dtype; reads x, dt,
      a, B, C and the entering states once.

is what the backward differentiates (`one_pass=False` also runs it forward): the
one-pass kernel's VJP recomputes the chunk states with `_chunk_states` and the
passing, and takes the vjp of that composition, so it uses whatever backward those
two kernels have.

x and y travel as (.., p, q) blocks: positions on the 128 lanes (a (q, p) block
would pad p = 64 to 128 lanes and double their bytes).

Each grid step takes one chunk, one sequence, one group and a block of `hb` heads,
so B and C (shared by a group's heads) are read once per head block; the cost
estimates count those re-reads.

Backward of the two kernels: each is a `jax.custom_vjp` whose backward pass is a Pallas
kernel of its own (`ssd_chunk_states_bwd`, `ssd_chunk_outputs_bwd`) that
recomputes the chunk's (t, s) terms in VMEM from the same inputs and writes only
input-sized gradients, under the same numerical rules (the gradient of a segment
sum is again a masked 0/1 matmul at HIGHEST: a sum of the terms it covers). The
gradients of B and C, shared by a group's heads, are summed over the head blocks
in an output block that stays in VMEM along the last grid axis (sequential on
TPU), so they are written once per chunk and group. The plain-JAX forms of the
per-chunk functions (`_states_ref`, `_outputs_ref`) are what the tests hold the
kernels and their gradients against.

`interpret=True` runs the kernels with Pallas' interpreter (any backend; the CPU
tests). This module imports nothing from the package.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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


# ----------------------------------------------------------------------------
# Chunk end states from the chunk's own inputs.


def _states_kernel(*refs, hb, seq):
  if seq:
    x_ref, dt_ref, a_ref, b_ref, init_ref, end_ref, o_ref = refs
  else:
    x_ref, dt_ref, a_ref, b_ref, init_ref, o_ref = refs

  # Slot 0 of the output is the initial state (so the state passing is one matmul
  # over the slots, with no concatenated copy); slot z + 1 is chunk z's end state.
  @pl.when(pl.program_id(3) == 0)
  def _():
    o_ref[...] = init_ref[...]

  @pl.when(pl.program_id(3) > 0)
  def _():
    q = a_ref.shape[-1]
    cdt = x_ref.dtype
    after, _ = _tri(q, strict=True)  # after[k, s] = k > s
    a = a_ref[...].astype(_F32)  # (hb, q)
    # to_end[h, s] = sum_{k > s} a[h, k]: a sum of the terms it covers, on the MXU.
    to_end = jax.lax.dot(a, after.astype(_F32), precision=_HIGHEST, preferred_element_type=_F32)
    w = jnp.exp(to_end)
    if seq:
      w = w * end_ref[...]  # (1, q): 1 where s is in the chunk end's document
    bmat = b_ref[...]  # (q, n)
    for i in range(hb):
      xdt = x_ref[i].astype(_F32) * dt_ref[pl.ds(i, 1), :].astype(_F32)  # (p, s)
      xw = (xdt * w[i:i + 1, :]).astype(cdt)
      o_ref[i] = jax.lax.dot(xw, bmat, preferred_element_type=_F32).astype(o_ref.dtype)


def _states_ref(xc, dtc, ac, Bc, init, end):
  """Plain-JAX `_chunk_states`: xc (c, b, g, r, p, s); dtc, ac (c, b, g, r, s);
  Bc (c, b, g, s, n); init (b, g, r, p, n) float32; end (c, b, 1, s) float32 or None.
  Returns (b, g, r, c + 1, p, n): the initial state, then each chunk's end state."""
  cdt, q = xc.dtype, ac.shape[-1]
  after = jnp.tril(jnp.ones((q, q), _F32), -1)  # (k, s): k > s
  to_end = jnp.einsum("...k,ks->...s", ac, after, precision=_HIGHEST)
  w = jnp.exp(to_end)
  if end is not None:
    w = w * end[:, :, None]
  xw = (xc.astype(_F32) * dtc[..., None, :] * w[..., None, :]).astype(cdt)
  out = jnp.einsum("...grps,...gsn->...grpn", xw, Bc, preferred_element_type=_F32)
  return jnp.concatenate([init[:, :, :, None], jnp.moveaxis(out, 0, 3)], axis=3)


def _states_call(xc, dtc, ac, Bc, init, end, interpret):
  c, b, g, r, p, q = xc.shape
  n = Bc.shape[-1]
  hb = _head_block(r)
  seq = end is not None
  # Chunks innermost (slot z reads chunk z - 1): the initial state's block stays
  # put along them and is read once per head block.
  grid = (b, g, r // hb, c + 1)
  z = lambda zi: jnp.maximum(zi - 1, 0)
  head = lambda bi, gi, ri, zi: (z(zi), bi, gi, ri, 0)
  in_specs = [_spec((None, None, None, hb, p, q), lambda bi, gi, ri, zi: (z(zi), bi, gi, ri, 0, 0)),
              _spec((None, None, None, hb, q), head), _spec((None, None, None, hb, q), head),
              _spec((None, None, None, q, n), lambda bi, gi, ri, zi: (z(zi), bi, gi, 0, 0)),
              _spec((None, None, hb, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, 0, 0))]
  args = [xc, dtc, ac, Bc, init]
  if seq:
    in_specs.append(_spec((None, None, 1, q), lambda bi, gi, ri, zi: (z(zi), bi, 0, 0)))
    args.append(end)
  h = g * r
  isz = jnp.dtype(xc.dtype).itemsize
  cost = pl.CostEstimate(
      flops=int(c * b * (g * (r // hb) * 2 * hb * q * q + h * (2 * p * q * n + 4 * q * p))),
      transcendentals=int(c * b * h * q),
      bytes_accessed=int(xc.size * isz + 2 * dtc.size * 4
                         + Bc.size * jnp.dtype(Bc.dtype).itemsize * (r // hb)  # B re-read per head block
                         + (end.size * 4 * g * (r // hb) if seq else 0)
                         + init.size * 4 + (c + 1) * b * h * p * n * 4))
  return pl.pallas_call(
      functools.partial(_states_kernel, hb=hb, seq=seq),
      out_shape=jax.ShapeDtypeStruct((b, g, r, c + 1, p, n), _F32),
      grid=grid, in_specs=in_specs,
      # Chunks after the heads: the state passing's matmul then needs no transpose.
      out_specs=_spec((None, None, hb, None, p, n), lambda bi, gi, ri, zi: (bi, gi, ri, zi, 0, 0)),
      cost_estimate=cost, interpret=interpret, name="ssd_chunk_states")(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunk_states(xc, dtc, ac, Bc, init, end, interpret):
  return _states_call(xc, dtc, ac, Bc, init, end, interpret)


def _chunk_states_fwd(xc, dtc, ac, Bc, init, end, interpret):
  return _states_call(xc, dtc, ac, Bc, init, end, interpret), (xc, dtc, ac, Bc, init, end)


def _chunk_states_bwd(interpret, res, ct):
  xc, dtc, ac, Bc, _, end = res
  dx, ddt, da, dB = _states_bwd_call(xc, dtc, ac, Bc, ct, end, interpret)
  return dx, ddt, da, dB.astype(Bc.dtype), ct[:, :, :, 0], None


_chunk_states.defvjp(_chunk_states_fwd, _chunk_states_bwd)


# ----------------------------------------------------------------------------
# Outputs: diagonal block + entering state + D skip.


def _outputs_kernel(*refs, hb, seq):
  if seq:
    (x_ref, dt_ref, a_ref, b_ref, c_ref, h_ref, d_ref, row_ref, col_ref, in_ref, o_ref) = refs
  else:
    x_ref, dt_ref, a_ref, b_ref, c_ref, h_ref, d_ref, o_ref = refs
  q = a_ref.shape[-1]
  cdt = x_ref.dtype
  after, _ = _tri(q, strict=True)  # after[k, s] = k > s
  keep, _ = _tri(q, strict=False)  # keep[t, s] = t >= s
  upto_mask = keep  # upto[t, k] = a_k for k <= t
  after = after.astype(_F32)
  if seq:
    keep = keep & (col_ref[...] == row_ref[...])  # (t, 1) == (1, s): one document
  cmat = c_ref[...]  # (q, n)
  cb = jax.lax.dot_general(cmat, b_ref[...], _NT, preferred_element_type=_F32)  # (t, s)
  # cs[h, t] = sum_{k <= t} a[h, k], for every head of the block in one matmul.
  cs = jax.lax.dot(a_ref[...].astype(_F32), upto_mask.T.astype(_F32), precision=_HIGHEST,
                   preferred_element_type=_F32)
  decay_in = jnp.exp(cs)  # (hb, t)
  if seq:
    decay_in = decay_in * in_ref[...]  # (1, t): 1 where t is in the entering state's document
  for i in range(hb):
    a_row = a_ref[pl.ds(i, 1), :].astype(_F32)  # (1, q)
    upto = jnp.where(upto_mask, a_row, 0.0)  # (t, k)
    # seg[t, s] = sum_{s < k <= t} a_k: sums of the terms covered, never differences.
    seg = jax.lax.dot(upto, after, precision=_HIGHEST, preferred_element_type=_F32)
    m = (cb * jnp.where(keep, jnp.exp(seg), 0.0)).astype(cdt)  # (t, s)
    xf = x_ref[i].astype(_F32)  # (p, s): positions on lanes, no padding of p = 64
    xdt = (xf * dt_ref[pl.ds(i, 1), :].astype(_F32)).astype(cdt)
    y = jax.lax.dot_general(xdt, m, _NT, preferred_element_type=_F32)  # (p, t)
    state = h_ref[i].astype(cdt)  # (p, n)
    y = y + jax.lax.dot_general(state, cmat, _NT, preferred_element_type=_F32) * decay_in[i:i + 1, :]
    y = y + xf * d_ref[pl.ds(i, 1), :].astype(_F32)
    o_ref[i] = y.astype(o_ref.dtype)


def _outputs_ref(xc, dtc, ac, Bc, Cc, prev, Dr, row, col, keep_in):
  """Plain-JAX `_chunk_outputs` (same layouts; row (c, b, 1, s) and col (c, b, t, 1)
  int document ids, keep_in (c, b, 1, t) float32, or all three None)."""
  cdt, q = xc.dtype, ac.shape[-1]
  upto = ac[..., None, :] * jnp.tril(jnp.ones((q, q), _F32))  # (.., t, k)
  after = jnp.tril(jnp.ones((q, q), _F32), -1)  # (k, s): k > s
  seg = jnp.einsum("...tk,ks->...ts", upto, after, precision=_HIGHEST)
  cs = jnp.einsum("...k,tk->...t", ac, jnp.tril(jnp.ones((q, q), _F32)), precision=_HIGHEST)
  keep = jnp.tril(jnp.ones((q, q), bool))
  if row is not None:
    keep = keep & (col == row)[:, :, None, None]  # (c, b, 1, 1, t, s)
  cb = jnp.einsum("...gtn,...gsn->...gts", Cc, Bc, preferred_element_type=_F32)
  m = (cb[..., None, :, :] * jnp.where(keep, jnp.exp(seg), 0.0)).astype(cdt)
  xf = xc.astype(_F32)
  y = jnp.einsum("...grps,...grts->...grpt", (xf * dtc[..., None, :]).astype(cdt), m,
                 preferred_element_type=_F32)
  decay_in = jnp.exp(cs)
  if keep_in is not None:
    decay_in = decay_in * keep_in[:, :, None]
  prev = jnp.moveaxis(prev[:, :, :, :-1], 3, 0)  # (b, g, r, c+1, p, n) -> (c, b, g, r, p, n)
  y = y + jnp.einsum("...grpn,...gtn->...grpt", prev.astype(cdt), Cc,
                     preferred_element_type=_F32) * decay_in[..., None, :]
  return (y + xf * Dr[..., None, None]).astype(cdt)


def _outputs_call(xc, dtc, ac, Bc, Cc, prev, Dr, row, col, keep_in, interpret):
  c, b, g, r, p, q = xc.shape
  n = Bc.shape[-1]
  hb = _head_block(r)
  seq = row is not None
  nblk = r // hb
  grid = (c, b, g, nblk)
  head = lambda ci, bi, gi, ri: (ci, bi, gi, ri, 0)
  group = lambda ci, bi, gi, ri: (ci, bi, gi, 0, 0)
  heads6 = lambda ci, bi, gi, ri: (ci, bi, gi, ri, 0, 0)
  in_specs = [_spec((None, None, None, hb, p, q), heads6),
              _spec((None, None, None, hb, q), head), _spec((None, None, None, hb, q), head),
              _spec((None, None, None, q, n), group), _spec((None, None, None, q, n), group),
              _spec((None, None, hb, None, p, n), lambda ci, bi, gi, ri: (bi, gi, ri, ci, 0, 0)),
              _spec((None, hb, 1), lambda ci, bi, gi, ri: (gi, ri, 0))]
  args = [xc, dtc, ac, Bc, Cc, prev, Dr[..., None]]
  if seq:
    per_seq = lambda ci, bi, gi, ri: (ci, bi, 0, 0)
    in_specs += [_spec((None, None, 1, q), per_seq), _spec((None, None, q, 1), per_seq),
                 _spec((None, None, 1, q), per_seq)]
    args += [row, col, keep_in]
  h = g * r
  isz = jnp.dtype(xc.dtype).itemsize
  bc_bytes = (Bc.size + Cc.size) * jnp.dtype(Bc.dtype).itemsize
  cost = pl.CostEstimate(
      # per group and head block: C B^T; per head: segment sums (t x k x s), the
      # diagonal block, the entering state's output, prefix sums and ~12 elementwise (t, s) ops.
      flops=int(c * b * (g * nblk * 2 * q * q * n
                         + h * (2 * q ** 3 + 2 * q * q * p + 2 * q * n * p + 14 * q * q + 6 * q * p))),
      transcendentals=int(c * b * h * (q * q + q)),
      bytes_accessed=int(2 * xc.size * isz + 2 * dtc.size * 4 + bc_bytes * nblk + prev.size * 4 * c // (c + 1)
                         + Dr.size * 4 * c * b + (3 * c * b * q * 4 * g * nblk if seq else 0)))
  return pl.pallas_call(
      functools.partial(_outputs_kernel, hb=hb, seq=seq),
      out_shape=jax.ShapeDtypeStruct(xc.shape, xc.dtype),
      grid=grid, in_specs=in_specs, out_specs=_spec((None, None, None, hb, p, q), heads6),
      cost_estimate=cost, interpret=interpret, name="ssd_chunk_outputs")(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _chunk_outputs(xc, dtc, ac, Bc, Cc, prev, Dr, row, col, keep_in, interpret):
  return _outputs_call(xc, dtc, ac, Bc, Cc, prev, Dr, row, col, keep_in, interpret)


def _chunk_outputs_fwd(xc, dtc, ac, Bc, Cc, prev, Dr, row, col, keep_in, interpret):
  out = _outputs_call(xc, dtc, ac, Bc, Cc, prev, Dr, row, col, keep_in, interpret)
  return out, (xc, dtc, ac, Bc, Cc, prev, Dr, row, col, keep_in)


def _chunk_outputs_bwd(interpret, res, ct):
  xc, dtc, ac, Bc, Cc, prev, Dr, row, col, keep_in = res
  dx, ddt, da, dB, dC, dprev, dD = _outputs_bwd_call(xc, dtc, ac, Bc, Cc, prev, Dr, ct, row, col,
                                                     keep_in, interpret)
  # The last slot (the final state) enters no chunk's outputs.
  dprev = jnp.concatenate([dprev, jnp.zeros_like(dprev[:, :, :, :1])], axis=3)
  return (dx, ddt, da, dB.astype(Bc.dtype), dC.astype(Cc.dtype), dprev,
          dD.sum((0, 1, 4)), None, None, None)


_chunk_outputs.defvjp(_chunk_outputs_fwd, _chunk_outputs_bwd)


# ----------------------------------------------------------------------------
# Backward kernels: each recomputes its forward kernel's (t, s) terms in VMEM from
# the chunk inputs and writes only input-sized gradients. Grids (c, b, g, head
# blocks) with the head blocks last and sequential ("arbitrary" on TPU): the B and C
# gradients of a group are summed over its heads in an output block that stays in
# VMEM across the head blocks (one float32 write per chunk and group, not one per
# head block). Gradients of dt, a and D come out as (hb, q) rows (D's summed over
# positions outside), a's as the gradient of the per-position a = dt * A.


def _bwd_params():
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _states_bwd_kernel(*refs, hb, seq):
  if seq:
    x_ref, dt_ref, a_ref, b_ref, ds_ref, end_ref, dx_ref, ddt_ref, da_ref, db_ref = refs
  else:
    x_ref, dt_ref, a_ref, b_ref, ds_ref, dx_ref, ddt_ref, da_ref, db_ref = refs
  q = a_ref.shape[-1]
  cdt = x_ref.dtype

  @pl.when(pl.program_id(3) == 0)
  def _():
    db_ref[...] = jnp.zeros_like(db_ref)

  after, _ = _tri(q, strict=True)  # after[k, s] = k > s
  after = after.astype(_F32)
  a = a_ref[...].astype(_F32)  # (hb, q)
  w = jnp.exp(jax.lax.dot(a, after, precision=_HIGHEST, preferred_element_type=_F32))
  if seq:
    w = w * end_ref[...]
  bmat = b_ref[...]  # (q, n)
  db = jnp.zeros(db_ref.shape, _F32)
  for i in range(hb):
    xf = x_ref[i].astype(_F32)  # (p, s)
    dt_i, w_i = dt_ref[pl.ds(i, 1), :].astype(_F32), w[i:i + 1, :]
    xdt = xf * dt_i
    dout = ds_ref[i].astype(cdt)  # (p, n): this chunk's end state's cotangent
    dxw = jax.lax.dot_general(dout, bmat, _NT, preferred_element_type=_F32)  # (p, s)
    dx_ref[i] = (dxw * dt_i * w_i).astype(dx_ref.dtype)
    ddt_ref[pl.ds(i, 1), :] = jnp.sum(dxw * xf, axis=0, keepdims=True) * w_i
    # d to_end[s] (w carries the document mask, so masked positions get zero).
    da_ref[pl.ds(i, 1), :] = jnp.sum(dxw * xdt, axis=0, keepdims=True) * w_i
    xw = (xdt * w_i).astype(cdt)
    db = db + jax.lax.dot_general(xw, dout, _TN, preferred_element_type=_F32)  # (s, n)
  # to_end[s] = sum_{k > s} a_k, so d a_k = sum_{s < k} d to_end[s]: a masked
  # matmul at HIGHEST, sums of the terms covered.
  da_ref[...] = jax.lax.dot_general(da_ref[...], after, _NT, precision=_HIGHEST,
                                    preferred_element_type=_F32)
  db_ref[...] += db


def _states_bwd_call(xc, dtc, ac, Bc, dstates, end, interpret):
  """Gradients of `_chunk_states` for x, dt, a and B (B's in float32); the initial
  state's is slot 0 of `dstates` (taken outside)."""
  c, b, g, r, p, q = xc.shape
  n = Bc.shape[-1]
  hb = _head_block(r)
  nblk = r // hb
  seq = end is not None
  heads6 = lambda ci, bi, gi, ri: (ci, bi, gi, ri, 0, 0)
  head = lambda ci, bi, gi, ri: (ci, bi, gi, ri, 0)
  group = lambda ci, bi, gi, ri: (ci, bi, gi, 0, 0)
  in_specs = [_spec((None, None, None, hb, p, q), heads6),
              _spec((None, None, None, hb, q), head), _spec((None, None, None, hb, q), head),
              _spec((None, None, None, q, n), group),
              # chunk ci's end state is slot ci + 1 of the states' cotangent
              _spec((None, None, hb, None, p, n), lambda ci, bi, gi, ri: (bi, gi, ri, ci + 1, 0, 0))]
  args = [xc, dtc, ac, Bc, dstates]
  if seq:
    in_specs.append(_spec((None, None, 1, q), lambda ci, bi, gi, ri: (ci, bi, 0, 0)))
    args.append(end)
  h = g * r
  isz = jnp.dtype(xc.dtype).itemsize
  rows = c * b * h * q * 4  # one (.., q) float32 row per head and chunk
  cost = pl.CostEstimate(
      # per head: d(xw) = dS B^T and dB += xw^T dS, ~10 (p, q) elementwise ops;
      # per head block: the decay's sums forward and their transpose (two hb x q x q).
      flops=int(c * b * (h * (4 * p * q * n + 10 * p * q) + g * nblk * 4 * hb * q * q)),
      transcendentals=int(c * b * h * q),
      bytes_accessed=int(2 * xc.size * isz + 4 * rows  # x read, dx written; dt, a read; ddt, da written
                         + Bc.size * jnp.dtype(Bc.dtype).itemsize * nblk  # B re-read per head block
                         + c * b * h * p * n * 4  # the end states' cotangents (slot 0 is not read)
                         + Bc.size * 4  # dB written once per chunk and group
                         + (end.size * 4 * g * nblk if seq else 0)))
  out_shape = [jax.ShapeDtypeStruct(xc.shape, xc.dtype), jax.ShapeDtypeStruct(dtc.shape, _F32),
               jax.ShapeDtypeStruct(ac.shape, _F32), jax.ShapeDtypeStruct(Bc.shape, _F32)]
  out_specs = [_spec((None, None, None, hb, p, q), heads6), _spec((None, None, None, hb, q), head),
               _spec((None, None, None, hb, q), head), _spec((None, None, None, q, n), group)]
  return pl.pallas_call(
      functools.partial(_states_bwd_kernel, hb=hb, seq=seq),
      out_shape=out_shape, grid=(c, b, g, nblk), in_specs=in_specs, out_specs=out_specs,
      compiler_params=_bwd_params(), cost_estimate=cost, interpret=interpret,
      name="ssd_chunk_states_bwd")(*args)


def _outputs_bwd_kernel(*refs, hb, seq):
  if seq:
    (x_ref, dt_ref, a_ref, b_ref, c_ref, h_ref, d_ref, dy_ref, row_ref, col_ref, in_ref,
     dx_ref, ddt_ref, da_ref, db_ref, dc_ref, dh_ref, dd_ref, dcs_ref) = refs
  else:
    (x_ref, dt_ref, a_ref, b_ref, c_ref, h_ref, d_ref, dy_ref,
     dx_ref, ddt_ref, da_ref, db_ref, dc_ref, dh_ref, dd_ref, dcs_ref) = refs
  q = a_ref.shape[-1]
  cdt = x_ref.dtype

  @pl.when(pl.program_id(3) == 0)
  def _():
    db_ref[...] = jnp.zeros_like(db_ref)
    dc_ref[...] = jnp.zeros_like(dc_ref)

  # The forward kernel's terms, recomputed as it computes them.
  after, _ = _tri(q, strict=True)  # after[k, s] = k > s
  keep, _ = _tri(q, strict=False)  # keep[t, s] = t >= s
  upto_mask = keep
  after = after.astype(_F32)
  if seq:
    keep = keep & (col_ref[...] == row_ref[...])
  cmat, bmat = c_ref[...], b_ref[...]  # (q, n)
  cb = jax.lax.dot_general(cmat, bmat, _NT, preferred_element_type=_F32)  # (t, s)
  cs = jax.lax.dot(a_ref[...].astype(_F32), upto_mask.T.astype(_F32), precision=_HIGHEST,
                   preferred_element_type=_F32)
  decay_in = jnp.exp(cs)  # (hb, t)
  if seq:
    decay_in = decay_in * in_ref[...]
  dcb = jnp.zeros((q, q), _F32)
  dc = jnp.zeros(dc_ref.shape, _F32)
  for i in range(hb):
    a_row = a_ref[pl.ds(i, 1), :].astype(_F32)
    upto = jnp.where(upto_mask, a_row, 0.0)
    seg = jax.lax.dot(upto, after, precision=_HIGHEST, preferred_element_type=_F32)
    lmat = jnp.where(keep, jnp.exp(seg), 0.0)  # (t, s)
    m = (cb * lmat).astype(cdt)
    xf = x_ref[i].astype(_F32)  # (p, s)
    dt_i = dt_ref[pl.ds(i, 1), :].astype(_F32)
    xdt = (xf * dt_i).astype(cdt)
    dy = dy_ref[i]  # (p, t), dtype of x
    dyf = dy.astype(_F32)
    # D skip: y += x D.
    dd_ref[pl.ds(i, 1), :] = jnp.sum(dyf * xf, axis=0, keepdims=True)
    # Entering state: y += (H C^T) * decay_in.
    state = h_ref[i].astype(cdt)  # (p, n)
    sc = jax.lax.dot_general(state, cmat, _NT, preferred_element_type=_F32)  # (p, t)
    dcs_ref[pl.ds(i, 1), :] = jnp.sum(dyf * sc, axis=0, keepdims=True) * decay_in[i:i + 1, :]
    dsc = (dyf * decay_in[i:i + 1, :]).astype(cdt)  # (p, t)
    dh_ref[i] = jax.lax.dot(dsc, cmat, preferred_element_type=_F32)  # (p, n)
    dc = dc + jax.lax.dot_general(dsc, state, _TN, preferred_element_type=_F32)  # (t, n)
    # Diagonal block: y += (x dt) M^T with M = (C B^T) * L.
    dm = jax.lax.dot_general(dy, xdt, _TN, preferred_element_type=_F32)  # (t, s)
    dxdt = jax.lax.dot(dy, m, preferred_element_type=_F32)  # (p, s)
    dl = dm * lmat  # zero where the mask cuts
    dcb = dcb + dl
    # seg[t, s] = sum_{s < k <= t} a_k, so d a_k = sum_{t >= k} sum_{s < k} dseg[t, s]:
    # a masked matmul at HIGHEST, then a masked column sum (sums of the terms covered).
    dseg = dl * cb
    per_k = jax.lax.dot_general(dseg, after, _NT, precision=_HIGHEST, preferred_element_type=_F32)
    da_ref[pl.ds(i, 1), :] = jnp.sum(jnp.where(upto_mask, per_k, 0.0), axis=0, keepdims=True)
    dx_ref[i] = (dyf * d_ref[pl.ds(i, 1), :].astype(_F32) + dxdt * dt_i).astype(dx_ref.dtype)
    ddt_ref[pl.ds(i, 1), :] = jnp.sum(dxdt * xf, axis=0, keepdims=True)
  # cs[t] = sum_{k <= t} a_k, so d a_k += sum_{t >= k} dcs[t]: one masked matmul per block.
  da_ref[...] += jax.lax.dot(dcs_ref[...], upto_mask.astype(_F32), precision=_HIGHEST,
                             preferred_element_type=_F32)
  # C B^T is shared by the group's heads: its cotangent summed over them, then to C and B.
  dcb = dcb.astype(cdt)
  dc_ref[...] += dc + jax.lax.dot(dcb, bmat, preferred_element_type=_F32)
  db_ref[...] += jax.lax.dot_general(dcb, cmat, _TN, preferred_element_type=_F32)


def _outputs_bwd_call(xc, dtc, ac, Bc, Cc, prev, Dr, dy, row, col, keep_in, interpret):
  """Gradients of `_chunk_outputs` for x, dt, a, B, C (B's and C's in float32), the
  entering states (b, g, r, c, p, n) and D as (c, b, g, r, q) rows to sum."""
  c, b, g, r, p, q = xc.shape
  n = Bc.shape[-1]
  hb = _head_block(r)
  nblk = r // hb
  seq = row is not None
  heads6 = lambda ci, bi, gi, ri: (ci, bi, gi, ri, 0, 0)
  head = lambda ci, bi, gi, ri: (ci, bi, gi, ri, 0)
  group = lambda ci, bi, gi, ri: (ci, bi, gi, 0, 0)
  states = lambda ci, bi, gi, ri: (bi, gi, ri, ci, 0, 0)
  in_specs = [_spec((None, None, None, hb, p, q), heads6),
              _spec((None, None, None, hb, q), head), _spec((None, None, None, hb, q), head),
              _spec((None, None, None, q, n), group), _spec((None, None, None, q, n), group),
              _spec((None, None, hb, None, p, n), states),
              _spec((None, hb, 1), lambda ci, bi, gi, ri: (gi, ri, 0)),
              _spec((None, None, None, hb, p, q), heads6)]
  args = [xc, dtc, ac, Bc, Cc, prev, Dr[..., None], dy]
  if seq:
    per_seq = lambda ci, bi, gi, ri: (ci, bi, 0, 0)
    in_specs += [_spec((None, None, 1, q), per_seq), _spec((None, None, q, 1), per_seq),
                 _spec((None, None, 1, q), per_seq)]
    args += [row, col, keep_in]
  h = g * r
  isz = jnp.dtype(xc.dtype).itemsize
  rows = c * b * h * q * 4
  state_bytes = c * b * h * p * n * 4
  cost = pl.CostEstimate(
      # per group and head block: C B^T, dC += dCB B, dB += dCB^T C (three q x q x n),
      # the prefix sums and their transpose (two hb x q x q); per head: the segment sums
      # and their transpose (two q^3), H C^T, dH, dC (three p x q x n), dM and d(x dt)
      # (two p x q x q), ~16 (t, s) and ~14 (p, q) elementwise ops.
      flops=int(c * b * (g * nblk * (6 * q * q * n + 4 * hb * q * q)
                         + h * (4 * q ** 3 + 6 * p * q * n + 4 * p * q * q + 16 * q * q + 14 * p * q))),
      transcendentals=int(c * b * h * (q * q + q)),
      bytes_accessed=int(3 * xc.size * isz  # x and dy read, dx written
                         + 5 * rows  # dt, a read; ddt, da, dD rows written
                         + (Bc.size + Cc.size) * jnp.dtype(Bc.dtype).itemsize * nblk  # re-read per head block
                         + (Bc.size + Cc.size) * 4  # dB, dC written once per chunk and group
                         + 2 * state_bytes  # entering states read, their cotangents written
                         + Dr.size * 4 * c * b + (3 * c * b * q * 4 * g * nblk if seq else 0)))
  f32 = lambda s: jax.ShapeDtypeStruct(s, _F32)
  out_shape = [jax.ShapeDtypeStruct(xc.shape, xc.dtype), f32(dtc.shape), f32(ac.shape),
               f32(Bc.shape), f32(Cc.shape), f32((b, g, r, c, p, n)), f32(dtc.shape)]
  out_specs = [_spec((None, None, None, hb, p, q), heads6), _spec((None, None, None, hb, q), head),
               _spec((None, None, None, hb, q), head), _spec((None, None, None, q, n), group),
               _spec((None, None, None, q, n), group), _spec((None, None, hb, None, p, n), states),
               _spec((None, None, None, hb, q), head)]
  return pl.pallas_call(
      functools.partial(_outputs_bwd_kernel, hb=hb, seq=seq),
      out_shape=out_shape, grid=(c, b, g, nblk), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((hb, q), _F32)],  # d cs rows, for one matmul per block
      compiler_params=_bwd_params(), cost_estimate=cost, interpret=interpret,
      name="ssd_chunk_outputs_bwd")(*args)


# ----------------------------------------------------------------------------
# One pass: outputs and the state passing in one kernel, the state carried on chip.


def _one_pass_kernel(*refs, hb, seq):
  if seq:
    (x_ref, dt_ref, a_ref, b_ref, c_ref, init_ref, d_ref, row_ref, col_ref, in_ref, end_ref,
     y_ref, final_ref, h_scr) = refs
  else:
    x_ref, dt_ref, a_ref, b_ref, c_ref, init_ref, d_ref, y_ref, final_ref, h_scr = refs
  zi = pl.program_id(3)

  # The chunk axis is innermost and sequential: h_scr holds the state entering
  # this chunk for the block's heads, (hb, p, n) float32, from chunk to chunk.
  @pl.when(zi == 0)
  def _():
    h_scr[...] = init_ref[...]

  q = a_ref.shape[-1]
  cdt = x_ref.dtype
  after, _ = _tri(q, strict=True)  # after[k, s] = k > s
  keep, _ = _tri(q, strict=False)  # keep[t, s] = t >= s
  upto_mask = keep  # upto[t, k] = a_k for k <= t
  after = after.astype(_F32)
  if seq:
    keep = keep & (col_ref[...] == row_ref[...])  # (t, 1) == (1, s): one document
  bmat, cmat = b_ref[...], c_ref[...]  # (q, n)
  cb = jax.lax.dot_general(cmat, bmat, _NT, preferred_element_type=_F32)  # (t, s)
  a = a_ref[...].astype(_F32)  # (hb, q)
  # Sums of the terms they cover, on the MXU, for every head of the block at once:
  # cs[h, t] = sum_{k <= t} a[h, k] (its last column: the whole chunk's decay, which
  # the carried state takes), to_end[h, s] = sum_{k > s} a[h, k].
  cs = jax.lax.dot(a, upto_mask.T.astype(_F32), precision=_HIGHEST, preferred_element_type=_F32)
  to_end = jax.lax.dot(a, after, precision=_HIGHEST, preferred_element_type=_F32)
  decay_in = jnp.exp(cs)  # (hb, t)
  through = decay_in[:, q - 1:q]  # (hb, 1): exp(the chunk's total decay)
  w = jnp.exp(to_end)  # (hb, s)
  if seq:
    keep_in = in_ref[...]  # (1, t): 1 where t is in the entering state's document
    decay_in = decay_in * keep_in
    # The entering state reaches the chunk end only if the chunk ends in its document.
    through = through * keep_in[:, q - 1:q]
    w = w * end_ref[...]  # (1, s): 1 where s is in the chunk end's document
  for i in range(hb):
    a_row = a[i:i + 1, :]  # (1, q)
    upto = jnp.where(upto_mask, a_row, 0.0)  # (t, k)
    # seg[t, s] = sum_{s < k <= t} a_k: sums of the terms covered, never differences.
    seg = jax.lax.dot(upto, after, precision=_HIGHEST, preferred_element_type=_F32)
    m = (cb * jnp.where(keep, jnp.exp(seg), 0.0)).astype(cdt)  # (t, s)
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


def _one_pass_call(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, interpret):
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
                         + Dr.size * 4 * b + (4 * c * b * q * 4 * g * nblk if seq else 0)))
  return pl.pallas_call(
      functools.partial(_one_pass_kernel, hb=hb, seq=seq),
      out_shape=(jax.ShapeDtypeStruct(xc.shape, xc.dtype), jax.ShapeDtypeStruct(init.shape, _F32)),
      grid=grid, in_specs=in_specs,
      out_specs=(_spec((None, None, None, hb, p, q), heads6), _spec((None, None, hb, p, n), state)),
      scratch_shapes=[pltpu.VMEM((hb, p, n), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name="ssd_one_pass")(*args)


# ----------------------------------------------------------------------------
# The scan: layouts, the two-kernel form, and the one-pass form with its VJP.


def _pad_to_chunks(x, pad, value=0):
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _chunked(x, dt, A, B, C, q, D, initial_state, seq_idx):
  """The kernels' layouts: (xc, dtc, ac, Bc, Cc, init, Dr) and the document masks
  (row, col, keep_in, end, doc_end), all None without seq_idx."""
  b, l, h, p = x.shape
  g, n = B.shape[-2:]
  r, cdt = h // g, x.dtype
  pad = (-l) % q
  nc = (l + pad) // q
  # Chunk-major, head-major layouts, as `ssd_chunked`: XLA fuses these transposes
  # into the producers (conv, silu) and the consumer (gated norm) of the SSD.
  # x and y as (.., p, q): positions on the lanes (128), where p = 64 would be padded.
  xc = _pad_to_chunks(x, pad).reshape(b, nc, q, g, r, p).transpose(1, 0, 3, 4, 5, 2)
  dtc = _pad_to_chunks(dt.astype(_F32), pad).reshape(b, nc, q, g, r).transpose(1, 0, 3, 4, 2)
  ac = dtc * A.astype(_F32).reshape(g, r, 1)
  Bc = _pad_to_chunks(B, pad).reshape(b, nc, q, g, n).transpose(1, 0, 3, 2, 4).astype(cdt)
  Cc = _pad_to_chunks(C, pad).reshape(b, nc, q, g, n).transpose(1, 0, 3, 2, 4).astype(cdt)
  Dr = (jnp.zeros((h,), _F32) if D is None else D.astype(_F32)).reshape(g, r)
  init = (jnp.zeros((b, g, r, p, n), _F32) if initial_state is None
          else initial_state.astype(_F32).reshape(b, g, r, p, n))
  masks = (None,) * 5
  if seq_idx is not None:
    sq = _pad_to_chunks(seq_idx.astype(jnp.int32), pad, 0)
    if pad:  # padding joins the last document (it carries no input)
      sq = sq.at[:, l:].set(seq_idx[:, -1:].astype(jnp.int32))
    sq = sq.reshape(b, nc, q).transpose(1, 0, 2)  # (c, b, s)
    doc_in = jnp.concatenate([sq[:1, :, 0], sq[:-1, :, -1]], axis=0)  # (c, b)
    keep_in = (sq == doc_in[..., None]).astype(_F32)[:, :, None, :]  # (c, b, 1, t)
    end = (sq == sq[:, :, -1:]).astype(_F32)[:, :, None, :]  # (c, b, 1, s)
    doc_end = jnp.concatenate([doc_in[:1], sq[:, :, -1]], axis=0).T  # (b, c+1)
    masks = (sq[:, :, None, :], sq[:, :, :, None], keep_in, end, doc_end)
  return (xc, dtc, ac, Bc, Cc, init, Dr), masks


def _two_kernels(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, doc_end, interpret):
  """Chunk states kernel, plain-JAX state passing, outputs kernel: (yc, final)."""
  states = _chunk_states(xc, dtc, ac, Bc, init, end, interpret)  # (b, g, r, c+1, p, n)
  # State passing between chunks in plain JAX, as `ssd_chunked`'s parallel form:
  # H_z = sum_{z' <= z} exp(A_{z'+1..z}) S_{z'}, slot 0 the initial state and slot
  # z+1 chunk z's own end state, as one (c+1) x (c+1) masked product per head,
  # with the chunks after the heads so that the matmul reads the kernel's output
  # and the next kernel reads the matmul's as they lie.
  totals = jnp.moveaxis(ac.sum(-1), 0, -1)  # (b, g, r, c): each chunk's whole decay
  totals = jnp.concatenate([jnp.zeros_like(totals[..., :1]), totals], axis=-1)
  z = totals.shape[-1]
  upto = totals[..., None, :] * jnp.tril(jnp.ones((z, z), _F32))
  seg = jnp.einsum("...tk,ks->...ts", upto, jnp.tril(jnp.ones((z, z), _F32), -1), precision=_HIGHEST)
  keep = jnp.tril(jnp.ones((z, z), bool))
  if doc_end is not None:
    keep = keep & (doc_end[:, :, None] == doc_end[:, None, :])[:, None, None]
  chunk_decay = jnp.where(keep, jnp.exp(seg), 0.0)  # (b, g, r, z, z')
  states = jnp.einsum("bgrzy,bgrypn->bgrzpn", chunk_decay, states, precision=_HIGHEST)
  y = _chunk_outputs(xc, dtc, ac, Bc, Cc, states, Dr, row, col, keep_in, interpret)
  return y, states[:, :, :, -1]


# The one-pass kernel's VJP: forward by the one-pass kernel, saving only its inputs;
# backward as the vjp of the two-kernel form (the chunk states recomputed), so it
# takes whatever backward those kernels have.
@functools.partial(jax.custom_vjp, nondiff_argnums=(12,))
def _one_pass(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, doc_end, interpret):
  return _one_pass_call(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, interpret)


def _one_pass_fwd(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, doc_end, interpret):
  out = _one_pass_call(xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, interpret)
  return out, (xc, dtc, ac, Bc, Cc, init, Dr, row, col, keep_in, end, doc_end)


def _one_pass_bwd(interpret, res, ct):
  diff, masks = res[:7], res[7:]
  _, vjp = jax.vjp(lambda *a: _two_kernels(*a, *masks, interpret), *diff)
  return (*vjp(ct), *(None,) * len(masks))


_one_pass.defvjp(_one_pass_fwd, _one_pass_bwd)


def ssd_fused(x, dt, A, B, C, chunk_size: int, *, D=None, initial_state=None, seq_idx=None,
              interpret: bool = False, one_pass: bool = True):
  """`ssd.ssd_chunked` with the per-chunk work in Pallas kernels (see the module doc).

  Same arguments and results; `interpret` runs the kernels in Pallas' interpreter;
  `one_pass=False` runs the forward as the two kernels with the state passing
  between them in plain JAX (what the backward differentiates either way).
  """
  b, l, h, p = x.shape
  g, n = B.shape[-2:]
  if h % g:
    raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
  q = chunk_size
  nc = (l + (-l) % q) // q
  ins, masks = _chunked(x, dt, A, B, C, q, D, initial_state, seq_idx)
  fn = _one_pass if one_pass else _two_kernels
  y, final = fn(*ins, *masks, interpret)
  y = y.transpose(1, 0, 5, 2, 3, 4).reshape(b, nc * q, h, p)[:, :l]
  return y, final.reshape(b, h, p, n)
