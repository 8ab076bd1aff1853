"""The SSD (state-space duality) scan of Mamba-2, in plain JAX.

Legend (the paper's letters, used in every einsum and docstring here):
  b batch · l sequence length · c chunk index · s/t positions inside a chunk
  h heads · p head dim · g groups (heads share B/C within a group) · r heads per group
  n state size · z chunk index as a source in the state passing

The recurrence, per head:
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T          (state: p x n)
    y_t = h_t C_t + D x_t

`ssd_chunked` evaluates it as a block decomposition (Dao & Gu, 2024, sec. 6):
within a chunk the recurrence is a masked matrix product (the diagonal blocks),
between chunks only the (h, p, n) state passes (the low-rank off-diagonal blocks).
`ssd_sequential` is the plain recurrence the tests hold it against; `ssd_step`
is one step of it, for decoding. With a `window` W (the truncated horizon) each
output reads only the last W positions: `_windowed` keeps the diagonal blocks,
passes states only over the band of whole chunks inside the window, and masks
the far edge's one or two partly-visible chunks; `ssd_window_step` decodes it.

Numerical rules kept throughout:
  * every decay (dt * A, its cumulative sums and their exponentials) is float32
    whatever the compute dtype: in bfloat16 the small dt*A terms vanish inside a
    cumulative sum and the error compounds over positions and layers;
  * segment sums inside a chunk are sums of the terms they cover, never
    differences of running sums (cumsum[i] - cumsum[j] loses 10-100x accuracy
    at chunk 256 in float32 with trained dt*A);
  * the matmuls run in the dtype of x (the compute dtype) and accumulate in float32.

This module imports nothing from the package.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def _acc_dtype(x):
  # float32 for float32/bfloat16 inputs; float64 when the tests run under x64.
  return jnp.promote_types(x.dtype, _F32)


def _tril(t: int, k: int = 0):
  # Static mask: built from shapes only, so XLA sees a constant.
  return jnp.tril(jnp.ones((t, t), dtype=bool), k)


def segsum(a):
  """Stable segment sums: out[..., i, j] = sum_{k=j+1..i} a[..., k] for i >= j, else -inf.
  The reference form; `ssd_chunked` uses `_segsums`.

  a: (..., t) float32. Built by summing masked copies of `a` down the rows,
  so no large running sums are subtracted.
  """
  t = a.shape[-1]
  x = jnp.broadcast_to(a[..., :, None], a.shape + (t,))  # x[..., i, j] = a[i]
  x = jnp.where(_tril(t, -1), x, 0.0)
  out = jnp.cumsum(x, axis=-2)
  return jnp.where(_tril(t, 0), out, -jnp.inf)


def _pad_to_chunks(x, pad, value=0):
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def to_chunks(x, dt, A, B, C, chunk_size: int, initial_state=None, *, positions_minor: bool = False):
  """The scan's inputs in the chunk-major, head-major layout that `ssd_chunked` and
  the kernels of `ssd_tpu` share.

  Padded to whole chunks with dt = 0 and x = 0: decay exp(0) = 1 and no input, so
  padded positions cannot change the state. Returns xc (c, b, g, r, s, p), or
  (c, b, g, r, p, s) with `positions_minor` (the kernels' lanes); dtc and the log
  decay per step ac = dtc A, (c, b, g, r, s); Bc, Cc (c, b, g, s, n) in x's dtype;
  init (b, g, r, p, n) (zeros without `initial_state`). dt, A and the state in
  float32 (float64 under x64 with float64 inputs).
  """
  b, l, h, p = x.shape
  g, n = B.shape[-2:]
  r, q, cdt, f32 = h // g, chunk_size, x.dtype, _acc_dtype(x)
  pad = (-l) % q
  nc = (l + pad) // q
  x_axes = (1, 0, 3, 4, 5, 2) if positions_minor else (1, 0, 3, 4, 2, 5)
  xc = _pad_to_chunks(x, pad).reshape(b, nc, q, g, r, p).transpose(x_axes)
  dtc = _pad_to_chunks(dt.astype(f32), pad).reshape(b, nc, q, g, r).transpose(1, 0, 3, 4, 2)
  ac = dtc * A.astype(f32).reshape(g, r, 1)
  Bc = _pad_to_chunks(B, pad).reshape(b, nc, q, g, n).transpose(1, 0, 3, 2, 4).astype(cdt)
  Cc = _pad_to_chunks(C, pad).reshape(b, nc, q, g, n).transpose(1, 0, 3, 2, 4).astype(cdt)
  init = (jnp.zeros((b, g, r, p, n), f32) if initial_state is None
          else initial_state.astype(f32).reshape(b, g, r, p, n))
  return xc, dtc, ac, Bc, Cc, init


def chunk_documents(seq_idx, chunk_size: int):
  """Document ids (b, l) chunk-major as sq (c, b, s), padded with the last id so
  padding joins the last document (it carries no input); and doc_in (c, b), the
  document of the state entering each chunk (position 0's for the first)."""
  b, l = seq_idx.shape
  q = chunk_size
  pad = (-l) % q
  sq = _pad_to_chunks(seq_idx, pad, 0)
  if pad:
    sq = sq.at[:, l:].set(seq_idx[:, -1:])
  sq = sq.reshape(b, (l + pad) // q, q).transpose(1, 0, 2)
  doc_in = jnp.concatenate([sq[:1, :, 0], sq[:-1, :, -1]], axis=0)
  return sq, doc_in


def _segsums_matmul(a):
  """_segsums by one matmul with a constant 0/1 matrix: O(t^3) FLOPs, but on the
  matrix units, and the fewest bytes: what the parallel form uses on accelerators,
  which are memory-bound here (XLA's counts: docs/bench/design_notes.md)."""
  q = a.shape[-1]
  upto = a[..., None, :] * jnp.tril(jnp.ones((q, q), a.dtype))  # (..., t, k): a_k for k <= t
  after = jnp.tril(jnp.ones((q, q), a.dtype), -1)  # (k, s): k > s
  seg = jnp.einsum("...tk,ks->...ts", upto, after, precision=_HIGHEST)
  return seg, upto.sum(-1)


def _segsums(a, two_level: bool = True, block: int = 16):
  """Segment and prefix sums of per-step log decays a (..., t).

  Returns seg (..., t, s) = sum_{s<k<=t} a_k (finite but meaningless where s > t:
  mask it) and the inclusive prefix sums cs (..., t) = sum_{k<=t} a_k.

  Every entry is a sum of the terms it covers (all of one sign), never a
  difference of running sums, so it keeps float32 accuracy at chunk 256. Two
  levels keep it cheap: blocks of `block` steps get their sums from a small matmul
  (`_segsums_matmul`), and an entry spanning blocks S < T adds three partial sums:
  the rest of block S, the whole blocks between, the start of block T. The masked
  cumsum of `segsum` is a log-depth chain of (t, t) elementwise passes on CPU,
  slower than these matmuls (docs/bench/design_notes.md); one t x t matmul
  (`_segsums_matmul`, what two_level=False runs) costs O(t^3) FLOPs, which grow
  with the chunk. HIGHEST precision: TPUs (bfloat16 passes) and GPUs (TF32) would
  otherwise round the decays.
  """
  q = a.shape[-1]
  if not two_level or q <= 4 * block or q % block:
    return _segsums_matmul(a)
  nb = q // block
  # Leading dims flattened: jaxlib 0.10.2's XLA:CPU (YNNPACK fusions) segfaults
  # running this function's gradient on some rank-5 inputs, e.g. (2, 1, 24, 64, 64).
  lead = a.shape[:-1]
  seg_w, cs_w = _segsums_matmul(a.reshape(-1, nb, block))  # (.., T, t', s'), (.., T, t')
  seg_b, cs_b = _segsums_matmul(cs_w[..., -1])  # over block totals: (.., T, S), (.., T)
  # between[T, S] = sum of the whole blocks strictly between S and T = seg_b[T-1, S].
  between = jnp.concatenate([jnp.zeros_like(seg_b[..., :1, :]), seg_b[..., :-1, :]], axis=-2)
  cross = (seg_w[..., -1, :][..., None, None, :, :]  # rest of block S after s': (.., 1, 1, S, s')
           + between[..., :, None, :, None]  # (.., T, 1, S, 1)
           + cs_w[..., :, :, None, None])  # start of block T up to t': (.., T, t', 1, 1)
  same_block = (jnp.arange(nb)[:, None, None, None] == jnp.arange(nb)[None, None, :, None])
  seg = jnp.where(same_block, seg_w[..., :, :, None, :], cross).reshape(lead + (q, q))
  before = jnp.concatenate([jnp.zeros_like(cs_b[..., :1]), cs_b[..., :-1]], axis=-1)  # blocks < T
  return seg, (cs_w + before[..., None]).reshape(lead + (q,))


def _chunk_terms(x, dt, a, B, C, same=None, two_level=True):
  """What one chunk gives from its own inputs, in the head-major layout.

  x (..., g, r, s, p) in the compute dtype; dt, a (..., g, r, s) float32;
  B, C (..., g, s, n); same (..., t, s) bool or None (positions in one document).
  Returns the intra-chunk outputs (..., g, r, t, p) (the diagonal block), the state
  the chunk leaves at its end from its own inputs (..., g, r, p, n) (the right
  low-rank factor), both float32, and the prefix sums of a. two_level: see `_segsums`.
  """
  cdt, f32 = x.dtype, _acc_dtype(x)
  seg, cs = _segsums(a, two_level)
  keep = _tril(a.shape[-1])
  if same is not None:
    keep = keep & same[..., None, None, :, :]
  decay = jnp.where(keep, jnp.exp(seg), 0.0)  # (..., g, r, t, s) float32
  # y_t = sum_s (C_t . B_s) exp(a_{s+1..t}) dt_s x_s. dt scales x (s*p values per
  # head) rather than the (t, s) matrix, and the scaled x feeds the state too.
  cb = jnp.einsum("...gtn,...gsn->...gts", C, B, preferred_element_type=f32)
  m = (cb[..., None, :, :] * decay).astype(cdt)
  xdt = x.astype(f32) * dt[..., None]
  y = jnp.einsum("...grts,...grsp->...grtp", m, xdt.astype(cdt), preferred_element_type=f32)
  # State at the chunk end: the decay to the end scales dt*x, not B, so B (shared
  # by the r heads of a group) enters one (r*p, s) x (s, n) product per group.
  to_end = jnp.exp(seg[..., -1, :])  # (..., g, r, s): exp(a_{s+1..end})
  if same is not None:
    to_end = jnp.where(same[..., None, None, -1, :], to_end, 0.0)
  xw = (xdt * to_end[..., None]).astype(cdt)
  states = jnp.einsum("...grsp,...gsn->...grpn", xw, B, preferred_element_type=f32)
  return y, states, cs


def _state_out(C, state, cs, keep_in=None):
  """Output of the state entering a chunk (the left low-rank factor):
  y_t = C_t . H exp(a_{1..t}); zero where keep_in (..., t) is False."""
  f32 = _acc_dtype(state)
  y = jnp.einsum("...gtn,...grpn->...grtp", C, state.astype(C.dtype), preferred_element_type=f32)
  decay_in = jnp.exp(cs)  # (..., g, r, t)
  if keep_in is not None:
    decay_in = jnp.where(keep_in[..., None, None, :], decay_in, 0.0)
  return y * decay_in[..., None]


def pass_states(init, states, totals, doc_end=None):
  """State passing between consecutive segments (the chunks of `ssd_chunked`, or
  the slices of a sequence split over devices): the only sequential part, done
  as one (z+1) x (z+1) masked product since z is small:
  H_z = sum_{z' <= z} exp(A_{z'+1..z}) S_{z'}, slot 0 the state before segment 0
  and slot z+1 segment z's own end state (from a zero start).

  init: (b, *hd, p, n) the state before segment 0; states: (z, b, *hd, p, n);
  totals: (z, b, *hd) float32 log decay across each whole segment; doc_end:
  (z+1, b) the document each slot's state belongs to (slot 0: init's, i.e. the
  first position's; slot z+1: segment z's last position's), or None. A state
  reaches a later slot only within its document (seq_idx is nondecreasing).
  Returns the states entering each segment (z, b, *hd, p, n) and the final state.
  """
  states = jnp.concatenate([init[None].astype(states.dtype), states], axis=0)
  totals = jnp.concatenate([jnp.zeros_like(totals[:1]), totals], axis=0)
  seg, _ = _segsums(jnp.moveaxis(totals, 0, -1), two_level=False)  # (b, *hd, z_out, z_in)
  keep = _tril(states.shape[0])
  if doc_end is not None:
    same = jnp.moveaxis(doc_end[:, None] == doc_end[None, :], -1, 0)  # (b, z_out, z_in)
    keep = keep & same.reshape(same.shape[:1] + (1,) * (totals.ndim - 2) + same.shape[1:])
  decay = jnp.where(keep, jnp.exp(seg), 0.0)
  states = jnp.einsum("...zy,y...pn->z...pn", decay, states, precision=_HIGHEST)
  return states[:-1], states[-1]


def state_outputs(C, state, dt, A, *, keep_in=None):
  """What a state entering a segment adds to its outputs (`_state_out` over the
  whole segment): y_t = C_t . H exp(sum_{k<=t} dt_k A), zero where keep_in is False.

  C: (b, l, g, n); state: (b, h, p, n) float32; dt: (b, l, h); A: (h,);
  keep_in: (b, l) bool, True where position t belongs to the state's document.
  Returns (b, l, h, p) float32. The exponent is a running sum of terms of one
  sign (never a difference of sums), float32 like every decay here.
  """
  b, l, g, n = C.shape
  h, p = state.shape[1:3]
  f32 = _acc_dtype(state)
  cs = jnp.cumsum(dt.astype(f32) * A.astype(f32), axis=1)  # (b, l, h)
  cs = cs.reshape(b, l, g, h // g).transpose(0, 2, 3, 1)  # (b, g, r, t)
  Cg = C.transpose(0, 2, 1, 3)  # (b, g, t, n)
  y = _state_out(Cg, state.astype(f32).reshape(b, g, h // g, p, n), cs, keep_in)  # (b, g, r, t, p)
  return y.transpose(0, 3, 1, 2, 4).reshape(b, l, h, p)

# ----------------------------------------------------------------------------
# The truncated horizon (`window`): y_t sums only sources s in (t - W, t].
# With W = m q + w0 (0 <= w0 < q), a source chunk d chunks before the output
# chunk is wholly visible for 1 <= d <= m - 1 (the band, passed as states), partly
# visible for d = m and d = m + 1 (position t - s < W, i.e. i - j < W - d q; the
# d = m + 1 block is empty when w0 = 0), and invisible beyond.


def _shift(t, d: int):
  """t (c, ...) moved d chunks later: out[c] = t[c - d], zeros for c < d."""
  if d == 0:
    return t
  if d >= t.shape[0]:
    return jnp.zeros_like(t)
  return jnp.concatenate([jnp.zeros_like(t[:d]), t[:-d]], axis=0)


def _band_states(states, totals, carry, k: int):
  """The state each chunk receives from the k chunks before it alone (the band):
  H_c = sum_{d=1..k} T_{c-d+1} ... T_{c-1} S_{c-d}, with T_j = exp(totals_j) where
  carry_j (the state entering chunk j reaches its end) and 0 where a document starts.

  states (c, b, g, r, p, n) float32, each chunk's end state from its own inputs;
  totals (c, b, g, r) float32 log decay across each chunk; carry (c, b) bool or None.
  By doubling, log2(k) rounds over the (c, ...) states: G(a + b)_c = G(a)_c +
  P(a)_c G(b)_{c-a}, P(a)_c = T_{c-a} ... T_{c-1}, with P kept as a sum of logs
  (terms of one sign) and a flag, so no state is ever subtracted.
  """
  alive = (jnp.ones(totals.shape[:2], bool) if carry is None else carry)
  alive = alive.reshape(alive.shape + (1,) * (totals.ndim - 2))
  acc = acc_log = acc_ok = None
  acc_k = 0
  pow_g, pow_log, pow_ok = _shift(states, 1), _shift(totals, 1), _shift(alive, 1)
  size = 1
  while size <= k:
    if k & size:
      if acc is None:
        acc, acc_log, acc_ok = pow_g, pow_log, pow_ok
      else:
        acc = acc + jnp.where(acc_ok, jnp.exp(acc_log), 0.0)[..., None, None] * _shift(pow_g, acc_k)
        acc_log, acc_ok = acc_log + _shift(pow_log, acc_k), acc_ok & _shift(pow_ok, acc_k)
      acc_k += size
    if 2 * size <= k:
      pow_g = pow_g + jnp.where(pow_ok, jnp.exp(pow_log), 0.0)[..., None, None] * _shift(pow_g, size)
      pow_log, pow_ok = pow_log + _shift(pow_log, size), pow_ok & _shift(pow_ok, size)
    size *= 2
  return jnp.zeros_like(states) if acc is None else acc


def _far_block(Cc, cs, sq, Bz, xdtz, restz, sqz, between, limit: int, first: int, cdt):
  """Outputs from the source chunk d chunks back where it is partly visible: the
  diagonal block's shape, masked to t - s < W (i - j < limit = W - d q).

  Cc (c, b, g, t, n), cs (c, b, g, r, t) the output chunk's inclusive prefix log
  decays; Bz, xdtz (dt x, float32), restz (the log decay after s to its chunk's
  end), sqz: the source chunk's, moved d chunks later (`_shift`); between (c, b,
  g, r): the log decay across the d - 1 whole chunks between; first = d: chunks
  c < d have no source. sq, sqz: document ids (c, b, s) or None. The log decay
  from s to t is the sum of three non-positive parts, never a difference."""
  f32 = _acc_dtype(xdtz)
  q = cs.shape[-1]
  i, j = jnp.arange(q)[:, None], jnp.arange(q)[None, :]
  keep = (i - j < limit)[None, None] & (jnp.arange(cs.shape[0]) >= first)[:, None, None, None]
  if sq is not None:
    keep = keep & (sq[..., :, None] == sqz[..., None, :])
  keep = keep[:, :, None, None]  # (c, b, 1, 1, t, s)
  logd = cs[..., :, None] + between[..., None, None] + restz[..., None, :]
  cb = jnp.einsum("...gtn,...gsn->...gts", Cc, Bz, preferred_element_type=f32)
  m = (cb[..., None, :, :] * jnp.where(keep, jnp.exp(logd), 0.0)).astype(cdt)
  return jnp.einsum("...grts,...grsp->...grtp", m, xdtz.astype(cdt), preferred_element_type=f32)


def _windowed(xc, dtc, ac, Bc, Cc, window: int, same=None, sq=None, keep_in=None, carry=None):
  """The chunked SSD with a window (chunk-major layout, see `to_chunks`): the
  diagonal blocks, the band of whole chunks as passed states, the one or two
  partly-visible chunks at the window's far edge as masked blocks. Returns y
  (c, b, g, r, t, p) float32 (without D)."""
  nc, q = xc.shape[0], xc.shape[-2]
  m = window // q
  f32 = _acc_dtype(xc)
  y, states, cs = jax.checkpoint(functools.partial(_chunk_terms, two_level=False))(
      xc, dtc, ac, Bc, Cc, same)
  totals = cs[..., -1]
  band = _band_states(states, totals, carry, min(m - 1, nc - 1))
  y = y + _state_out(Cc, band, cs, keep_in)
  xdt = xc.astype(f32) * dtc[..., None]
  # Log decay after s to the chunk end: an exclusive running sum from the end.
  rest = jnp.concatenate([jnp.cumsum(ac[..., :0:-1], axis=-1)[..., ::-1],
                          jnp.zeros_like(ac[..., :1])], axis=-1)
  far = jax.checkpoint(_far_block, static_argnums=(8, 9, 10))
  for d in (m, m + 1):
    limit = window - d * q
    if d >= nc or limit <= -q:
      continue  # no source chunk, or none of its positions visible
    between = sum((_shift(totals, k) for k in range(1, d)), jnp.zeros_like(totals))
    y = y + far(Cc, cs, sq, _shift(Bc, d), _shift(xdt, d), _shift(rest, d),
                None if sq is None else _shift(sq, d), between, limit, d, xc.dtype)
  return y


def window_state(x, dt, A, B, window: int, seq_idx=None):
  """The windowed state after the last position: sum over its last `window`
  positions s (of its document) of exp(sum_{s<r<=l} dt_r A) dt_s x_s B_s^T.
  x (b, l, h, p), dt (b, l, h), A (h,), B (b, l, g, n) -> (b, h, p, n) float32."""
  b, l, h, p = x.shape
  g, n = B.shape[-2:]
  w = min(window, l)
  f32 = _acc_dtype(x)
  a = dt[:, -w:].astype(f32) * A.astype(f32)  # (b, w, h)
  after = jnp.concatenate([jnp.cumsum(a[:, :0:-1], axis=1)[:, ::-1], jnp.zeros_like(a[:, :1])], axis=1)
  wt = jnp.exp(after) * dt[:, -w:].astype(f32)
  if seq_idx is not None:
    wt = jnp.where((seq_idx[:, -w:] == seq_idx[:, -1:])[..., None], wt, 0.0)
  xw = (x[:, -w:].astype(f32) * wt[..., None]).reshape(b, w, g, h // g, p)
  s = jnp.einsum("bsgrp,bsgn->bgrpn", xw, B[:, -w:].astype(f32), precision=_HIGHEST)
  return s.reshape(b, h, p, n)



def ssd_chunked(x, dt, A, B, C, chunk_size: int, *, D=None, initial_state=None, seq_idx=None,
                form: str = "parallel", window: int = 0):
  """Chunked SSD scan.

  Args:
    x: (b, l, h, p) inputs, in the compute dtype.
    dt: (b, l, h) step sizes (after softplus and clamping); used in float32.
    A: (h,) negative decay rates (-exp(A_log)); used in float32.
    B, C: (b, l, g, n) input and output projections; h must be a multiple of g.
    chunk_size: positions per chunk (static).
    D: optional (h,) skip: y += D * x.
    initial_state: optional (b, h, p, n) state before position 0.
    seq_idx: optional (b, l) int document ids of packed sequences, nondecreasing
      along l. No information crosses a change of id, inside or between chunks;
      `initial_state` belongs to the document at position 0.
    form: how chunks are combined (same math, same results to rounding):
      'parallel' computes every chunk at once and passes the states between
      chunks as one (c x c) masked product: most parallelism, for GPUs and TPUs;
      'scan' walks the chunks with `lax.scan`, carrying the state, so each step's
      (t, s) intermediates stay in cache: faster on CPU, where memory traffic
      dominates. Both recompute the (t, s) terms in the backward pass (remat)
      instead of storing them. The caller picks (`runtime.default_form`).
    window: 0 (exact) or W >= chunk_size: y_t sums only the sources s in
      (t - W, t], exact to the position. A document start cuts the window as it
      cuts the state. One form for both `form`s: the band of whole chunks is
      passed as states by doubling (`_band_states`) and the far edge's one or two
      partly-visible chunks are masked blocks; a scan would carry one state and
      could drop a chunk leaving the window only by subtracting it. No
      `initial_state`: a windowed state is its last W inputs, not an (h, p, n)
      summary of an unknown past.

  Returns:
    y: (b, l, h, p) in x's dtype, and the final state (b, h, p, n) in float32
    (the state after the last position, i.e. of the last document; with a
    window, the windowed one: `window_state`).
  """
  b, l, h, p = x.shape
  g, n = B.shape[-2:]
  if h % g:
    raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
  if form not in ("parallel", "scan"):
    raise ValueError(f"form must be 'parallel' or 'scan', got {form!r}")
  q = chunk_size
  if window and window < q:
    raise ValueError(f"window ({window}) must be at least the chunk ({q}), or 0 for the exact SSD")
  if window and initial_state is not None:
    raise ValueError("a windowed SSD takes no initial_state: its state is the last `window` "
                     "positions' inputs; run those positions too (or window=0)")
  cdt = x.dtype
  f32 = _acc_dtype(x)

  # The chunk-major, head-major layout (c, b, g, r, s, p): every einsum has its
  # batch dims leading (XLA:CPU's dots then need no transposes) and the scan
  # slices the leading axis.
  xc, dtc, ac, Bc, Cc, init = to_chunks(x, dt, A, B, C, q, initial_state)
  Dr = None if D is None else D.astype(f32).reshape(g, h // g, 1, 1)

  same = keep_in = carry = None
  if seq_idx is not None:
    sq, doc_in = chunk_documents(seq_idx, q)  # (c, b, s), (c, b)
    same = sq[..., :, None] == sq[..., None, :]  # (c, b, t, s)
    keep_in = sq == doc_in[..., None]  # (c, b, t)
    carry = sq[:, :, -1] == doc_in  # (c, b): the entering state reaches the chunk end

  if window:
    y = _windowed(xc, dtc, ac, Bc, Cc, window, same, None if seq_idx is None else sq, keep_in, carry)
    if Dr is not None:
      y = y + xc.astype(f32) * Dr
    y = y.astype(cdt)
    final = window_state(x, dt, A, B, window, seq_idx)
  elif form == "scan":
    def body(state, chunk):
      xk, dtk, ak, Bk, Ck, same_k, keep_k, carry_k = chunk
      y, new, cs = _chunk_terms(xk, dtk, ak, Bk, Ck, same_k)
      y = y + _state_out(Ck, state, cs, keep_k)
      if Dr is not None:
        y = y + xk.astype(f32) * Dr
      through = jnp.exp(cs[..., -1])  # (b, g, r): decay across the whole chunk
      if carry_k is not None:
        through = jnp.where(carry_k[:, None, None], through, 0.0)
      return state * through[..., None, None] + new, y.astype(cdt)

    # Remat: the backward pass recomputes each chunk's (t, s) terms from its inputs
    # rather than reading back a stored (c, b, h, t, s) stack.
    final, y = jax.lax.scan(jax.checkpoint(body), init,
                            (xc, dtc, ac, Bc, Cc, same, keep_in, carry))
  else:
    # One matmul per segment-sum matrix: the parallel form is for matrix units.
    # Remat, as in the scan form: the backward pass recomputes the (c, b, h, t, s)
    # decay and score stacks from the chunk inputs instead of storing them: stored,
    # they dominate a train step's memory (docs/bench/design_notes.md).
    terms = jax.checkpoint(functools.partial(_chunk_terms, two_level=False))
    y, states, cs = terms(xc, dtc, ac, Bc, Cc, same)  # leading (c, b)
    doc_end = None if seq_idx is None else jnp.concatenate([doc_in[:1], sq[:, :, -1]], axis=0)
    prev, final = pass_states(init, states, cs[..., -1], doc_end)
    y = y + _state_out(Cc, prev, cs, keep_in)
    if Dr is not None:
      y = y + xc.astype(f32) * Dr
    y = y.astype(cdt)

  y = y.transpose(1, 0, 4, 2, 3, 5).reshape(b, xc.shape[0] * q, h, p)[:, :l]
  return y, final.reshape(b, h, p, n)


def ssd_step(state, x, dt, A, B, C, *, D=None):
  """One recurrent step, for decoding.

  state: (b, h, p, n) float32; x: (b, h, p); dt: (b, h); A: (h,); B, C: (b, g, n).
  Returns y (b, h, p) in x's dtype and the new state (b, h, p, n) float32.
  """
  b, h, p = x.shape
  g = B.shape[1]
  f32 = _acc_dtype(x)
  dt = dt.astype(f32)
  rep = lambda t: jnp.repeat(t.astype(f32), h // g, axis=1)  # (b, g, n) -> (b, h, n)
  Bh, Ch = rep(B), rep(C)
  xf = x.astype(f32)
  decay = jnp.exp(dt * A.astype(f32))  # (b, h)
  state = state * decay[..., None, None] + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
  y = jnp.einsum("bhpn,bhn->bhp", state, Ch)
  if D is not None:
    y = y + xf * D.astype(f32)[:, None]
  return y.astype(x.dtype), state


def ssd_window_step(window, x, dt, A, B, C, *, D=None):
  """One step of the windowed SSD, for decoding: the output from the last W
  positions' inputs, summed directly (as attention reads its keys), so nothing
  leaving the window is ever subtracted from a state.

  window: (xdt (b, W, h, p), B (b, W, g, n), a (b, W, h)) float32, the W positions
  before this one, oldest first: dt*x, B and the log decay dt*A (zeros where no
  position is). x: (b, h, p); dt: (b, h); A: (h,); B, C: (b, g, n).
  Returns y (b, h, p) in x's dtype and the window moved on by this position.
  Costs O(W (h p + g n)) per step, not O(h p n): the state is never formed.
  """
  wx, wb, wa = window
  b, h, p = x.shape
  g = B.shape[1]
  f32 = _acc_dtype(x)
  dt = dt.astype(f32)
  wx = jnp.concatenate([wx[:, 1:], (dt[..., None] * x.astype(f32))[:, None]], axis=1)
  wb = jnp.concatenate([wb[:, 1:], B.astype(f32)[:, None]], axis=1)
  wa = jnp.concatenate([wa[:, 1:], (dt * A.astype(f32))[:, None]], axis=1)
  # Log decay from each s to now: an exclusive running sum from the newest.
  after = jnp.concatenate([jnp.cumsum(wa[:, :0:-1], axis=1)[:, ::-1], jnp.zeros_like(wa[:, :1])], axis=1)
  cb = jnp.einsum("bgn,bsgn->bsg", C.astype(f32), wb, precision=_HIGHEST)
  w = jnp.repeat(cb, h // g, axis=2) * jnp.exp(after)  # (b, W, h)
  y = jnp.einsum("bsh,bshp->bhp", w, wx, precision=_HIGHEST)
  if D is not None:
    y = y + x.astype(f32) * D.astype(f32)[:, None]
  return y.astype(x.dtype), (wx, wb, wa)


def ssd_sequential(x, dt, A, B, C, *, D=None, initial_state=None, seq_idx=None):
  """The plain recurrence with `jax.lax.scan`, one position at a time.

  Same arguments and results as `ssd_chunked` (no chunk size). The state is reset
  wherever `seq_idx` changes. Runs in float32, or float64 under jax_enable_x64
  when the inputs are float64.
  """
  b, l, h, p = x.shape
  n = B.shape[-1]
  dtype = jnp.promote_types(x.dtype, _F32)
  state = (jnp.zeros((b, h, p, n), dtype) if initial_state is None
           else initial_state.astype(dtype))
  if seq_idx is None:
    seq_idx = jnp.zeros((b, l), jnp.int32)
  prev_ids = jnp.concatenate([seq_idx[:, :1], seq_idx[:, :-1]], axis=1)
  keep = (seq_idx == prev_ids)  # (b, l): False where a new document starts

  def step(state, inp):
    xt, dtt, Bt, Ct, kt = inp
    state = jnp.where(kt[:, None, None, None], state, 0.0)
    rep = lambda t: jnp.repeat(t, h // t.shape[1], axis=1)
    decay = jnp.exp(dtt * A.astype(dtype))
    state = state * decay[..., None, None] + (dtt[..., None] * xt)[..., None] * rep(Bt)[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", state, rep(Ct))
    return state, y

  inputs = (x.astype(dtype), dt.astype(dtype), B.astype(dtype), C.astype(dtype), keep)
  inputs = jax.tree.map(lambda t: jnp.moveaxis(t, 1, 0), inputs)
  state, y = jax.lax.scan(step, state, inputs)
  y = jnp.moveaxis(y, 0, 1)
  if D is not None:
    y = y + x.astype(dtype) * D.astype(dtype)[:, None]
  return y, state
