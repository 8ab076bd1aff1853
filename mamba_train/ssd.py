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
is one step of it, for decoding.

Numerical rules kept throughout:
  * every decay (dt * A, its cumulative sums and their exponentials) is float32
    whatever the compute dtype: in bfloat16 the small dt*A terms vanish inside a
    cumulative sum and the error compounds over positions and layers;
  * segment sums inside a chunk are accumulated from masked copies, never formed
    as differences of running sums (cumsum[i] - cumsum[j] cancels catastrophically
    at chunk 256 in float32);
  * the matmuls run in the dtype of x (the compute dtype) and accumulate in float32.

This module imports nothing from the package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _acc_dtype(x):
  # float32 for float32/bfloat16 inputs; float64 when the tests run under x64.
  return jnp.promote_types(x.dtype, _F32)


def _tril(t: int, k: int = 0):
  # Static mask: built from shapes only, so XLA sees a constant.
  return jnp.tril(jnp.ones((t, t), dtype=bool), k)


def segsum(a):
  """Stable segment sums: out[..., i, j] = sum_{k=j+1..i} a[..., k] for i >= j, else -inf.

  a: (..., t) float32. Built by summing masked copies of `a` down the rows,
  so no large running sums are subtracted.
  """
  t = a.shape[-1]
  x = jnp.broadcast_to(a[..., :, None], a.shape + (t,))  # x[..., i, j] = a[i]
  x = jnp.where(_tril(t, -1), x, 0.0)
  out = jnp.cumsum(x, axis=-2)
  return jnp.where(_tril(t, 0), out, -jnp.inf)


def _suffix_sum(a):
  """out[..., s] = sum_{k>s} a[..., k] (exclusive, from the end), without subtraction."""
  shifted = jnp.concatenate([a[..., 1:], jnp.zeros_like(a[..., :1])], axis=-1)
  return jnp.flip(jnp.cumsum(jnp.flip(shifted, -1), -1), -1)


