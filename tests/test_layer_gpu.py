"""The GPU layer kernels (model/layer_gpu.py, Pallas Triton: the conv + SiLU and the
gated RMSNorm) against their plain forms (model/layer_math.py) in Pallas' interpreter
on CPU: float32 forward and every gradient at 1e-5, ragged lengths over several
program spans, packed documents (the conv never reads across a document boundary),
a front of earlier inputs, several channel axes and groups, bfloat16 judged against
the float32 run's error; and the model with the kernels against the XLA model. Their
compile for sm_90a is in tests/test_ssd_gpu.py (one subprocess for every kernel)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from mamba_train.model import layer_gpu, layer_math

from helpers import packed_ids, rel

_CONV = functools.partial(layer_gpu.causal_conv_silu_gpu, interpret=True)
_NORM = functools.partial(layer_gpu.gated_rms_norm_gpu, interpret=True)


def _conv_inputs(b, l, chan, k, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(l), 6)
  x = jax.random.normal(ks[0], (b, l, *chan)).astype(dtype)
  w = 0.5 * jax.random.normal(ks[1], (k, *chan))
  bias = jax.random.normal(ks[2], chan)
  front = jax.random.normal(ks[3], (b, k - 1, *chan))
  return x, w, bias, front, jax.random.normal(ks[4], x.shape), jax.random.normal(ks[5], front.shape)


def _conv_grads(fn, seq, wy, wf):
  # A weighted sum of both outputs, so every cotangent path is checked.
  def loss(x, w, bias, front):
    y, tail = fn(x, w, bias, front, seq)
    return jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(tail * wf), (y, tail)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


# (l, channels, documents): 300 positions are two program spans of 256 (the second
# ragged) with packed documents and a 24-channel axis padded to 32 inside; 37
# positions over B|C-shaped channels (2, 5); whole spans with no documents.
@pytest.mark.parametrize("l,chan,docs", [(300, (24,), True), (37, (2, 5), True), (256, (16,), False)])
def test_conv_silu_kernel_matches_plain_form(l, chan, docs):
  x, w, bias, front, wy, wf = _conv_inputs(2, l, chan, 4)
  seq = packed_ids(l, 2, l) if docs else None
  (_, (y1, t1)), g1 = _conv_grads(_CONV, seq, wy, wf)(x, w, bias, front)
  (_, (y2, t2)), g2 = _conv_grads(layer_math.causal_conv_silu, seq, wy, wf)(x, w, bias, front)
  assert y1.shape == x.shape and y1.dtype == x.dtype and t1.dtype == jnp.float32
  assert rel(y1, y2) < 1e-5 and rel(t1, t2) == 0.0
  for name, a, b in zip(("x", "w", "bias", "front"), g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name
  if docs:  # an input of another document changes nothing at positions after the boundary
    cut = int(jnp.argmax(seq[0] > seq[0, 0]))
    y3, _ = jax.jit(_CONV)(x.at[0, cut - 1].add(5.0), w, bias, front, seq)
    assert rel(y3[0, cut:], y1[0, cut:]) == 0.0 and rel(y3[0, cut - 1], y1[0, cut - 1]) > 0


def _norm_grads(fn, groups, wo):
  def loss(y, z, w):
    out = fn(y, z, w, groups, 1e-5)
    return jnp.sum(out.astype(jnp.float32) * wo), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _norm_inputs(shape, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(shape[-1]), 4)
  y, z = (jax.random.normal(k, shape).astype(dtype) for k in ks[:2])
  return y, z, 1.0 + 0.1 * jax.random.normal(ks[2], shape[-1:]), jax.random.normal(ks[3], shape)


# 3 groups of 8 channels (padded to 16 inside) over a ragged 2 x 37 rows; 1 group of 64.
@pytest.mark.parametrize("shape,groups", [((2, 37, 24), 3), ((3, 16, 64), 1)])
def test_gated_norm_kernel_matches_plain_form(shape, groups):
  y, z, w, wo = _norm_inputs(shape)
  (_, o1), g1 = _norm_grads(_NORM, groups, wo)(y, z, w)
  (_, o2), g2 = _norm_grads(layer_math.gated_rms_norm, groups, wo)(y, z, w)
  assert o1.shape == shape and o1.dtype == jnp.float32 and rel(o1, o2) < 1e-5
  for name, a, b in zip(("y", "z", "weight"), g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name


def test_kernels_bfloat16_within_the_plain_forms_error():
  """bfloat16 inputs: the kernels' outputs and gradients deviate from the float32
  plain form (on the same rounded inputs) by no more than the plain form run on the
  bfloat16 inputs and rounded to bfloat16 as the model rounds it, to a factor 1.5."""
  x, w, bias, front, wy, wf = _conv_inputs(2, 100, (32,), 4, jnp.bfloat16)
  seq = packed_ids(7, 2, 100)
  plain_bf16 = lambda *a: (lambda y, t: (y.astype(jnp.bfloat16), t))(*layer_math.causal_conv_silu(*a))
  (_, ref), gref = _conv_grads(layer_math.causal_conv_silu, seq, wy, wf)(x.astype(jnp.float32), w, bias, front)
  (_, out_k), gk = _conv_grads(_CONV, seq, wy, wf)(x, w, bias, front)
  (_, out_p), gp = _conv_grads(plain_bf16, seq, wy, wf)(x, w, bias, front)
  y, z, nw, wo = _norm_inputs((2, 40, 64), jnp.bfloat16)
  (_, nref), ngref = _norm_grads(layer_math.gated_rms_norm, 2, wo)(y.astype(jnp.float32), z.astype(jnp.float32), nw)
  (_, nk), ngk = _norm_grads(_NORM, 2, wo)(y, z, nw)
  (_, npl), ngp = _norm_grads(lambda *a: layer_math.gated_rms_norm(*a).astype(jnp.bfloat16), 2, wo)(y, z, nw)
  assert out_k[0].dtype == jnp.bfloat16 and nk.dtype == jnp.bfloat16
  pairs = [("conv y", out_k[0], out_p[0], ref[0]), ("norm out", nk, npl, nref)]
  pairs += [(f"conv d{n}", a, b, r) for n, a, b, r in zip(("x", "w", "bias", "front"), gk, gp, gref)]
  pairs += [(f"norm d{n}", a, b, r) for n, a, b, r in zip(("y", "z", "w"), ngk, ngp, ngref)]
  for name, k, plain, r in pairs:
    err_k, err_p = rel(k, r), rel(plain, r)
    assert err_p < 5e-2, (name, err_p)  # bfloat16 rounding, not a broken reference
    assert err_k <= 1.5 * err_p + 1e-6, (name, err_k, err_p)


def test_model_with_layer_kernels_matches_xla_model():
  """A one-layer tiny model with 2 groups over packed documents at a ragged length,
  logits and every parameter's gradient: the GPU kernels as a GPU runs them
  (`layer_impl` and `ssd_impl` auto on GPU: triton, here in the interpreter; remat
  save_matmuls) against the XLA model (no remat)."""
  from flax import nnx

  from mamba_train import Mamba2LM, Runtime, config_for
  cfg = config_for("tiny", n_layer=1, chunk_size=16, ngroups=2)
  ids = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)
  seq = packed_ids(3, 2, 40)
  params = Mamba2LM(cfg, rngs=nnx.Rngs(0)).params()
  assert Runtime().resolve("gpu").layer_impl == "triton" and Runtime().resolve("cpu").layer_impl == "xla"

  def run(rt):
    def loss(p):
      logits = Mamba2LM.from_params(cfg, p, rt)(ids, seq_idx=seq)
      return jnp.mean(jax.nn.logsumexp(logits, -1)), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, l1), g1 = run(Runtime(ssd_impl="triton_interpret", layer_impl="triton_interpret", ssd_form="parallel",
                            remat="save_matmuls"))
  (_, l2), g2 = run(Runtime(ssd_impl="xla", layer_impl="xla", ssd_form="parallel"))
  assert rel(l1, l2) < 1e-5
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g2)):
    assert rel(a, b) < 1e-5, path
