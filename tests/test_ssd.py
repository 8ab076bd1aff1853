"""The chunked SSD scan against the sequential recurrence, in float64 and float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.ops import ssd

from helpers import packed_ids, rel, ssd_inputs

# Jitted once per module: eager op-by-op dispatch compiles every primitive anew.
ssd_chunked = jax.jit(ssd.ssd_chunked, static_argnums=5, static_argnames="form")
ssd_sequential = jax.jit(ssd.ssd_sequential)
ssd_step = jax.jit(ssd.ssd_step)
segsum = jax.jit(ssd.segsum)
segsums = jax.jit(ssd._segsums, static_argnums=1)
# Both ways of combining chunks: 'scan' (the CPU default) and 'parallel' (accelerators).
FORMS = ["scan", "parallel"]


# (l, chunk, groups): below, equal to, and not a multiple of the chunk; several chunks; g > 1.
# Each distinct (shape, options) trace costs a compile of both forms, so the options
# are spread over the shapes rather than crossed with them.
F64_CASES = [((5, 8, 1), "both"), ((8, 8, 1), "plain"), ((37, 8, 3), "plain"),
             ((37, 8, 3), "initial_state"), ((37, 8, 3), "seq_idx"), ((37, 8, 3), "both"),
             ((64, 16, 2), "both"), ((160, 128, 1), "both")]  # chunk 128: two-level segment sums


def _kwargs(option, h0, seq):
  return {"plain": {}, "initial_state": dict(initial_state=h0), "seq_idx": dict(seq_idx=seq),
          "both": dict(initial_state=h0, seq_idx=seq)}[option]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case,option", F64_CASES)
def test_chunked_matches_sequential_float64(case, option, form):
  l, q, g = case
  with jax.enable_x64(True):
    x, dt, A, B, C, D, h0 = ssd_inputs(l, 2, l, 6, 4, g, 5, jnp.float64)
    kw = _kwargs(option, h0, packed_ids(l, 2, l))
    y1, s1 = ssd_chunked(x, dt, A, B, C, q, D=D, form=form, **kw)
    y2, s2 = ssd_sequential(x, dt, A, B, C, D=D, **kw)
    assert y1.dtype == jnp.float64
    assert rel(y1, y2) < 1e-10
    assert rel(s1, s2) < 1e-10


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("l,q,g", [(100, 32, 2)])
def test_chunked_matches_sequential_float32(l, q, g, form):
  x, dt, A, B, C, D, h0 = ssd_inputs(l, 2, l, 6, 4, g, 5, jnp.float32)
  seq = packed_ids(l + 1, 2, l)
  y1, s1 = ssd_chunked(x, dt, A, B, C, q, D=D, initial_state=h0, seq_idx=seq, form=form)
  with jax.enable_x64(True):
    f64 = lambda t: jnp.asarray(np.asarray(t, np.float64))
    y2, s2 = ssd_sequential(*map(f64, (x, dt, A, B, C)), D=f64(D), initial_state=f64(h0), seq_idx=seq)
  assert rel(y1, y2) < 1e-5
  assert rel(s1, s2) < 1e-5


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("option", ["both"])  # the plain path's gradients: test_gradients_float32
def test_gradients_match_sequential_float64(option, form):
  l, q, g = 45, 16, 2
  with jax.enable_x64(True):
    x, dt, A, B, C, D, h0 = ssd_inputs(3, 2, l, 4, 3, g, 5, jnp.float64)
    seq = packed_ids(4, 2, l)
    wy = jax.random.normal(jax.random.PRNGKey(9), x.shape, jnp.float64)
    ws = jax.random.normal(jax.random.PRNGKey(10), h0.shape, jnp.float64)

    def loss(fn, x, dt, A, B, C, D, h0):
      kw = _kwargs(option, h0, seq)
      y, s = fn(x, dt, A, B, C, D=D, **kw)
      return jnp.sum(y * wy) + jnp.sum(s * ws)

    chunked = lambda *a, **k: ssd.ssd_chunked(*a, q, form=form, **k)
    args = (x, dt, A, B, C, D, h0)
    g1 = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=tuple(range(7))))(*args)
    g2 = jax.jit(jax.grad(lambda *a: loss(ssd.ssd_sequential, *a), argnums=tuple(range(7))))(*args)
    names = ["x", "dt", "A", "B", "C", "D", "h0"]
    for name, a, b in zip(names, g1, g2):
      if option in ("plain", "seq_idx") and name == "h0":
        continue  # unused: both gradients are zero
      assert np.all(np.isfinite(np.asarray(a))), name
      assert rel(a, b) < 1e-10, name


@pytest.mark.parametrize("form", FORMS)
def test_gradients_float32(form):
  x, dt, A, B, C, D, h0 = ssd_inputs(5, 2, 70, 4, 8, 1, 16, jnp.float32)
  f = lambda fn: jax.jit(jax.grad(
      lambda x, dt, B: jnp.sum(fn(x, dt, A, B, C, D=D, initial_state=h0)[0] ** 2),
      argnums=(0, 1, 2)))(x, dt, B)
  g1 = f(lambda *a, **k: ssd.ssd_chunked(*a, 32, form=form, **k))
  g2 = f(ssd.ssd_sequential)
  for a, b in zip(g1, g2):
    assert rel(a, b) < 1e-5


def test_seq_idx_equals_documents_run_alone():
  """A packed row gives, document by document, what each document gives alone."""
  lengths = [11, 18, 30]  # starts at 11 and 29: mid-chunk for chunk 16
  l, longest = sum(lengths), max(lengths)
  x, dt, A, B, C, D, _ = ssd_inputs(7, 1, l, 4, 4, 2, 8, jnp.float32)
  seq = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
  y, final = ssd_chunked(x, dt, A, B, C, 16, D=D, seq_idx=seq)
  # Each document alone, as one row of a batch, padded at its end (the scan is
  # causal, so end padding cannot change its outputs; the last one is unpadded).
  starts = np.cumsum([0] + lengths[:-1])
  def alone(t):
    rows = [jnp.pad(t[0, s:s + n], [(0, longest - n)] + [(0, 0)] * (t.ndim - 2))
            for s, n in zip(starts, lengths)]
    return jnp.stack(rows)
  y_alone, f_alone = ssd_chunked(alone(x), alone(dt), A, alone(B), alone(C), 16, D=D)
  for i, (s, n) in enumerate(zip(starts, lengths)):
    assert rel(y[0, s:s + n], y_alone[i, :n]) < 1e-5
  assert rel(final[0], f_alone[-1]) < 1e-5  # the final state is the last document's


def test_padding_cannot_change_state():
  """A length that is not a multiple of the chunk: the final state is the true one."""
  x, dt, A, B, C, D, _ = ssd_inputs(8, 1, 21, 2, 4, 1, 4, jnp.float32)
  _, s_short = ssd_chunked(x, dt, A, B, C, 16)
  _, s_seq = ssd_sequential(x, dt, A, B, C)
  assert rel(s_short, s_seq) < 1e-5


def test_step_continues_the_scan():
  x, dt, A, B, C, D, h0 = ssd_inputs(11, 2, 9, 4, 3, 2, 5, jnp.float32)
  y_ref, s_ref = ssd_sequential(x, dt, A, B, C, D=D, initial_state=h0)
  state = h0
  for t in range(x.shape[1]):
    y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=D)
    assert rel(y, y_ref[:, t]) < 1e-5
  assert rel(state, s_ref) < 1e-5


def test_segsum_is_stable_where_differences_of_cumsums_are_not():
  """Why segsum accumulates masked copies: at chunk 256 in float32 the difference
  form cumsum[i] - cumsum[j] loses the small dt*A terms against the large running sum."""
  rng = np.random.RandomState(0)
  a64 = -rng.uniform(0.0, 0.5, size=(4, 256))  # typical dt*A, all negative
  with jax.enable_x64(True):
    ref = np.asarray(jnp.exp(segsum(jnp.asarray(a64))))
  a32 = jnp.asarray(a64, jnp.float32)
  stable = np.asarray(jnp.exp(segsum(a32)))
  cs = jnp.cumsum(a32, axis=-1)
  diff = np.asarray(jnp.exp(jnp.where(jnp.tril(jnp.ones((256, 256), bool)),
                                      cs[..., :, None] - cs[..., None, :], -jnp.inf)))
  err_stable = np.max(np.abs(stable - ref))
  err_diff = np.max(np.abs(diff - ref))
  assert err_stable < 1e-6
  assert err_diff > 10 * err_stable
  # The forms the chunked scan uses (two-level, and one matmul) are as stable, and
  # their prefix sums match.
  for two_level in (True, False):
    seg, cs = segsums(a32, two_level)
    mm = np.asarray(jnp.where(jnp.tril(jnp.ones((256, 256), bool)), jnp.exp(seg), 0.0))
    assert np.max(np.abs(mm - ref)) < 1e-6
    assert np.max(np.abs(np.asarray(cs) - np.cumsum(a64, -1))) < 1e-4


def test_decay_must_stay_float32():
  """In bfloat16 the decay's cumulative sums lose the small dt*A steps: the decay
  matrix is off by percents, three orders of magnitude worse than in float32."""
  rng = np.random.RandomState(1)
  a64 = -rng.uniform(0.0, 0.05, size=(4, 128))
  with jax.enable_x64(True):
    ref = np.asarray(jnp.exp(segsum(jnp.asarray(a64))))
  err32 = np.max(np.abs(np.asarray(jnp.exp(segsum(jnp.asarray(a64, jnp.float32)))) - ref))
  err16 = np.max(np.abs(np.asarray(jnp.exp(segsum(jnp.asarray(a64, jnp.bfloat16))), np.float64) - ref))
  assert err32 < 1e-6
  assert err16 > 1e-3
  assert err16 > 1000 * err32
