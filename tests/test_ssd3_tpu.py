"""Mamba-3's scan on the TPU kernels (ops/ssd3_tpu.py) against its plain chunked form
(`ssd3.ssd3_chunked`), in Pallas' interpreter on CPU: float32 outputs, final cache and
every gradient (x, dt, A, lam, B, C, D, x_proj, the incoming cache) at 1e-5; SISO and
MIMO ranks 1 and 2 over packed documents, an incoming cache, ragged lengths, several
chunks and head blocks; bfloat16 within the plain form's own error; the selection
table's choice. test_ssd_pallas's compile test also compiles them for TPU v6e through
libtpu (no TPU needed; one process for both, its start-up paid once).

Interpret mode is slow to trace: tiny shapes, one compile per case."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.ops import ssd3, ssd3_tpu

from helpers import rel, ssd3_inputs

P, N = 3, 5


def _inputs(seed, rank, g, h, l, dtype=jnp.float32, b=2):
  return ssd3_inputs(seed, rank, g, h, l, P, N, dtype, b)


def _grad(fn, chunk, seq_idx, wy, ws):
  """value_and_grad of a weighted sum of y and the final state, to every input."""
  def loss(x, dt, A, lam, B, C, D, xp, cache):
    y, (s, k, v) = fn(x, dt, A, lam, B, C, chunk, D=D, x_proj=xp, initial=cache, seq_idx=seq_idx)
    return jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(s * ws), (y, s, k, v)
  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(9)), has_aux=True))


_KERNEL = functools.partial(ssd3_tpu.ssd3_fused, interpret=True)

# (rank, groups, heads, length, chunk, documents): SISO with 16 heads in one group (two
# head blocks of 8) over packed documents whose boundaries fall mid-chunk and on a chunk
# boundary; MIMO rank 2 (per-head B and C as the model gives them) over documents;
# MIMO rank 1 (x_proj, no documents). Lengths ragged: 13 at chunk 4 is three chunks
# and a tail, so the look-ahead crosses chunk boundaries and padding is exercised.
CASES = [(None, 1, 16, 13, 4, True), (2, 2, 2, 11, 4, True), (1, 2, 4, 13, 4, False)]


@pytest.mark.parametrize("rank,g,h,l,q,docs", CASES, ids=["siso-docs", "mimo2-docs", "mimo1"])
def test_kernel_matches_plain_values_and_gradients(rank, g, h, l, q, docs):
  args = _inputs(0, rank, g, h, l)
  # Document 0 to position 4, 1 to 7 (its end a chunk boundary), 2 after; the second
  # row one document from the start plus one from 9.
  seq = jnp.array([[0] * 4 + [1] * 4 + [2] * (l - 8), [0] * 9 + [1] * (l - 9)]) if docs else None
  ky, ks = jax.random.split(jax.random.PRNGKey(1))
  y_shape = (2, l, h, P) if rank is None else (2, l, rank, h, P)
  wy, ws = jax.random.normal(ky, y_shape), jax.random.normal(ks, (2, h, P, N))
  (_, out1), g1 = _grad(_KERNEL, q, seq, wy, ws)(*args)
  (_, out2), g2 = _grad(ssd3.ssd3_chunked, q, seq, wy, ws)(*args)
  assert out1[0].shape == y_shape and out1[1].dtype == jnp.float32
  for a, b in zip(out1, out2):  # y, state, last k, last x
    assert rel(a, b) < 1e-5
  names = ("x", "dt", "A", "lam", "B", "C", "D") + ("x_proj",) * (rank is not None) + ("state", "k", "x_prev")
  assert len(names) == len(jax.tree.leaves(g1))
  for name, a, b in zip(names, jax.tree.leaves(g1), jax.tree.leaves(g2)):
    assert float(jnp.abs(b).max()) > 0, name  # every input reaches the loss
    assert rel(a, b) < 1e-5, name


def test_kernel_bfloat16_within_the_plain_forms_error():
  """bfloat16 inputs (MIMO rank 2, where the diagonal correction is an R x R block):
  the kernel's output deviates from the float64 recurrence on the same rounded inputs
  by no more than 1.5 times the plain chunked form's deviation in bfloat16. The one
  departure from the plain form (the correction added to y, not to the weights)
  leaves the error at the plain form's scale."""
  rank, g, h, l, q = 2, 2, 2, 11, 4
  x, dt, A, lam, B, C, D, xp, cache = _inputs(2, rank, g, h, l)
  bf = lambda t: t.astype(jnp.bfloat16)
  cache_bf = (cache[0], bf(cache[1]), bf(cache[2]))
  run = lambda fn: jax.jit(lambda *a: fn(*a, q, D=D, x_proj=xp, initial=cache_bf)[0])(bf(x), dt, A, lam,
                                                                                       bf(B), bf(C))
  y_kernel, y_plain = run(_KERNEL), run(ssd3.ssd3_chunked)
  assert y_kernel.dtype == jnp.bfloat16
  with jax.enable_x64(True):
    f64 = lambda t: jnp.asarray(np.asarray(t.astype(jnp.float32)), jnp.float64)
    y_ref, _ = ssd3.ssd3_sequential(*(f64(t) for t in (x, dt, A, lam, bf(B), bf(C))), D=f64(D), x_proj=f64(xp),
                                    initial=tuple(f64(t) for t in cache_bf))
    err = lambda y: float(rel(f64(y), y_ref))
    assert 0 < err(y_kernel) <= 1.5 * err(y_plain)


def test_table_picks_the_kernel_for_mamba3():
  """ssd_impl 'mosaic' (and 'auto' on TPU) runs Mamba-3's scan in the kernel; a split
  sequence and the GPU's 'triton' take the plain form, each with its reason."""
  from mamba_train import Runtime, config_for
  from mamba_train.ops import table
  cfg = config_for("tiny", layer_pattern="3", n_layer=1)
  rt = Runtime().resolve("tpu")
  ops = table.build(rt, cfg)
  assert ops.chose("ssd3") == "mosaic" and ops.ssd3.func is ssd3_tpu.ssd3_fused
  stub = lambda *a, **k: None  # a split sequence's maps, not run here
  split = table.build(rt, cfg, table.Mesh(sequence=types.SimpleNamespace(ssd=stub, ssd3=stub, conv=stub), active=True))
  assert ("ssd3", "xla", "mosaic takes no split sequence (the 'sequence' mesh axis)") in split.choices
  gpu = table.build(Runtime(ssd_impl="triton").resolve("gpu"), cfg)
  assert ("ssd3", "xla", "triton has no Mamba-3 form") in gpu.choices
  assert table.build(Runtime().resolve("cpu"), cfg).chose("ssd3") == "xla"
