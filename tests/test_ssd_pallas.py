"""The fused SSD kernels (model/ssd_pallas.py) against the XLA form (`ssd.ssd_chunked`):
on CPU in Pallas' interpreter, forward and gradients in float32, with documents
(seq_idx), initial states, ragged lengths and 1 or 3 groups; the model run by
them against the model run by XLA; and the kernels compiled for TPU v6e and v5p
through libtpu (no TPU needed), so Mosaic's tiling rules are checked here."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.model import ssd, ssd_pallas
from test_ssd import make_inputs, packed_ids, rel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  x, dt, A, B, C, D, h0 = make_inputs(l, 2, l, h, 4, g, 5, jnp.float32)
  kw = {"seq_idx": packed_ids(l, 2, l)} if docs else {}
  k1, k2 = jax.random.split(jax.random.PRNGKey(l))
  wy, ws = jax.random.normal(k1, x.shape), jax.random.normal(k2, h0.shape)
  fused = lambda *a, **k: ssd_pallas.ssd_fused(*a, **k, interpret=True)
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
  """The one-pass forward (the state carried from chunk to chunk on chip) against
  `ssd_chunked` and the two-kernel forward: 6 chunks (the last ragged), an initial
  state, documents that start mid-chunk, exactly at a chunk start, and span whole
  chunks (row 0), and one document through every chunk (row 1)."""
  l, q, g, h = 45, 8, 2, 4
  x, dt, A, B, C, D, h0 = make_inputs(7, 2, l, h, 4, g, 5, jnp.float32)
  seq = np.zeros((2, l), np.int32)
  seq[0, 3:], seq[0, 16:], seq[0, 37:] = 1, 2, 3  # doc 2: chunk 2's start to mid chunk 4
  seq = jnp.asarray(seq)

  @jax.jit
  def run(x, dt, A, B, C, D, h0, seq):
    kw = {"D": D, "initial_state": h0, "seq_idx": seq}
    return [ssd_pallas.ssd_fused(x, dt, A, B, C, q, **kw, interpret=True, one_pass=o) for o in (True, False)] + [
        ssd.ssd_chunked(x, dt, A, B, C, q, **kw, form="parallel")]

  (y1, s1), (y2, s2), (y3, s3) = run(x, dt, A, B, C, D, h0, seq)
  assert rel(y1, y3) < 1e-5 and rel(s1, s3) < 1e-5
  assert rel(y2, y3) < 1e-5 and rel(s2, s3) < 1e-5
  # The carry really is cut: without documents the outputs differ after the first start.
  y4, _ = run(x, dt, A, B, C, D, h0, jnp.zeros_like(seq))[0]
  np.testing.assert_array_equal(np.asarray(y4)[1], np.asarray(y1)[1])
  assert not np.allclose(np.asarray(y4)[0, 3:], np.asarray(y1)[0, 3:])


def test_model_with_fused_ssd_matches_xla_model():
  """Tiny model, logits and parameter gradients: ssd_impl 'interpret' (the kernels)
  against 'xla' in the parallel form at the same chunk."""
  from flax import nnx
  from mamba_train import Mamba2LM, Runtime, config_for
  cfg = config_for("tiny", n_layer=1, chunk_size=16)
  ids = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)
  seq = packed_ids(3, 2, 40)
  params = Mamba2LM(cfg, rngs=nnx.Rngs(0)).params()

  def run(impl):
    rt = Runtime(ssd_impl=impl, ssd_form="parallel")
    def loss(p):
      logits = Mamba2LM.from_params(cfg, p, rt)(ids, seq_idx=seq)
      return jnp.mean(jax.nn.logsumexp(logits, -1)), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, l1), g1 = run("interpret")
  (_, l2), g2 = run("xla")
  assert rel(l1, l2) < 1e-5
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g2)):
    assert rel(a, b) < 1e-5, path


def _chunk_inputs(docs):
  """Chunk-layout inputs of the two kernels: 2 chunks of 8, 3 groups of 16 heads (two
  head blocks of 8, so the in-kernel sums of B and C gradients over head blocks run)."""
  c, b, g, r, p, q, n = 2, 1, 3, 16, 4, 8, 5
  ks = jax.random.split(jax.random.PRNGKey(3), 10)
  xc = jax.random.normal(ks[0], (c, b, g, r, p, q))
  dtc = jax.nn.softplus(jax.random.normal(ks[1], (c, b, g, r, q)) - 1.0)
  ac = dtc * -jnp.exp(jax.random.uniform(ks[2], (g, r, 1), minval=-1.0, maxval=1.5))
  Bc, Cc = jax.random.normal(ks[3], (c, b, g, q, n)), jax.random.normal(ks[4], (c, b, g, q, n))
  init, prev = jax.random.normal(ks[5], (b, g, r, p, n)), jax.random.normal(ks[6], (b, g, r, c + 1, p, n))
  Dr = jax.random.normal(ks[7], (g, r))
  ds, dy = jax.random.normal(ks[8], (b, g, r, c + 1, p, n)), jax.random.normal(ks[9], xc.shape)
  masks = (None,) * 4
  if docs:  # a document ends mid-chunk 0, another starts at chunk 1's first position
    sq = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, 2, 2, 3, 3, 3, 3]])[:, None, :]  # (c, b, s)
    doc_in = jnp.array([[0], [1]])
    keep_in = (sq == doc_in[..., None]).astype(jnp.float32)[:, :, None, :]
    end = (sq == sq[:, :, -1:]).astype(jnp.float32)[:, :, None, :]
    masks = (sq[:, :, None, :], sq[:, :, :, None], keep_in, end)
  return (xc, dtc, ac, Bc, Cc, init, prev, Dr), (ds, dy), masks


@pytest.mark.parametrize("docs", [False, True])
def test_backward_kernels_match_vjp_of_reference(docs):
  """Each backward kernel (through its custom_vjp) against the vjp of its plain-JAX form."""
  (xc, dtc, ac, Bc, Cc, init, prev, Dr), (ds, dy), (row, col, keep_in, end) = _chunk_inputs(docs)

  @jax.jit
  def grads(ds, dy):
    s_in, o_in = (xc, dtc, ac, Bc, init), (xc, dtc, ac, Bc, Cc, prev, Dr)
    s1 = jax.vjp(lambda *a: ssd_pallas._chunk_states(*a, end, True), *s_in)[1](ds)
    s2 = jax.vjp(lambda *a: ssd_pallas._states_ref(*a, end), *s_in)[1](ds)
    o1 = jax.vjp(lambda *a: ssd_pallas._chunk_outputs(*a, row, col, keep_in, True), *o_in)[1](dy)
    o2 = jax.vjp(lambda *a: ssd_pallas._outputs_ref(*a, row, col, keep_in), *o_in)[1](dy)
    return s1, s2, o1, o2

  s1, s2, o1, o2 = grads(ds, dy)
  for name, a, b in zip("x dt a B init".split(), s1, s2):
    assert a.shape == b.shape and a.dtype == b.dtype and rel(a, b) < 1e-5, ("states", name)
  for name, a, b in zip("x dt a B C prev D".split(), o1, o2):
    assert a.shape == b.shape and a.dtype == b.dtype and rel(a, b) < 1e-5, ("outputs", name)


_AOT = """
import re, sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import tpu_devices
from mamba_train.model.ssd_pallas import ssd_fused
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
  # The one-pass forward; the backward recomputes the chunk states with their kernel
  # and runs the two backward kernels (not the vjp of the plain-JAX references).
  for kernel in ("ssd_one_pass", "ssd_chunk_states(?!_bwd)", "ssd_chunk_states_bwd", "ssd_chunk_outputs_bwd"):
    assert re.search(kernel, hlo), kernel + " missing"
  # The forwards alone: the one-pass kernel (its sequential chunk axis, the state
  # carried in VMEM) without the two kernels, and the two-kernel form.
  for one_pass, want, absent in [(True, "ssd_one_pass", "ssd_chunk_states"),
                                 (False, "ssd_chunk_outputs", "ssd_one_pass")]:
    fwd = jax.jit(lambda *a: ssd_fused(*a[:5], 128, D=a[5], initial_state=a[6], seq_idx=a[7],
                                       one_pass=one_pass))
    hlo = fwd.lower(*args).compile().as_text()
    assert want in hlo and absent not in hlo, (one_pass, "kernel missing")
  print("compiled", topo)
"""


def test_fused_ssd_compiles_for_tpu_v6e_and_v5p():
  from test_aot import _require_libtpu
  _require_libtpu()
  # libtpu parses XLA_FLAGS too and aborts on CPU-only flags (conftest's fast-compile set).
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = ROOT
  r = subprocess.run([sys.executable, "-c", _AOT, "v6e:1x1", "v5p:2x2x1"], capture_output=True,
                     text=True, env=env, timeout=600)
  assert r.returncode == 0 and r.stdout.count("compiled") == 2, r.stderr[-3000:]
