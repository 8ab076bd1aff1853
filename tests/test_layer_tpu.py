"""The TPU layer kernels (model/layer_tpu.py, Pallas Mosaic: the conv + SiLU and the
gated RMSNorm) against their plain forms (model/layer_math.py) in Pallas' interpreter
on CPU: float32 forward and every gradient at 1e-5, ragged lengths over several
position blocks, packed documents with a front of earlier inputs (the conv never
reads across a document boundary), B|C-shaped channels, 1 and 3 groups; the model
with the kernels against the XLA model; and the kernels compiled for TPU v6e and v5p
through libtpu (no TPU needed), so Mosaic's tiling rules are checked here."""

import functools

import jax
import jax.numpy as jnp
import pytest

from mamba_train.model import layer_math, layer_tpu

from helpers import libtpu_compiles, packed_ids, rel

_CONV = functools.partial(layer_tpu.causal_conv_silu_tpu, interpret=True)
_NORM = functools.partial(layer_tpu.gated_rms_norm_tpu, interpret=True)


def _conv_inputs(b, l, chan, k):
  ks = jax.random.split(jax.random.PRNGKey(l), 6)
  x = jax.random.normal(ks[0], (b, l, *chan))
  w = 0.5 * jax.random.normal(ks[1], (k, *chan))
  bias = jax.random.normal(ks[2], chan)
  front = jax.random.normal(ks[3], (b, k - 1, *chan))
  return x, w, bias, front, jax.random.normal(ks[4], x.shape), jax.random.normal(ks[5], front.shape)


def _conv_grads(fn, seq, front_idx, wy, wf):
  # A weighted sum of both outputs, so every cotangent path is checked.
  def loss(x, w, bias, front):
    y, tail = fn(x, w, bias, front, seq, front_idx)
    return jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(tail * wf), (y, tail)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


# (l, channels, documents): 300 positions are two blocks of 256 (the second ragged)
# with packed documents, the front's own document ids and 24 channels; 37 positions
# over B|C-shaped channels (2, 128) in one block; whole blocks, no documents.
@pytest.mark.parametrize("l,chan,docs", [(300, (24,), True), (37, (2, 128), True), (512, (16,), False)])
def test_conv_silu_kernel_matches_plain_form(l, chan, docs):
  x, w, bias, front, wy, wf = _conv_inputs(2, l, chan, 4)
  seq = packed_ids(l, 2, l) if docs else None
  # The front's first input is of an earlier document than position 0's.
  front_idx = (jnp.zeros((2, 3), jnp.int32).at[:, 0].set(-1) + seq[:, :1]) if docs else None
  (_, (y1, t1)), g1 = _conv_grads(_CONV, seq, front_idx, wy, wf)(x, w, bias, front)
  (_, (y2, t2)), g2 = _conv_grads(layer_math.causal_conv_silu, seq, front_idx, wy, wf)(x, w, bias, front)
  assert y1.shape == x.shape and y1.dtype == x.dtype and t1.dtype == jnp.float32
  assert rel(y1, y2) < 1e-5 and rel(t1, t2) == 0.0
  for name, a, b in zip(("x", "w", "bias", "front"), g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name
  if docs:  # an input of another document changes nothing at positions after the boundary
    cut = int(jnp.argmax(seq[0] > seq[0, 0]))
    y3, _ = jax.jit(_CONV)(x.at[0, cut - 1].add(5.0), w, bias, front, seq, front_idx)
    assert rel(y3[0, cut:], y1[0, cut:]) == 0.0 and rel(y3[0, cut - 1], y1[0, cut - 1]) > 0


def _norm_grads(fn, groups, wo):
  def loss(y, z, w):
    out = fn(y, z, w, groups, 1e-5)
    return jnp.sum(out.astype(jnp.float32) * wo), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


# 3 groups of 8 channels over a ragged 2 x 37 rows; 1 group of 64 over 144 rows (two
# blocks of 128, the second ragged).
@pytest.mark.parametrize("shape,groups", [((2, 37, 24), 3), ((3, 48, 64), 1)])
def test_gated_norm_kernel_matches_plain_form(shape, groups):
  ks = jax.random.split(jax.random.PRNGKey(shape[-1]), 4)
  y, z = (jax.random.normal(k, shape) for k in ks[:2])
  w, wo = 1.0 + 0.1 * jax.random.normal(ks[2], shape[-1:]), jax.random.normal(ks[3], shape)
  (_, o1), g1 = _norm_grads(_NORM, groups, wo)(y, z, w)
  (_, o2), g2 = _norm_grads(layer_math.gated_rms_norm, groups, wo)(y, z, w)
  assert o1.shape == shape and o1.dtype == jnp.float32 and rel(o1, o2) < 1e-5
  for name, a, b in zip(("y", "z", "weight"), g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name


def test_kernels_bfloat16_within_the_plain_forms_error():
  """bfloat16 inputs: the kernels' outputs and gradients deviate from the float32 plain
  form (on the same rounded inputs) by no more than the plain form run on the bfloat16
  inputs and rounded to bfloat16 as the model rounds it, to a factor 1.5."""
  x, w, bias, front, wy, wf = _conv_inputs(2, 100, (32,), 4)
  x = x.astype(jnp.bfloat16)
  seq = packed_ids(7, 2, 100)
  plain_bf16 = lambda *a: (lambda y, t: (y.astype(jnp.bfloat16), t))(*layer_math.causal_conv_silu(*a))
  (_, ref), gref = _conv_grads(layer_math.causal_conv_silu, seq, None, wy, wf)(x.astype(jnp.float32), w, bias,
                                                                               front)
  (_, out_k), gk = _conv_grads(_CONV, seq, None, wy, wf)(x, w, bias, front)
  (_, out_p), gp = _conv_grads(plain_bf16, seq, None, wy, wf)(x, w, bias, front)
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  y, z = (jax.random.normal(k, (2, 40, 64)).astype(jnp.bfloat16) for k in ks[:2])
  nw, wo = 1.0 + 0.1 * jax.random.normal(ks[2], (64,)), jax.random.normal(ks[3], (2, 40, 64))
  f32 = lambda a: a.astype(jnp.float32)
  (_, nref), ngref = _norm_grads(layer_math.gated_rms_norm, 2, wo)(f32(y), f32(z), nw)
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


def test_model_with_mosaic_layer_kernels_matches_xla_model():
  """A one-layer tiny model with 4 groups over packed documents at a ragged length,
  logits and every parameter's gradient: the TPU kernels in the interpreter (remat
  save_in_proj, TPU's) against the XLA model (no remat); and what 'auto' resolves to."""
  from flax import nnx

  from mamba_train import Mamba2LM, Runtime, config_for
  cfg = config_for("tiny", n_layer=1, chunk_size=16, ngroups=4, d_state=8)
  ids = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)
  seq = packed_ids(3, 2, 40)
  params = Mamba2LM(cfg, rngs=nnx.Rngs(0)).params()
  assert Runtime().resolve("cpu").layer_impl == Runtime().resolve("tpu").layer_impl == "xla"
  with pytest.raises(ValueError, match="layer_impl must be one of"):
    Runtime(layer_impl="pallas")

  def run(rt):
    def loss(p):
      logits = Mamba2LM.from_params(cfg, p, rt)(ids, seq_idx=seq)
      return jnp.mean(jax.nn.logsumexp(logits, -1)), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, l1), g1 = run(Runtime(ssd_impl="xla", layer_impl="mosaic_interpret", ssd_form="parallel",
                            remat="save_in_proj"))
  (_, l2), g2 = run(Runtime(ssd_impl="xla", layer_impl="xla", ssd_form="parallel"))
  assert rel(l1, l2) < 1e-5
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g2)):
    assert rel(a, b) < 1e-5, path


