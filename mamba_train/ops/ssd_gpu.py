"""The chunked SSD as Pallas kernels for NVIDIA GPUs (the Triton backend).

Same function, arguments and numerical rules as `ssd.ssd_chunked` (the reference)
and `ssd_tpu.ssd_fused` (the TPU kernels): float32 decays, segment sums as sums
of the terms they cover (a masked 0/1 matmul at HIGHEST, never differences of
running sums), matmuls in the dtype of x with float32 accumulation. Letters as in
`ssd.py`; t/s/k are positions inside a chunk.

Why Triton and not Mosaic GPU: the Triton backend lowers the same kernel for
Ampere and Hopper (wgmma on sm_90 comes from Triton's own pipeline) and its API is
the same in every jax this project supports, where Mosaic GPU's changes between
releases; Mosaic GPU reaches TMA and warp specialisation, which these kernels, one
head per program with its state in registers, do not need to be correct or
counted (docs/bench/gpu.md).

Triton programs run in no set order, so the TPU kernels' sequential grid axis
(the chunks, the state carried in VMEM) becomes a loop inside each program: the
grid is (b, h), one head of one sequence a program, and the program walks its
chunks with `fori_loop`, carrying the (p, n) float32 state in registers. The
forward reads x, dt, B, C and the initial state once and writes y and the final
state once; under differentiation it also writes the state entering each chunk
(b, h, c * p, n) float32, the backward's residual (the recurrence cannot be run
backwards without dividing by decays). The backward is one kernel on the same
grid walking the chunks in reverse, carrying the cotangent of the state leaving
the chunk. B and C are shared by a group's heads, which are different programs,
so their gradients are added into one (l, n) float32 block per sequence and group
with atomic adds (in L2: 1 MiB at l = 2048, n = 128; the order of the adds, and so
the last bits of dB and dC, vary from run to run on a GPU).

Triton's rules: every array a power of two in each dimension, dots at least 16 in
each (so p and n are padded with zeros to a power of two, at least 16: zero
columns of x, B and C add nothing), and the chunk a power of two: the kernels run
at the largest power of two up to `chunk_size` and `MAX_CHUNK` (64: the (t, s)
float32 tiles of the backward stay in registers), at least 16. The SSD's result
does not depend on the chunk (to rounding). The length is padded to whole chunks
with dt = 0 and x = 0 (decay 1, no input), as in `ssd.to_chunks`.

`interpret=True` runs the kernels in Pallas' interpreter on any backend (the CPU
tests). This module imports nothing of the package.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # dot_general: a @ b.T
_TN = (((0,), (0,)), ((), ()))  # dot_general: a.T @ b

MAX_CHUNK = 64
MIN_DIM = 16  # Triton's smallest dot dimension
# Warps per program: a (64, 64) float32 tile is 16 registers a thread at 8 warps;
# the backward holds about six of them plus two (p, n) states. Not autotuned (no
# device here): benchmarks/gpu.sh times the kernels on a lent GPU.
NUM_WARPS = 8


def _pow2_floor(v: int) -> int:
  return 1 << (max(v, 1).bit_length() - 1)


def _pow2_ceil(v: int) -> int:
  return 1 << max(v - 1, 0).bit_length()


def kernel_chunk(chunk_size: int) -> int:
  """The chunk the kernels run at for a requested `chunk_size` (module doc)."""
  return max(MIN_DIM, min(MAX_CHUNK, _pow2_floor(chunk_size)))


def _pad_axis(x, axis: int, size: int, mode: str = "constant"):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, mode=mode)


def _params():
  return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


# Per-chunk math shared by the kernels (inside a kernel; one head, one chunk).


def _masks(q):
  """upto[t, k] = k <= t (the prefix sums; also the causal mask t >= s) and after[k, s]
  = k > s (the sums to the chunk end), from iotas."""
  row = jax.lax.broadcasted_iota(jnp.int32, (q, q), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (q, q), 1)
  return col <= row, row > col


def _chunk_terms(a, upto, after, sq, doc_in):
  """A chunk's decays from its per-step log decays a (q,) float32.

  Returns L (t, s) = exp(sum_{s < k <= t} a_k) where t >= s in one document, else 0;
  decay_in (t,) = exp(sum_{k <= t} a_k), 0 outside the entering state's document;
  w (s,) = exp(sum_{k > s} a_k), 0 outside the chunk end's document; through (the
  chunk's whole decay, 0 if the entering state's document ends inside it); keep_in
  and end (the two document masks, None without documents)."""
  a_tk = jnp.where(upto, a[None, :], 0.0)  # (t, k): a_k for k <= t
  seg = jax.lax.dot(a_tk, after.astype(_F32), precision=_HIGHEST, preferred_element_type=_F32)
  keep = upto
  keep_in = end = None
  if sq is not None:
    keep = keep & (sq[:, None] == sq[None, :])
    last = jnp.max(sq)  # ids are nondecreasing: the chunk's last position's document
    keep_in = sq == doc_in
    end = sq == last
  lmat = jnp.where(keep, jnp.exp(seg), 0.0)
  decay_in = jnp.exp(jnp.sum(a_tk, axis=1))  # (t,): a sum of the terms covered
  w = jnp.exp(jnp.sum(jnp.where(after, a[:, None], 0.0), axis=0))  # (s,): sum over k > s
  through = jnp.exp(jnp.sum(a))
  if sq is not None:
    decay_in = jnp.where(keep_in, decay_in, 0.0)
    w = jnp.where(end, w, 0.0)
    through = jnp.where(last == doc_in, through, 0.0)
  return lmat, decay_in, w, through, keep_in, end


def _doc_in(sq, z, prev):
  """The document of the state entering chunk z: position 0's for the first chunk
  (ids are nondecreasing, so the chunk's smallest), else the previous chunk's last."""
  return jnp.where(z == 0, jnp.min(sq), prev)


def _bwd_doc_in(sq_ref, sq, z, q):
  """`_doc_in` in a reverse walk: the previous chunk's last id read from the ids."""
  prev = sq_ref[pl.ds(jnp.maximum(z * q - 1, 0), 1)]
  return jnp.where(z == 0, jnp.min(sq), jnp.max(prev))


def chunk_out(xf, dt, bmat, cmat, state, lmat, decay_in, cdt):
  """A chunk's output without the D skip (float32 (t, p)), x dt, and C B^T: the
  diagonal block (x dt) M^T, M = (C B^T) * L, plus (C H^T) * decay_in."""
  xdt = xf * dt[:, None]
  cb = jax.lax.dot_general(cmat, bmat, _NT, preferred_element_type=_F32)  # (t, s)
  y = jax.lax.dot((cb * lmat).astype(cdt), xdt.astype(cdt), preferred_element_type=_F32)  # (t, p)
  y += jax.lax.dot_general(cmat, state.astype(cdt), _NT, preferred_element_type=_F32) * decay_in[:, None]
  return y, xdt, cb


def chunk_bwd(xf, dt, dy, bmat, cmat, state, dstate, xdt, cb, terms, masks, cdt):
  """A chunk's backward from y's cotangent dy (t, p) (compute dtype) and the cotangent
  of the state leaving the chunk (float32 (p, n)). terms: `_chunk_terms`' (L, decay_in,
  w, through); masks: `_masks`' (upto, after). Returns d(x dt) (s, p), D's rows (t,),
  d a (k,), dB (s, n), dC (t, n) and the cotangent of the state entering the chunk."""
  lmat, decay_in, w, through = terms
  upto, after = masks
  dyf = dy.astype(_F32)
  sc_state = state.astype(cdt)
  m = (cb * lmat).astype(cdt)
  # y = (x dt) M^T + (C H^T) * decay_in + x D, M = (C B^T) * L.
  dd = jnp.sum(dyf * xf, axis=1)  # (t,)
  sc = jax.lax.dot_general(cmat, sc_state, _NT, preferred_element_type=_F32)  # (t, p)
  dcs = jnp.sum(dyf * sc, axis=1) * decay_in  # d of the prefix sums, (t,)
  dsc = (dyf * decay_in[:, None]).astype(cdt)
  dh_in = jax.lax.dot_general(dsc, cmat, _TN, preferred_element_type=_F32)  # (p, n)
  dc = jax.lax.dot(dsc, sc_state, preferred_element_type=_F32)  # (t, n)
  dm = jax.lax.dot_general(dy, xdt.astype(cdt), _NT, preferred_element_type=_F32)  # (t, s)
  dxdt = jax.lax.dot_general(m, dy, _TN, preferred_element_type=_F32)  # (s, p)
  dcb = (dm * lmat).astype(cdt)  # zero where the mask cuts
  dc += jax.lax.dot(dcb, bmat, preferred_element_type=_F32)
  db = jax.lax.dot_general(dcb, cmat, _TN, preferred_element_type=_F32)  # (s, n)
  # seg[t, s] = sum_{s < k <= t} a_k, so d a_k = sum_{t >= k} sum_{s < k} dseg[t, s]:
  # a masked matmul at HIGHEST, then a masked column sum (sums of the terms covered).
  dseg = dm * cb * lmat
  per_k = jax.lax.dot_general(dseg, after.astype(_F32), _NT, precision=_HIGHEST, preferred_element_type=_F32)
  da = jnp.sum(jnp.where(upto, per_k, 0.0), axis=0)  # (k,)
  # The state leaving the chunk: H_out = H_in * through + (x dt * w)^T B.
  dstate_c = dstate.astype(cdt)
  dxw = jax.lax.dot_general(bmat, dstate_c, _NT, preferred_element_type=_F32)  # (s, p)
  db += jax.lax.dot((xdt * w[:, None]).astype(cdt), dstate_c, preferred_element_type=_F32)
  dxdt += dxw * w[:, None]
  dte = jnp.sum(dxw * xdt, axis=1) * w  # d of the sums to the chunk end, (s,)
  dthrough = jnp.sum(dstate * state) * through
  # d a_k from the prefix sums (t >= k), the sums to the end (s < k) and the
  # chunk's whole decay (every k): masked sums of the terms covered.
  da += jnp.sum(jnp.where(upto, dcs[:, None], 0.0), axis=0)
  da += jnp.sum(jnp.where(after, dte[None, :], 0.0), axis=1)
  da += dthrough
  return dxdt, dd, da, db, dc, dstate * through + dh_in


# ----------------------------------------------------------------------------
# Forward: the state carried through the chunks in registers.


def _fwd_kernel(*refs, q, nc, seq, save):
  x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, h0_ref = refs[:7]
  rest = refs[7:]
  sq_ref = rest[0] if seq else None
  rest = rest[1:] if seq else rest
  y_ref, fin_ref = rest[:2]
  st_ref = rest[2] if save else None
  p = x_ref.shape[-1]
  cdt = x_ref.dtype
  upto, after = _masks(q)
  A = a_ref[...].astype(_F32)  # (1,)
  D = d_ref[...].astype(_F32)

  def body(z, carry):
    state, prev = carry  # (p, n) float32: the state entering chunk z; its document
    rows = pl.ds(z * q, q)
    sq = sq_ref[rows] if seq else None
    doc_in = _doc_in(sq, z, prev) if seq else prev
    if save:  # the entering states, the backward's residual
      st_ref[pl.ds(z * p, p), :] = state
    dt = dt_ref[rows].astype(_F32)  # (q,)
    lmat, decay_in, w, through, _, _ = _chunk_terms(dt * A, upto, after, sq, doc_in)
    xf = x_ref[rows, :].astype(_F32)  # (s, p)
    bmat, cmat = b_ref[rows, :], c_ref[rows, :]  # (q, n) in the compute dtype
    y, xdt, _ = chunk_out(xf, dt, bmat, cmat, state, lmat, decay_in, cdt)
    y += xf * D
    y_ref[rows, :] = y.astype(y_ref.dtype)
    # The chunk's own end state from its inputs, then the state leaving the chunk.
    own = jax.lax.dot_general((xdt * w[:, None]).astype(cdt), bmat, _TN, preferred_element_type=_F32)  # (p, n)
    new_prev = jnp.max(sq) if seq else prev
    return state * through + own, new_prev

  state, _ = jax.lax.fori_loop(0, nc, body, (h0_ref[...].astype(_F32), jnp.int32(0)))
  fin_ref[...] = state


def _specs(b, L, h, g, p, n):
  r = h // g
  head = pl.BlockSpec((None, L, None, p), lambda bi, hi: (bi, 0, hi, 0))  # x, y, dy, dx: (L, p)
  rows = pl.BlockSpec((None, L, None), lambda bi, hi: (bi, 0, hi))  # dt and per-position rows: (L,)
  scalar = pl.BlockSpec((1,), lambda bi, hi: (hi,))  # A, D
  group = pl.BlockSpec((None, L, None, n), lambda bi, hi: (bi, 0, hi // r, 0))  # B, C: (L, n)
  state = pl.BlockSpec((None, None, p, n), lambda bi, hi: (bi, hi, 0, 0))  # (p, n)
  seq = pl.BlockSpec((None, L), lambda bi, hi: (bi, 0))
  return head, rows, scalar, group, state, seq


def _fwd_call(x, dt, A, B, C, D, h0, sq, q, interpret, save=False):
  b, L, h, p = x.shape
  g, n = B.shape[-2:]
  nc = L // q
  head, rows, scalar, group, state, seq_spec = _specs(b, L, h, g, p, n)
  in_specs = [head, rows, scalar, group, group, scalar, state]
  args = [x, dt, A, B, C, D, h0]
  if sq is not None:
    in_specs.append(seq_spec)
    args.append(sq)
  isz = jnp.dtype(x.dtype).itemsize
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((b, h, p, n), _F32)]
  out_specs = [head, state]
  if save:
    out_shape.append(jax.ShapeDtypeStruct((b, h, nc * p, n), _F32))
    out_specs.append(pl.BlockSpec((None, None, nc * p, n), lambda bi, hi: (bi, hi, 0, 0)))
  cost = pl.CostEstimate(
      # per head and chunk: C B^T, the segment sums (t x k x s at HIGHEST), the
      # diagonal block, the entering state's output, the chunk's own end state,
      # the carry and ~16 elementwise (t, s) and ~8 (q, p) ops.
      flops=int(b * h * nc * (2 * q * q * n + 2 * q ** 3 + 2 * q * q * p + 4 * q * n * p
                              + 3 * p * n + 16 * q * q + 8 * q * p)),
      transcendentals=int(b * h * nc * (q * q + 2 * q + 1)),
      # x read and y written once, dt once; B and C once per sequence and group:
      # a group's heads are adjacent programs (the head axis is the grid's last),
      # which read the same (l, n) rows at about the same time, from L2. The
      # initial and final states once; the document ids once per head.
      bytes_accessed=int(2 * x.size * isz + dt.size * 4 + 2 * B.size * isz + 2 * h0.size * 4
                         + (b * L * h * 4 if sq is not None else 0)
                         + (b * h * nc * p * n * 4 if save else 0)))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, q=q, nc=nc, seq=sq is not None, save=save),
      out_shape=tuple(out_shape), grid=(b, h), in_specs=in_specs, out_specs=tuple(out_specs),
      compiler_params=_params(), cost_estimate=cost, interpret=interpret,
      name="ssd_gpu_fwd_save" if save else "ssd_gpu_fwd")(*args)


