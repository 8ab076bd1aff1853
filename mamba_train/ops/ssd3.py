"""The exponential-trapezoidal SSM of Mamba-3 (arXiv 2603.15569), in plain JAX.

Legend (ssd.py's letters, plus the MIMO ranks):
  b batch · l sequence length · c chunk index · s/t positions inside a chunk
  h heads · p head dim · g groups (heads share B/C within a group) · r heads per group
  n state size · i/j MIMO rank of an output (C) / of an input (B, x) · R the rank

The recurrence, per head (state p x n, float32):
    alpha_t = exp(A_t dt_t),  beta_t = (1 - lam_t) dt_t alpha_t,  gamma_t = lam_t dt_t
    h_t = alpha_t h_{t-1} + beta_t sum_j v_{t-1,j} k_{t-1,j}^T + gamma_t sum_j v_{t,j} k_{t,j}^T
    y_{t,i} = h_t q_{t,i} + D v_{t,i}
with v = x (no dt folded in), k = B, q = C. lam = 1 is Mamba-2's update (ssd.py).
A is data-dependent: one value per token and head. MIMO (rank R): B and C carry a
rank axis, v_{t,j} = x_t * x_proj[:, j] (a per-channel projection of x), the state
sums over input ranks and each output rank gets its own y; SISO is R = 1 with
v = x. The conventions are mamba_ssm's reference functions (tests/ops/triton/
test_mamba3_siso.py: mamba3_siso_step_ref, mamba3_siso_fwd_ref; tests/ops/
tilelang/test_mamba3_mimo.py: mamba3_MIMO_step_ref, mamba3_MIMO_chunk_ref):
  * the term of position -1 is carried: the cache holds the last k and raw x of
    the previous call (zeros at a sequence's start) and the first position adds
    beta_0 v_{-1} k_{-1}^T like any other;
  * D multiplies v (the projected x under MIMO), not dt x;
  * lam is taken after the sigmoid (mamba_ssm's kernels take the logit `Trap`);
    the per-head biases and rotary embedding of q and k, and the gate z and the
    MIMO output projection, belong to the layer: they come before and after.

`ssd3_chunked` is the SSD block decomposition with one change: the state
contribution of source s is v_s k_s^T times lam_s dt_s (at step s) plus
(1 - lam_{s+1}) dt_{s+1} (at step s + 1, decayed by alpha_{s+1}: the same decay
from s to t as the first). The second term reaches outputs t > s only, so the
diagonal of each chunk's (t, s) weights drops it (the diagonal correction), and
it looks one token ahead across a chunk boundary: the state a chunk passes on
already holds its last source's term for the next chunk's first step. The
incoming state likewise absorbs the carried (1 - lam_0) dt_0 v_{-1} k_{-1}^T.
`ssd3_sequential` is the recurrence it is tested against, `ssd3_step` one step
of it, for decoding.

Numerical rules, as in ssd.py: every decay (dt A, its segment sums, their
exponentials) and the per-source weights stay float32; segment sums are sums of
the terms they cover, never differences of running sums; the diagonal
correction is applied to the weights before the product, never subtracted from
an output (where lam_s dt_s is small against (1 - lam_{s+1}) dt_{s+1}, the
subtraction would cancel); matmuls run in x's dtype and accumulate in float32.

This module imports nothing from the package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def _acc_dtype(x):
  # float32 for float32/bfloat16 inputs; float64 when the tests run under x64.
  return jnp.promote_types(x.dtype, _F32)


def _segsums(a):
  """Segment sums seg (..., t, s) = sum_{s<k<=t} a_k (0 where s >= t: mask it) and
  inclusive prefix sums (..., t), each a sum of the terms it covers (one sign),
  by one matmul with a constant 0/1 matrix (ssd.py's `_segsums_matmul`). HIGHEST
  precision: TPUs and GPUs would otherwise round the decays."""
  q = a.shape[-1]
  upto = a[..., None, :] * jnp.tril(jnp.ones((q, q), a.dtype))  # (..., t, k): a_k for k <= t
  after = jnp.tril(jnp.ones((q, q), a.dtype), -1)  # (k, s): k > s
  return jnp.einsum("...tk,ks->...ts", upto, after, precision=_HIGHEST), upto.sum(-1)


def _ranked(B, C):
  """SISO B, C (b, l, g, n) as rank 1 (b, l, 1, g, n); MIMO ones unchanged."""
  if B.ndim != C.ndim:
    raise ValueError(f"B and C must both be SISO (b, l, g, n) or MIMO (b, l, R, g, n): {B.shape}, {C.shape}")
  return (B[:, :, None], C[:, :, None]) if B.ndim == 4 else (B, C)


def _values(x, x_proj, rank: int):
  """v_j = x * x_proj[:, j]: x (..., h, p) -> (..., h, R, p); x itself for SISO."""
  if x_proj is None:
    if rank != 1:
      raise ValueError(f"MIMO rank {rank} needs x_proj (h, R, p)")
    return x[..., None, :]
  return x[..., None, :] * x_proj.astype(x.dtype)


def _pad(t, pad):
  if pad == 0:
    return t
  return jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))


def empty_cache(x, B):
  """The cache before a sequence: zero state (b, h, p, n) float32, zero last k (like
  B without l) and zero last x (b, h, p)."""
  b, _, h, p = x.shape
  return (jnp.zeros((b, h, p, B.shape[-1]), _acc_dtype(x)),
          jnp.zeros(B.shape[:1] + B.shape[2:], B.dtype), jnp.zeros((b, h, p), x.dtype))


def ssd3_chunked(x, dt, A, lam, B, C, chunk_size: int, *, D=None, x_proj=None, initial=None,
                 seq_idx=None):
  """Chunked exponential-trapezoidal scan.

  Args:
    x: (b, l, h, p) inputs v, in the compute dtype.
    dt: (b, l, h) step sizes (after softplus); used in float32.
    A: (b, l, h) negative decay rates, per token; used in float32.
    lam: (b, l, h) trapezoid weights in [0, 1] (after the sigmoid); 1 is Mamba-2.
    B, C: (b, l, g, n) SISO, or (b, l, R, g, n) MIMO: keys k and queries q.
    chunk_size: positions per chunk (static).
    D: optional (h,) skip: y_i += D v_i.
    x_proj: (h, R, p) MIMO's per-channel projections of x to its R values; None for SISO.
    initial: optional cache (state (b, h, p, n), k (b, [R,] g, n), x (b, h, p)): the
      state after the previous position and that position's key and raw input.
    seq_idx: optional (b, l) nondecreasing document ids of packed sequences: a
      document's first position starts from a zero state and a zero carried (k, x)
      (its look-ahead term is not taken back into the document before it); the
      initial cache belongs to position 0's document.

  Returns:
    y: (b, l, h, p) SISO or (b, l, R, h, p) MIMO, in x's dtype; and the cache after
    the last position (as `initial`; state float32), for `ssd3_step` or a next call.
  """
  b, l, h, p = x.shape
  Bk, Cq = _ranked(B, C)
  R, g, n = Bk.shape[2:]
  if h % g:
    raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
  r, q, cdt, f32 = h // g, chunk_size, x.dtype, _acc_dtype(x)
  pad = (-l) % q
  nc = (l + pad) // q
  state0, k_prev, x_prev = empty_cache(x, B) if initial is None else initial

  dt32 = dt.astype(f32)
  lam32 = lam.astype(f32)
  a = dt32 * A.astype(f32)
  gamma = lam32 * dt32  # weight of v_s k_s^T at its own step
  carried = (1.0 - lam32) * dt32  # beta / alpha: weight of v_{s-1} k_{s-1}^T at step s
  look = jnp.concatenate([carried[:, 1:], jnp.zeros_like(carried[:, :1])], axis=1)  # at step s + 1
  if seq_idx is not None:  # no look-ahead into the next document
    next_same = jnp.concatenate([seq_idx[:, 1:] == seq_idx[:, :-1], jnp.ones_like(seq_idx[:, :1], bool)], 1)
    look = jnp.where(next_same[..., None], look, 0.0)

  # Chunk-major, head-major layout as in ssd.py. Padding has dt = 0: no decay, no
  # input, and a zero look-ahead for the last real position (its step s + 1 is the
  # next call's, carried in the cache).
  per_head = lambda t: _pad(t, pad).reshape(b, nc, q, g, r).transpose(1, 0, 3, 4, 2)  # (c, b, g, r, s)
  ac, gc, lc = per_head(a), per_head(gamma), per_head(look)
  xc = _pad(x, pad).reshape(b, nc, q, g, r, p).transpose(1, 0, 3, 4, 2, 5)  # (c, b, g, r, s, p)
  xp = None if x_proj is None else x_proj.reshape(g, r, 1, R, p)
  vc = _values(xc, xp, R)  # (c, b, g, r, s, R, p)
  rank_major = lambda t: _pad(t, pad).reshape(b, nc, q, R, g, n).transpose(1, 0, 4, 2, 3, 5).astype(cdt)
  Bc, Cc = rank_major(Bk), rank_major(Cq)  # (c, b, g, s, R, n)

  # 1. Diagonal blocks: y_{t,i} = sum_{s<=t,j} (q_{t,i}.k_{s,j}) exp(a_{s+1..t}) w_{ts} v_{s,j}
  #    with w_ts = gamma_s + [s < t] look_s (the look-ahead term is not yet in h_s).
  seg, cs = _segsums(ac)  # (c, b, g, r, t, s), (c, b, g, r, t)
  causal, strict = jnp.tril(jnp.ones((q, q), bool)), jnp.tril(jnp.ones((q, q), bool), -1)
  keep_in = doc_end = None
  if seq_idx is not None:
    # Padding joins the last document (it carries no input).
    sq = jnp.pad(seq_idx, [(0, 0), (0, pad)], mode="edge").reshape(b, nc, q).transpose(1, 0, 2)  # (c, b, s)
    doc_in = jnp.concatenate([sq[:1, :, 0], sq[:-1, :, -1]], axis=0)  # the entering state's document
    same = (sq[..., :, None] == sq[..., None, :])[:, :, None, None]  # (c, b, 1, 1, t, s)
    causal, strict = causal & same, strict & same
    keep_in = (sq == doc_in[..., None])[:, :, None, None]  # (c, b, 1, 1, t)
    to_last = (sq == sq[..., -1:])[:, :, None, None]  # sources that reach the chunk's end
    doc_end = jnp.concatenate([doc_in[:1], sq[:, :, -1]], axis=0)  # (c+1, b): each slot's document
  w = gc[..., None, :] + jnp.where(strict, lc[..., None, :], 0.0)
  w = jnp.where(causal, jnp.exp(seg), 0.0) * w
  cb = jnp.einsum("...gtin,...gsjn->...gtisj", Cc, Bc, preferred_element_type=f32)
  m = (cb[:, :, :, None] * w[..., :, None, :, None]).astype(cdt)  # (c, b, g, r, t, i, s, j)
  y = jnp.einsum("...grtisj,...grsjp->...grtip", m, vc, preferred_element_type=f32)

  # 2. Each chunk's end state from its own inputs, look-ahead included: the state
  #    the next chunk's first step decays.
  to_end = jnp.exp(seg[..., -1, :]) * (gc + lc)  # (c, b, g, r, s)
  if seq_idx is not None:
    to_end = jnp.where(to_last, to_end, 0.0)
  vw = (vc.astype(f32) * to_end[..., None, None]).astype(cdt)
  states = jnp.einsum("...grsjp,...gsjn->...grpn", vw, Bc, preferred_element_type=f32)

  # 3. States entering each chunk, as one (c+1) x (c+1) masked product. Slot 0 is
  #    the incoming state with the carried term of position -1 absorbed.
  v_prev = _values(x_prev.astype(f32), None if x_proj is None else x_proj.astype(f32), R)  # (b, h, R, p)
  k_prev = (k_prev[:, None] if B.ndim == 4 else k_prev).astype(f32)  # (b, R, g, n)
  k_prev = jnp.repeat(k_prev, r, axis=2)  # (b, R, h, n)
  init = state0.astype(f32) + carried[:, 0, :, None, None] * jnp.einsum(
      "bhjp,bjhn->bhpn", v_prev, k_prev, precision=_HIGHEST)
  all_states = jnp.concatenate([init.reshape(1, b, g, r, p, n), states], axis=0)
  totals = jnp.concatenate([jnp.zeros_like(cs[:1, ..., -1]), cs[..., -1]], axis=0)  # (c+1, b, g, r)
  zseg, _ = _segsums(jnp.moveaxis(totals, 0, -1))  # (b, g, r, z_out, z_in)
  zkeep = jnp.tril(jnp.ones((nc + 1,) * 2, bool))
  if seq_idx is not None:  # a state reaches a later slot only within its document
    zkeep = zkeep & (doc_end[:, None] == doc_end[None, :]).transpose(2, 0, 1)[:, None, None]
  zdecay = jnp.where(zkeep, jnp.exp(zseg), 0.0)
  passed = jnp.einsum("bgrzy,ybgrpn->zbgrpn", zdecay, all_states, precision=_HIGHEST)
  prev, final = passed[:-1], passed[-1]

  # 4. Output of the entering state: y_{t,i} += exp(a_{1..t}) h_in q_{t,i}.
  y_in = jnp.einsum("...gtin,...grpn->...grtip", Cc, prev.astype(cdt), preferred_element_type=f32)
  decay_in = jnp.exp(cs) if keep_in is None else jnp.where(keep_in, jnp.exp(cs), 0.0)
  y = y + y_in * decay_in[..., None, None]
  if D is not None:
    y = y + vc.astype(f32) * D.astype(f32).reshape(g, r, 1, 1, 1)

  y = y.astype(cdt).transpose(1, 0, 4, 5, 2, 3, 6).reshape(b, nc * q, R, h, p)[:, :l]
  if B.ndim == 4:
    y = y[:, :, 0]
  return y, (final.reshape(b, h, p, n), B[:, -1], x[:, -1])


def state_outputs3(C, state, dt, A, *, keep_in=None):
  """What a state entering a segment adds to its outputs: y_{t,i} = exp(sum_{k<=t} dt_k
  A_k) h q_{t,i}, zero where keep_in (b, l) is False (another document). C: (b, l, h, n)
  SISO or (b, l, R, h, n) MIMO, per head; state (b, h, p, n); dt, A (b, l, h).
  Returns (b, l, [R,] h, p) float32. The exponent is a running sum of one sign."""
  f32 = _acc_dtype(state)
  decay = jnp.exp(jnp.cumsum(dt.astype(f32) * A.astype(f32), axis=1))  # (b, l, h)
  if keep_in is not None:
    decay = jnp.where(keep_in[..., None], decay, 0.0)
  Cr = C[:, :, None] if C.ndim == 4 else C
  y = jnp.einsum("blihn,bhpn->blihp", Cr.astype(f32), state.astype(f32), precision=_HIGHEST)
  y = y * decay[:, :, None, :, None]
  return y[:, :, 0] if C.ndim == 4 else y


def ssd3_step(cache, x, dt, A, lam, B, C, *, D=None, x_proj=None):
  """One step of the recurrence, for decoding.

  cache: (state (b, h, p, n) float32, k (b, [R,] g, n), x (b, h, p)) after the
  previous position (`ssd3_chunked`'s second result, or `empty_cache`);
  x: (b, h, p); dt, A, lam: (b, h); B, C: (b, g, n) SISO or (b, R, g, n) MIMO;
  D: (h,); x_proj: (h, R, p) MIMO.
  Returns y (b, h, p) SISO or (b, R, h, p) MIMO, in x's dtype, and the new cache.
  """
  state, k_prev, x_prev = cache
  b, h, p = x.shape
  siso = B.ndim == 3
  f32 = _acc_dtype(x)
  dt, lam = dt.astype(f32), lam.astype(f32)
  alpha = jnp.exp(dt * A.astype(f32))
  beta, gamma = (1.0 - lam) * dt * alpha, lam * dt  # (b, h)
  xp = None if x_proj is None else x_proj.astype(f32)
  R = 1 if siso else B.shape[1]

  def per_head(t):  # (b, [R,] g, n) -> (b, R, h, n) float32
    t = t[:, None] if siso else t
    return jnp.repeat(t.astype(f32), h // t.shape[2], axis=2)

  v, v_prev = _values(x.astype(f32), xp, R), _values(x_prev.astype(f32), xp, R)  # (b, h, R, p)
  outer = lambda v, k: jnp.einsum("bhjp,bjhn->bhpn", v, per_head(k), precision=_HIGHEST)
  state = (alpha[..., None, None] * state + beta[..., None, None] * outer(v_prev, k_prev)
           + gamma[..., None, None] * outer(v, B))
  y = jnp.einsum("bhpn,bihn->bihp", state, per_head(C), precision=_HIGHEST)
  if D is not None:
    y = y + jnp.swapaxes(v, 1, 2) * D.astype(f32)[:, None]
  y = y[:, 0] if siso else y
  return y.astype(x.dtype), (state, B, x)


def ssd3_sequential(x, dt, A, lam, B, C, *, D=None, x_proj=None, initial=None):
  """The plain recurrence with `jax.lax.scan`, one position at a time (`ssd3_step`).

  Same arguments and results as `ssd3_chunked` (no chunk size). Runs in float32,
  or float64 under jax_enable_x64 when x is float64 (all inputs are cast to it).
  """
  dtype = _acc_dtype(x)
  cast = lambda t: None if t is None else t.astype(dtype)
  cache = empty_cache(x, B) if initial is None else initial
  cache = jax.tree.map(cast, cache)

  def step(cache, inp):
    y, cache = ssd3_step(cache, *inp, D=cast(D), x_proj=cast(x_proj))
    return cache, y

  inputs = jax.tree.map(lambda t: jnp.moveaxis(cast(t), 1, 0), (x, dt, A, lam, B, C))
  cache, y = jax.lax.scan(step, cache, inputs)
  return jnp.moveaxis(y, 0, 1), cache