_AOT = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import tpu_devices
from mamba_train.model.layer_tpu import causal_conv_silu_tpu, gated_rms_norm_tpu
for topo in sys.argv[1:]:
  rep = NamedSharding(Mesh(np.array(tpu_devices(topo)[2][:1]), ("d",)), P())
  S = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)
  # Two position blocks, x's channels (1024: two blocks) and B|C's (2, 128), bfloat16,
  # with documents; the norm with 1 group and 8 groups of 512.
  b, l, k = 1, 512, 4
  for chan in ((1024,), (2, 128)):
    def conv_loss(x, w, bias, front, seq):
      y, tail = causal_conv_silu_tpu(x, w, bias, front, seq)
      return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(tail)
    step = jax.jit(jax.value_and_grad(conv_loss, argnums=(0, 1, 2, 3)))
    hlo = step.lower(S((b, l, *chan), jnp.bfloat16), S((k, *chan)), S(chan), S((b, k - 1, *chan)),
                     S((b, l), jnp.int32)).compile().as_text()
    for kernel in ("conv_silu_tpu_fwd", "conv_silu_tpu_bwd"):
      assert kernel in hlo, kernel + " missing"
  for g in (1, 8):
    def norm_loss(y, z, w):
      return jnp.sum(gated_rms_norm_tpu(y, z, w, g, 1e-5).astype(jnp.float32) ** 2)
    step = jax.jit(jax.value_and_grad(norm_loss, argnums=(0, 1, 2)))
    # The 1.3b width: its row blocks must fit v5p's scoped VMEM (a 128-row block did not).
    hlo = step.lower(S((b, 300, 4096), jnp.bfloat16), S((b, 300, 4096), jnp.bfloat16),
                     S((4096,))).compile().as_text()
    for kernel in ("gated_norm_tpu_fwd", "gated_norm_tpu_bwd"):
      assert kernel in hlo, kernel + " missing"
  print("compiled", topo)
"""


def test_layer_kernels_compile_for_tpu_v6e_and_v5p():
  libtpu_compiles(_AOT, ("v6e:1x1", "v5p:2x2x1"))