# ----------------------------------------------------------------------------
# Backward: the chunks in reverse, the state's cotangent carried in registers.


def _bwd_kernel(*refs, q, nc, seq):
  x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, st_ref, dy_ref, dfin_ref = refs[:9]
  rest = refs[9:]
  sq_ref = rest[0] if seq else None
  rest = rest[1:] if seq else rest
  rest = rest[2:]  # the zero-filled dB and dC inputs, aliased to their outputs
  dx_ref, ddt_ref, da_ref, dd_ref, db_ref, dc_ref, dinit_ref = rest
  p = x_ref.shape[-1]
  cdt = x_ref.dtype
  masks = _masks(q)
  A = a_ref[...].astype(_F32)
  D = d_ref[...].astype(_F32)

  def body(i, dstate):
    z = nc - 1 - i
    rows = pl.ds(z * q, q)
    sq = sq_ref[rows] if seq else None
    doc_in = _bwd_doc_in(sq_ref, sq, z, q) if seq else 0
    dt = dt_ref[rows].astype(_F32)
    lmat, decay_in, w, through, _, _ = _chunk_terms(dt * A, *masks, sq, doc_in)
    xf = x_ref[rows, :].astype(_F32)
    bmat, cmat = b_ref[rows, :], c_ref[rows, :]
    dy = dy_ref[rows, :]  # (t, p) in the compute dtype
    state = st_ref[pl.ds(z * p, p), :]  # (p, n) float32: the state entering chunk z
    xdt = xf * dt[:, None]
    cb = jax.lax.dot_general(cmat, bmat, _NT, preferred_element_type=_F32)  # (t, s)
    dxdt, dd, da, db, dc, dstate_in = chunk_bwd(xf, dt, dy, bmat, cmat, state, dstate, xdt, cb,
                                                (lmat, decay_in, w, through), masks, cdt)
    dx_ref[rows, :] = (dxdt * dt[:, None] + dy.astype(_F32) * D).astype(dx_ref.dtype)
    ddt_ref[rows] = jnp.sum(dxdt * xf, axis=1)
    da_ref[rows] = da
    dd_ref[rows] = dd
    # B and C are shared with the group's other heads (other programs).
    pltriton.atomic_add(db_ref, (rows, slice(None)), db)
    pltriton.atomic_add(dc_ref, (rows, slice(None)), dc)
    return dstate_in  # the cotangent of the state entering chunk z

  dinit_ref[...] = jax.lax.fori_loop(0, nc, body, dfin_ref[...].astype(_F32))


