"""Mamba-3's chunked exponential-trapezoidal scan against its sequential recurrence
(float64 and float32, values and gradients), against Mamba-2's SSD at lam = 1, and
decoding continued from its final cache.

Tiny shapes and few traces: every distinct (shape, dtype, options) costs a compile.
Lengths are ragged (13 with chunk 4: three whole chunks and a tail) so the
look-ahead crosses chunk boundaries and the padding's zero look-ahead is exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np

from mamba_train.ops import ssd, ssd3

from helpers import rel, ssd3_inputs

chunked = jax.jit(ssd3.ssd3_chunked, static_argnums=6)
sequential = jax.jit(ssd3.ssd3_sequential)
step = jax.jit(ssd3.ssd3_step)

L, Q, H, P, N = 13, 4, 4, 3, 5


def _inputs(seed, rank, g, dtype, l=L, b=2):
  return ssd3_inputs(seed, rank, g, H, l, P, N, dtype, b)


def test_chunked_matches_sequential_float64_values_and_gradients():
  """MIMO rank 2, two groups of two heads, with an incoming state and a carried
  (k, x): outputs, the final cache and the gradients of a weighted sum of both, to
  every input, at float64 rounding. (SISO is the rank-1 case plus reshapes; its
  values are held in float32 below. One case: each gradient trace costs ~1 s.)"""
  rank, g = 2, 2
  with jax.enable_x64(True):
    x, dt, A, lam, B, C, D, xp, cache = _inputs(0, rank, g, jnp.float64)
    ky, ks = jax.random.split(jax.random.PRNGKey(1))
    y_shape = x.shape if rank is None else x.shape[:2] + (rank,) + x.shape[2:]
    wy, ws = jax.random.normal(ky, y_shape, jnp.float64), jax.random.normal(ks, cache[0].shape, jnp.float64)

    def loss(fn, x, dt, A, lam, B, C, D, xp, cache):
      y, (s, k, v) = fn(x, dt, A, lam, B, C, D=D, x_proj=xp, initial=cache)
      return jnp.sum(y * wy) + jnp.sum(s * ws), (y, s, k, v)

    args = (x, dt, A, lam, B, C, D, xp, cache)
    grad = lambda fn: jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=tuple(range(9)), has_aux=True))
    (_, out1), g1 = grad(lambda *a, **k: ssd3.ssd3_chunked(*a, Q, **k))(*args)
    (_, out2), g2 = grad(ssd3.ssd3_sequential)(*args)
    assert out1[0].shape == y_shape and out1[0].dtype == jnp.float64
    for a, b in zip(out1, out2):  # y, state, last k, last x
      assert rel(a, b) < 1e-10
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      assert rel(a, b) < 1e-10


def test_chunked_matches_sequential_float32():
  """float32 against the float64 recurrence: SISO, incoming cache, ragged length."""
  x, dt, A, lam, B, C, D, _, cache = _inputs(2, None, 2, jnp.float32)
  y1, (s1, _, _) = chunked(x, dt, A, lam, B, C, Q, D=D, initial=cache)
  with jax.enable_x64(True):
    f64 = lambda t: jnp.asarray(np.asarray(t, np.float64))
    y2, (s2, _, _) = sequential(*map(f64, (x, dt, A, lam, B, C)), D=f64(D),
                                initial=jax.tree.map(f64, cache))
  assert y1.dtype == jnp.float32
  assert rel(y1, y2) < 1e-5
  assert rel(s1, s2) < 1e-5


def test_lam_one_is_mamba2():
  """lam = 1 drops the trapezoid's carried term: Mamba-2's SSD on the same inputs
  (A constant over tokens), whatever (k, x) the cache carries. float32, so the
  chunked trace is the float32 test's; a wrong convention would be off by O(1)."""
  x, dt, A, _, B, C, D, _, (h0, k0, x0) = _inputs(3, None, 2, jnp.float32)
  A_head = A[0, 0]
  y1, (s1, _, _) = chunked(x, dt, jnp.broadcast_to(A_head, A.shape), jnp.ones_like(dt), B, C, Q,
                           D=D, initial=(h0, k0, x0))
  y2, s2 = jax.jit(ssd.ssd_chunked, static_argnums=5)(x, dt, A_head, B, C, Q, D=D, initial_state=h0)
  assert rel(y1, y2) < 1e-5
  assert rel(s1, s2) < 1e-5


def test_decode_continues_chunked():
  """The chunked cache after l - 3 positions (from an incoming cache), then three
  `ssd3_step`s, gives the chunked outputs and cache of the whole sequence (SISO,
  float32; the whole sequence's trace is the float32 test's)."""
  x, dt, A, lam, B, C, D, _, cache = _inputs(4, None, 2, jnp.float32)
  y_full, (s_full, k_full, x_full) = chunked(x, dt, A, lam, B, C, Q, D=D, initial=cache)
  m = L - 3
  head = lambda t: t[:, :m]
  _, cache = chunked(*map(head, (x, dt, A, lam, B, C)), Q, D=D, initial=cache)
  ys = []
  for t in range(m, L):
    y, cache = step(cache, x[:, t], dt[:, t], A[:, t], lam[:, t], B[:, t], C[:, t], D=D)
    ys.append(y)
  assert rel(jnp.stack(ys, 1), y_full[:, m:]) < 1e-5
  assert rel(cache[0], s_full) < 1e-5
  np.testing.assert_array_equal(cache[1], k_full)
  np.testing.assert_array_equal(cache[2], x_full)


def test_rank_one_is_siso():
  """MIMO of rank 1 on x is SISO on the projected values x * x_proj[:, 0] (the state,
  the carried x and D all see the projected value), with B and C's rank axis dropped:
  outputs and state agree to float32 rounding; and both are the float64 recurrence's
  (1e-5). The SISO call is the float32 test's trace."""
  x, dt, A, lam, B, C, D, xp, (h0, k0, x0) = _inputs(5, 1, 2, jnp.float32)
  y1, (s1, k1, x1) = chunked(x, dt, A, lam, B, C, Q, D=D, x_proj=xp, initial=(h0, k0, x0))
  proj = lambda t: t * xp[:, 0]
  y2, (s2, k2, _) = chunked(proj(x), dt, A, lam, B[:, :, 0], C[:, :, 0], Q, D=D,
                            initial=(h0, k0[:, 0], proj(x0)))
  assert y1.shape == (2, L, 1, H, P)
  assert rel(y1[:, :, 0], y2) < 1e-6
  assert rel(s1, s2) < 1e-6
  np.testing.assert_array_equal(k1[:, 0], k2)
  np.testing.assert_array_equal(x1, x[:, -1])  # MIMO's cache keeps the raw x
  with jax.enable_x64(True):
    f64 = lambda t: jnp.asarray(np.asarray(t, np.float64))
    y3, (s3, _, _) = sequential(*map(f64, (x, dt, A, lam, B, C)), D=f64(D), x_proj=f64(xp),
                                initial=tuple(map(f64, (h0, k0, x0))))
  assert rel(y1, y3) < 1e-5
  assert rel(s1, s3) < 1e-5
