"""The fused SSD kernels (ops/ssd_tpu.py) against the XLA form (`ssd.ssd_chunked`):
on CPU in Pallas' interpreter, forward and gradients in float32, with documents
(seq_idx), initial states, ragged lengths and 1 or 3 groups; the model run by
them against the model run by XLA; and the kernels compiled for TPU v6e and v5p
through libtpu (no TPU needed), so Mosaic's tiling rules are checked here."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.ops import ssd, ssd_tpu

from helpers import libtpu_compiles, packed_ids, rel, ssd_inputs
from kernel_checks import assert_model_matches_xla


def _loss(fn, chunk, kw):
  # A weighted sum of every output, so each output's gradient is checked.
  def loss(x, dt, A, B, C, D, h0, wy, ws):
    y, s = fn(x, dt, A, B, C, chunk, D=D, initial_state=h0, seq_idx=kw.get("seq_idx"))
    return jnp.sum(y * wy) + jnp.sum(s * ws), (y, s)
  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))


# (l, chunk, groups, heads, documents): ragged lengths (not a multiple of the chunk),
# 1 and 3 groups, 8 heads a group (the kernels' head block), packed documents.
CASES = [(37, 8, 3, 6, True), (40, 16, 1, 8, False)]


@pytest.mark.parametrize("l,q,g,h,docs", CASES)
def test_fused_matches_xla_forward_and_gradients(l, q, g, h, docs):
  x, dt, A, B, C, D, h0 = ssd_inputs(l, 2, l, h, 4, g, 5, jnp.float32)
  kw = {"seq_idx": packed_ids(l, 2, l)} if docs else {}
  k1, k2 = jax.random.split(jax.random.PRNGKey(l))
  wy, ws = jax.random.normal(k1, x.shape), jax.random.normal(k2, h0.shape)
  fused = lambda *a, **k: ssd_tpu.ssd_fused(*a, **k, interpret=True)
  xla = lambda *a, **k: ssd.ssd_chunked(*a, **k, form="parallel")
  (v1, (y1, s1)), g1 = _loss(fused, q, kw)(x, dt, A, B, C, D, h0, wy, ws)
  (v2, (y2, s2)), g2 = _loss(xla, q, kw)(x, dt, A, B, C, D, h0, wy, ws)
  assert y1.shape == x.shape and s1.shape == h0.shape and y1.dtype == x.dtype
  assert rel(y1, y2) < 1e-5 and rel(s1, s2) < 1e-5
  for name, a, b in zip("x dt A B C D h0".split(), g1, g2):
    assert rel(a, b) < 1e-5, name
  if docs:  # documents really cut the state: a changed first document leaves the last alone
    fwd = jax.jit(lambda x: fused(x, dt, A, B, C, q, D=D, **kw)[0])
    y3, y4 = fwd(x.at[:, 0].add(1.0)), fwd(x)
    last = np.asarray(kw["seq_idx"]) == np.asarray(kw["seq_idx"])[:, -1:]
    np.testing.assert_array_equal(np.asarray(y3)[last], np.asarray(y4)[last])
    assert not np.array_equal(np.asarray(y3)[~last], np.asarray(y4)[~last])


def test_one_pass_carries_the_state_across_chunks_and_documents():
  """The one-pass forward (the state carried from chunk to chunk on chip) and its
  backward kernel (the chunks in reverse, the state's cotangent carried) against
  `ssd_chunked`: 6 chunks (the last ragged), an initial
  state, documents that start mid-chunk, exactly at a chunk start, and span whole
  chunks (row 0), and one document through every chunk (row 1); 2 groups of 16
  heads (two head blocks, so the partial B and C gradients are summed)."""
  l, q, g, h = 45, 8, 2, 32
  x, dt, A, B, C, D, h0 = ssd_inputs(7, 2, l, h, 2, g, 3, jnp.float32)
  seq = np.zeros((2, l), np.int32)
  seq[0, 3:], seq[0, 16:], seq[0, 37:] = 1, 2, 3  # doc 2: chunk 2's start to mid chunk 4
  seq = jnp.asarray(seq)
  k1, k2 = jax.random.split(jax.random.PRNGKey(8))
  wy, ws = jax.random.normal(k1, x.shape), jax.random.normal(k2, h0.shape)
  ins = (x, dt, A, B, C, D, h0, wy, ws)

  def loss(fn, seq, x, dt, A, B, C, D, h0, wy, ws):
    y, s = fn(x, dt, A, B, C, q, D=D, initial_state=h0, seq_idx=seq)
    return jnp.sum(y * wy) + jnp.sum(s * ws), (y, s)

  grad = lambda fn, seq, *a: jax.value_and_grad(functools.partial(loss, fn, seq), argnums=tuple(range(7)),
                                                 has_aux=True)(*a)
  one = jax.jit(functools.partial(grad, functools.partial(ssd_tpu.ssd_fused, interpret=True)))
  ref = jax.jit(functools.partial(grad, functools.partial(ssd.ssd_chunked, form="parallel")))
  (_, (y1, s1)), g1 = one(seq, *ins)
  (_, (y3, s3)), g3 = ref(seq, *ins)
  assert rel(y1, y3) < 1e-5 and rel(s1, s3) < 1e-5
  for name, a, b in zip("x dt A B C D h0".split(), g1, g3):
    assert rel(a, b) < 1e-5, name
  # The carry really is cut: without documents the outputs differ after the first start.
  (_, (y4, _)), _ = one(jnp.zeros_like(seq), *ins)
  np.testing.assert_array_equal(np.asarray(y4)[1], np.asarray(y1)[1])
  assert not np.allclose(np.asarray(y4)[0, 3:], np.asarray(y1)[0, 3:])


@pytest.mark.parametrize("length", [48, 40], ids=["whole-chunks", "ragged"])
def test_model_with_fused_ssd_matches_xla_model(length):
  """Tiny model over packed documents, logits and parameter gradients: ssd_impl
  'interpret' (the kernels) against 'xla' in the parallel form at the same chunk. At a
  whole number of chunks the mixer hands x to the kernels, and takes y back, in their
  chunk-major layout (layout constraints); a ragged length pads the last chunk."""
  from mamba_train import Runtime, config_for
  assert_model_matches_xla(config_for("tiny", n_layer=1, chunk_size=16),
                           Runtime(ssd_impl="interpret", ssd_form="parallel"),
                           Runtime(ssd_impl="xla", ssd_form="parallel"), length)


_AOT = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import tpu_devices
from mamba_train.ops.ssd_tpu import ssd_fused
from mamba_train.ops.ssd3_tpu import ssd3_fused
for topo in sys.argv[1:]:
  rep = NamedSharding(Mesh(np.array(tpu_devices(topo)[2][:1]), ("d",)), P())
  S = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)
  b, l, h, p, g, n = 1, 256, 8, 64, 1, 128  # the 2.7b's head and state sizes, chunk 128
  args = (S((b, l, h, p), jnp.bfloat16), S((b, l, h)), S((h,)), S((b, l, g, n), jnp.bfloat16),
          S((b, l, g, n), jnp.bfloat16), S((h,)), S((b, h, p, n)), S((b, l), jnp.int32))
  def loss(x, dt, A, B, C, D, h0, seq):
    y, s = ssd_fused(x, dt, A, B, C, 128, D=D, initial_state=h0, seq_idx=seq)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s)
  step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))  # forward + backward
  hlo = step.lower(*args).compile().as_text()
  # The one-pass forward that saves the entering states and its reverse-chunk
  # backward kernel.
  for kernel in ("ssd_one_pass_save", "ssd_one_pass_bwd"):
    assert kernel in hlo, kernel + " missing"
  # The forward alone: the one-pass kernel (its sequential chunk axis, the state
  # carried in VMEM).
  fwd = jax.jit(lambda *a: ssd_fused(*a[:5], 128, D=a[5], initial_state=a[6], seq_idx=a[7]))
  assert "ssd_one_pass" in fwd.lower(*args).compile().as_text(), "kernel missing"
  if topo.startswith("v6e"):
    # Mamba-3's scan on the same kernels (ops/ssd3_tpu.py), forward and backward: 8
    # heads with their own B and C, bfloat16, documents; MIMO rank 4 at chunk 16 (64
    # rows a chunk: SISO at chunk 64 gives the kernels the same blocks).
    for rank, q in ((4, 16),):
      bc = (b, l, h, n) if rank is None else (b, l, rank, h, n)
      cache = (S((b, h, p, n)), S(bc[:1] + bc[2:], jnp.bfloat16), S((b, h, p), jnp.bfloat16))
      args3 = (S((b, l, h, p), jnp.bfloat16), S((b, l, h)), S((b, l, h)), S((b, l, h)), S(bc, jnp.bfloat16),
               S(bc, jnp.bfloat16), S((h,)), None if rank is None else S((h, rank, p)), cache,
               S((b, l), jnp.int32))
      def loss3(x, dt, A, lam, B, C, D, xp, cache, seq, q=q):
        y, (s, _, _) = ssd3_fused(x, dt, A, lam, B, C, q, D=D, x_proj=xp, initial=cache, seq_idx=seq)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s)
      hlo = jax.jit(jax.value_and_grad(loss3, argnums=tuple(range(9)))).lower(*args3).compile().as_text()
      for kernel in ("ssd_one_pass_save", "ssd_one_pass_bwd"):
        assert kernel in hlo, "Mamba-3: " + kernel + " missing"
  print("compiled", topo)
"""


def test_fused_ssd_compiles_for_tpu_v6e_and_v5p():
  """Mamba-2's kernels for v6e and v5p, and Mamba-3's scan on them for v6e
  (one process for both, its start-up paid once)."""
  libtpu_compiles(_AOT, ("v6e:1x1", "v5p:2x2x1"))