def _bwd_call(x, dt, A, B, C, D, st, dy, dfin, sq, q, interpret):
  b, L, h, p = x.shape
  g, n = B.shape[-2:]
  nc = L // q
  head, rows, scalar, group, state, seq_spec = _specs(b, L, h, g, p, n)
  in_specs = [head, rows, scalar, group, group, scalar,
              pl.BlockSpec((None, None, nc * p, n), lambda bi, hi: (bi, hi, 0, 0)), head, state]
  args = [x, dt, A, B, C, D, st, dy, dfin]
  if sq is not None:
    in_specs.append(seq_spec)
    args.append(sq)
  zeros = jnp.zeros(B.shape, _F32)
  in_specs += [group, group]
  args += [zeros, zeros]
  f32 = lambda s: jax.ShapeDtypeStruct(s, _F32)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), f32(dt.shape), f32(dt.shape), f32(dt.shape),
               f32(B.shape), f32(B.shape), f32(dfin.shape)]
  out_specs = [head, rows, rows, rows, group, group, state]
  isz = jnp.dtype(x.dtype).itemsize
  cost = pl.CostEstimate(
      # per head and chunk: recomputed C B^T and segment sums, their cotangents
      # (dM, d(x dt), dC, dB, the segment sums' transpose at HIGHEST), the entering
      # state's (C H^T, dH, dC) and the end state's (d(x w), dB); ~30 elementwise
      # (t, s) and ~20 (q, p) ops.
      flops=int(b * h * nc * (4 * q ** 3 + 6 * q * q * n + 4 * q * q * p + 10 * q * n * p
                              + 4 * p * n + 30 * q * q + 20 * q * p)),
      transcendentals=int(b * h * nc * (q * q + 2 * q + 1)),
      # x and dy read and dx written; dt read and three rows written; B and C read
      # once per sequence and group (from L2, as in the forward); dB and dC: the
      # zeros read and the sums written once per sequence and group (the atomic
      # adds of the group's heads meet in L2); the entering states read once; the
      # final state's cotangent read and the initial one's written.
      bytes_accessed=int(3 * x.size * isz + 4 * dt.size * 4 + 2 * B.size * isz + 4 * B.size * 4
                         + st.size * 4 + 2 * dfin.size * 4 + (b * L * h * 4 if sq is not None else 0)))
  n_in = len(args)
  return pl.pallas_call(
      functools.partial(_bwd_kernel, q=q, nc=nc, seq=sq is not None),
      out_shape=tuple(out_shape), grid=(b, h), in_specs=in_specs, out_specs=tuple(out_specs),
      input_output_aliases={n_in - 2: 4, n_in - 1: 5}, compiler_params=_params(),
      cost_estimate=cost, interpret=interpret, name="ssd_gpu_bwd")(*args)


