"""Mamba-3's chunked exponential-trapezoidal scan on Mamba-2's one-pass TPU kernel.

Same function, arguments and results as `ssd3.ssd3_chunked` (the reference, and what
CPUs run). Letters as in `ssd3.py`; Q = q R the kernel's chunk of flat rows.

The trapezoidal recurrence is Mamba-2's SSD with other input weights. Let
look_t = (1 - lam_{t+1}) dt_{t+1} (the weight step t + 1 gives v_t k_t^T) and
h'_t = h_t + look_t sum_j v_{t,j} k_{t,j}^T (the state with that term taken early).
Then
    h'_t = exp(A_t dt_t) h'_{t-1} + w_t sum_j v_{t,j} k_{t,j}^T,  w_t = lam_t dt_t + look_t
    y_{t,i} = h'_t q_{t,i} - look_t sum_j (q_{t,i}.k_{t,j}) v_{t,j} + D v_{t,i}
an SSD whose input scale w is not its step dt (the decay stays exp(A dt)). MIMO
flattens each position's ranks into R rows (t, 0), ..., (t, R-1) of one SSD: row
(t, j) carries key k_{t,j}, value v_{t,j}, query q_{t,j}, the decay A_t dt_t on
j = 0 only (the ranks of one position share a step) and the scale w_t on every row;
a chunk of q positions is Q = q R rows. The SSD's causal mask lets row (t, i) read
rows (t, j) with j <= i, at weight w_t; the recurrence reads every j of its own
position at weight lam_t dt_t. The difference, an R x R block per position and head,

    y_{t,i} += sum_j (lam_t dt_t - w_t [j <= i]) (q_{t,i}.k_{t,j}) v_{t,j}

(SISO: -look_t (q_t.k_t) v_t), is the diagonal correction, added in XLA after the
kernel. So `ssd_tpu.one_pass` (forward and backward kernels, the state carried on
chip, no chunk's (t, s) terms in HBM) runs the scan with dt -> w, and XLA does
what is per position: the weights, the look-ahead shift and its document cut, the
rank flattening, the carried term of position -1 folded into the initial state, the
correction and D's skip. Their gradients are XLA's VJP of those small elementwise
and R x R terms; the scan's is the backward kernel.

Numerics: the kernel's own rules (float32 decays, segment sums of the terms they
cover, matmuls in x's dtype with float32 accumulation). The one departure from
`ssd3_chunked`: the plain form puts the correction into the (t, s) weights before
its product, here it is added to y after the kernel, so the diagonal term is
w_t (q.k) v rounded in the compute dtype and then corrected, an absolute error of
one rounding of w_t (q.k) v: the size of the rounding every other source s < t
(weight up to w_s) already adds to y_t, not a new scale of error
(tests/test_ssd3_tpu.py holds bfloat16 within the plain form's error).

This module imports nothing of the package but the SSD's layout (`ssd.to_chunks`),
the kernel (`ssd_tpu`) and the plain form's helpers (`ssd3`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mamba_train.ops import ssd3, ssd_tpu
from mamba_train.ops.ssd import to_chunks

_F32 = jnp.float32

# Names a remat policy can save: the kernel's (`ssd_tpu.SAVE_NAMES`).
SAVE_NAMES = ssd_tpu.SAVE_NAMES


def ssd3_fused(x, dt, A, lam, B, C, chunk_size: int, *, D=None, x_proj=None, initial=None, seq_idx=None,
               interpret: bool = False):
  """`ssd3.ssd3_chunked` with the scan in `ssd_tpu`'s one-pass kernels (module doc).

  Same arguments and results; `interpret` runs the kernels in Pallas' interpreter.
  The state is float32 (the kernel's), whatever x's dtype.
  """
  b, l, h, p = x.shape
  Bk, Cq = ssd3._ranked(B, C)  # (b, l, R, g, n)
  R, g, n = Bk.shape[2:]
  if h % g:
    raise ValueError(f"heads ({h}) must be a multiple of groups ({g})")
  r, cdt = h // g, x.dtype
  state0, k_prev, x_prev = ssd3.empty_cache(x, B) if initial is None else initial

  # Per position and head, float32: the decay, the own-step and look-ahead weights.
  dt32, lam32 = dt.astype(_F32), lam.astype(_F32)
  a = dt32 * A.astype(_F32)
  gamma = lam32 * dt32
  carried = (1.0 - lam32) * dt32
  look = jnp.concatenate([carried[:, 1:], jnp.zeros_like(carried[:, :1])], axis=1)
  if seq_idx is not None:  # no look-ahead into the next document
    next_same = jnp.concatenate([seq_idx[:, 1:] == seq_idx[:, :-1], jnp.ones_like(seq_idx[:, :1], bool)], 1)
    look = jnp.where(next_same[..., None], look, 0.0)
  w = gamma + look

  # Ranks flattened into rows: (b, l, R, ...) -> (b, l R, ...); the decay on rank 0.
  v = ssd3._values(x, None if x_proj is None else x_proj.astype(cdt), R)  # (b, l, h, R, p)
  flat = lambda t: t.reshape(b, l * R, *t.shape[3:])
  v_rows = flat(jnp.swapaxes(v, 2, 3))  # (b, l R, h, p)
  w_rows = flat(jnp.broadcast_to(w[:, :, None], (b, l, R, h)))
  a_rows = flat(jnp.concatenate([a[:, :, None], jnp.zeros((b, l, R - 1, h), _F32)], axis=2))
  # The entering state with the carried term of position -1 absorbed (as ssd3_chunked).
  v_prev = ssd3._values(x_prev.astype(_F32), None if x_proj is None else x_proj.astype(_F32), R)  # (b, h, R, p)
  k_prev = jnp.repeat((k_prev[:, None] if B.ndim == 4 else k_prev).astype(_F32), r, axis=2)  # (b, R, h, n)
  init = state0.astype(_F32) + carried[:, 0, :, None, None] * jnp.einsum(
      "bhjp,bjhn->bhpn", v_prev, k_prev, precision=jax.lax.Precision.HIGHEST)

  Qr = chunk_size * R
  # to_chunks pads with zero scale and input; its log decay (dt A per head) is not
  # this scan's (per position), so A = 0 there and the decay's rows are laid out here.
  xc, wc, _, Bc, Cc, init_c = to_chunks(v_rows, w_rows, jnp.zeros((h,), _F32), flat(Bk), flat(Cq), Qr, init,
                                        positions_minor=True)
  nc = xc.shape[0]
  ac = jnp.pad(a_rows, [(0, 0), (0, nc * Qr - l * R), (0, 0)]).reshape(b, nc, Qr, g, r).transpose(1, 0, 3, 4, 2)
  Dr = (jnp.zeros((h,), _F32) if D is None else D.astype(_F32)).reshape(g, r)
  masks = ssd_tpu.document_masks(None if seq_idx is None else jnp.repeat(seq_idx, R, axis=1), Qr)
  y, final = ssd_tpu.one_pass(xc, wc, ac, Bc, Cc, init_c, Dr, masks, interpret)
  y = y.transpose(1, 0, 5, 2, 3, 4).reshape(b, nc * Qr, h, p)[:, :l * R].reshape(b, l, R, h, p)

  # The diagonal correction: each position's own R x R block at lam dt, not w [j <= i].
  # R x R per position and head: as broadcasts and sums, which XLA fuses (as batched
  # dots of R x n by n x R they are MXU-shaped work of no size, and libtpu's compile of
  # their backward ran ~40 CPU-s at rank 4).
  qk = jnp.sum(Cq[:, :, :, None].astype(_F32) * Bk[:, :, None].astype(_F32), axis=-1)  # (b, l, i, j, g)
  reads = jnp.tril(jnp.ones((R, R), _F32))  # what the kernel's causal mask let through
  coef = gamma[:, :, None, None] - w[:, :, None, None] * reads[..., None]  # (b, l, i, j, h)
  coef = coef * jnp.repeat(qk, r, axis=-1)
  vj = jnp.swapaxes(v, 2, 3).astype(_F32)  # (b, l, j, h, p)
  corr = jnp.sum(coef[..., None] * vj[:, :, None], axis=3)  # (b, l, i, h, p)
  y = (y.astype(_F32) + corr).astype(cdt)
  if B.ndim == 4:
    y = y[:, :, 0]
  return y, (final.reshape(b, h, p, n), B[:, -1], x[:, -1])