def _pad_to_chunks(x, pad, value=0):
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def ssd_chunked(x, dt, A, B, C, chunk_size: int, *, D=None, initial_state=None, seq_idx=None):
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

  Returns:
    y: (b, l, h, p) in x's dtype, and the final state (b, h, p, n) in float32
    (the state after the last position, i.e. of the last document).
  """
  b, l, h, p = x.shape
  g, n = B.shape[-2:]
  if h % g:
    raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
  r = h // g
  q = chunk_size
  cdt = x.dtype
  f32 = _acc_dtype(x)

  # Pad to whole chunks with dt = 0 and x = 0: decay exp(0) = 1 and no input,
  # so padded positions cannot change the state.
  pad = (-l) % q
  nc = (l + pad) // q
  xc = _pad_to_chunks(x, pad).reshape(b, nc, q, g, r, p)
  dtc = _pad_to_chunks(dt.astype(f32), pad).reshape(b, nc, q, g, r)
  Bc = _pad_to_chunks(B, pad).reshape(b, nc, q, g, n).astype(cdt)
  Cc = _pad_to_chunks(C, pad).reshape(b, nc, q, g, n).astype(cdt)
  a = dtc * A.astype(f32).reshape(g, r)  # (b, c, s, g, r) log decay per step
  a = jnp.moveaxis(a, 2, -1)  # (b, c, g, r, s)
  dt_s = jnp.moveaxis(dtc, 2, -1)  # (b, c, g, r, s)

  if seq_idx is not None:
    # Pad with the last id so padding joins the last document (it carries no input).
    sq = _pad_to_chunks(seq_idx, pad, 0)
    if pad:
      sq = sq.at[:, l:].set(seq_idx[:, -1:])
    sq = sq.reshape(b, nc, q)
    same = sq[:, :, :, None] == sq[:, :, None, :]  # (b, c, t, s)
    # Documents of each chunk's last position; slot 0 is the initial state's (position 0's).
    doc_end = jnp.concatenate([sq[:, :1, 0], sq[:, :, -1]], axis=1)  # (b, c+1)

  # 1. Intra-chunk outputs (diagonal blocks): y_t += sum_s C_t.B_s exp(a_{s+1..t}) dt_s x_s.
  decay = jnp.exp(segsum(a))  # (b, c, g, r, t, s), float32, zero above the diagonal
  if seq_idx is not None:
    decay = jnp.where(same[:, :, None, None], decay, 0.0)
  # dt_s scales x (l*h*p values) rather than the (t, s) matrices (l*Q*h values),
  # and the scaled x feeds step 2 too.
  cb = jnp.einsum("bctgn,bcsgn->bcgts", Cc, Bc, preferred_element_type=f32)
  m = (cb[:, :, :, None] * decay).astype(cdt)
  xdt = xc.astype(f32) * jnp.moveaxis(dt_s, -1, 2)[..., None]  # (b, c, s, g, r, p) float32
  y = jnp.einsum("bcgrts,bcsgrp->bctgrp", m, xdt.astype(cdt), preferred_element_type=f32)

  # 2. State of each chunk at its end, from its own inputs (right low-rank factor).
  #    The decay scales dt*x, not B: B is shared by the r heads of a group, so the
  #    contraction over s stays one (r*p, s) x (s, n) product per group and no
  #    per-head (s, n) copy of B is materialised.
  decay_to_end = jnp.exp(_suffix_sum(a))  # (b, c, g, r, s)
  if seq_idx is not None:
    decay_to_end = jnp.where((sq == sq[:, :, -1:])[:, :, None, None], decay_to_end, 0.0)
  xw = (xdt * jnp.moveaxis(decay_to_end, -1, 2)[..., None]).astype(cdt)  # (b, c, s, g, r, p)
  states = jnp.einsum("bcsgrp,bcsgn->bcgrpn", xw, Bc, preferred_element_type=f32)

  # 3. State passing between chunks (the only sequential part, done as a c x c
  #    masked product since c is small): H_z = sum_{z' <= z} exp(A_{z'+1..z}) S_{z'}.
  if initial_state is None:
    init = jnp.zeros((b, 1, g, r, p, n), f32)
  else:
    init = initial_state.astype(f32).reshape(b, 1, g, r, p, n)
  states = jnp.concatenate([init, states], axis=1)  # (b, c+1, g, r, p, n)
  chunk_a = jnp.pad(a.sum(-1), [(0, 0), (1, 0), (0, 0), (0, 0)])  # (b, c+1, g, r)
  chunk_decay = jnp.exp(segsum(jnp.moveaxis(chunk_a, 1, -1)))  # (b, g, r, z_out, z_in)
  if seq_idx is not None:
    same_doc = doc_end[:, :, None] == doc_end[:, None, :]
    chunk_decay = jnp.where(same_doc[:, None, None], chunk_decay, 0.0)
  states = jnp.einsum("bgrzy,bygrpn->bzgrpn", chunk_decay, states)
  prev_states, final_state = states[:, :-1], states[:, -1]

  # 4. State -> output (left low-rank factor): y_t += C_t . H_{c-1} exp(a_{1..t}).
  decay_in = jnp.exp(jnp.cumsum(a, axis=-1))  # (b, c, g, r, t)
  if seq_idx is not None:
    decay_in = jnp.where((sq == doc_end[:, :-1, None])[:, :, None, None], decay_in, 0.0)
  cs = jnp.einsum("bctgn,bcgrpn->bctgrp", Cc, prev_states.astype(cdt), preferred_element_type=f32)
  y = y + cs * jnp.moveaxis(decay_in, -1, 2)[..., None]

  y = y.reshape(b, nc * q, h, p)[:, :l]
  if D is not None:
    y = y + x.astype(f32) * D.astype(f32)[:, None]
  return y.astype(cdt), final_state.reshape(b, h, p, n)


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