# ----------------------------------------------------------------------------
# The kernels' VJP, and the function with `ssd_chunked`'s signature.


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _ssd(x, dt, A, B, C, D, h0, sq, q, interpret):
  return _fwd_call(x, dt, A, B, C, D, h0, sq, q, interpret)


# Names a remat policy can save ('save_in_proj_ssd', and 'save_matmuls' with the layers
# unrolled: `table.build`): with y and the entering states kept, the backward pass need
# not run the forward kernel again.
SAVE_NAMES = ("ssd_gpu_y", "ssd_gpu_states")


def _ssd_fwd(x, dt, A, B, C, D, h0, sq, q, interpret):
  y, fin, st = _fwd_call(x, dt, A, B, C, D, h0, sq, q, interpret, save=True)
  y, st = checkpoint_name(y, SAVE_NAMES[0]), checkpoint_name(st, SAVE_NAMES[1])
  return (y, fin), (x, dt, A, B, C, D, st, sq)


def _ssd_bwd(q, interpret, res, ct):
  x, dt, A, B, C, D, st, sq = res
  dy, dfin = ct
  dx, ddt, da, dd, dB, dC, dinit = _bwd_call(x, dt, A, B, C, D, st, dy.astype(x.dtype), dfin.astype(_F32),
                                             sq, q, interpret)
  # a = dt A: its cotangent goes to dt and A here, in float32 (small: (b, l, h)).
  ddt = ddt + da * A
  dA = jnp.sum(da * dt, axis=(0, 1))
  return (dx, ddt, dA, dB.astype(B.dtype), dC.astype(C.dtype), jnp.sum(dd, axis=(0, 1)), dinit, None)


_ssd.defvjp(_ssd_fwd, _ssd_bwd)


def ssd_gpu(x, dt, A, B, C, chunk_size: int, *, D=None, initial_state=None, seq_idx=None,
            interpret: bool = False):
  """`ssd.ssd_chunked` as Pallas Triton kernels (see the module doc): same arguments
  and results. `chunk_size` is rounded to the kernels' chunk (`kernel_chunk`);
  `interpret` runs the kernels in Pallas' interpreter."""
  b, l, h, p = x.shape
  g, n = B.shape[-2:]
  if h % g:
    raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
  q = kernel_chunk(chunk_size)
  L = -(-l // q) * q
  pp, nn = max(MIN_DIM, _pow2_ceil(p)), max(MIN_DIM, _pow2_ceil(n))
  f32 = jnp.promote_types(x.dtype, _F32)
  # Padding (none at the usual shapes): positions with dt = 0 and x = 0 change no
  # state; zero columns of x, B and C add nothing.
  xk = _pad_axis(_pad_axis(x, 1, L), 3, pp)
  dtk = _pad_axis(dt.astype(f32), 1, L)
  Bk = _pad_axis(_pad_axis(B.astype(x.dtype), 1, L), 3, nn)
  Ck = _pad_axis(_pad_axis(C.astype(x.dtype), 1, L), 3, nn)
  h0 = (jnp.zeros((b, h, p, n), f32) if initial_state is None else initial_state.astype(f32))
  h0 = _pad_axis(_pad_axis(h0, 2, pp), 3, nn)
  Dk = jnp.zeros((h,), f32) if D is None else D.astype(f32)
  # Padding joins the last document (it carries no input), as in `ssd.chunk_documents`.
  sq = None if seq_idx is None else _pad_axis(seq_idx.astype(jnp.int32), 1, L, mode="edge")
  y, final = _ssd(xk, dtk, A.astype(f32), Bk, Ck, Dk, h0, sq, q, interpret)
  return y[:, :l, :, :p], final[:, :, :p, :n]
