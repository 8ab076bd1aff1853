"""The TPU layer kernels (ops/layer_tpu.py, Pallas Mosaic: the conv + SiLU and the
gated RMSNorm) against their plain forms (ops/layer_math.py) in Pallas' interpreter
on CPU: float32 forward and every gradient at 1e-5, ragged lengths over several
position blocks, packed documents with a front of earlier inputs (the conv never
reads across a document boundary), B|C-shaped channels, 1 and 3 groups; the model
with the kernels against the XLA model; and the kernels compiled for TPU v6e and v5p
through libtpu (no TPU needed), so Mosaic's tiling rules are checked here."""

import functools

import pytest

from mamba_train.ops import layer_tpu

from helpers import libtpu_compiles
from kernel_checks import (
  assert_bfloat16_within_plain_error,
  assert_conv_matches_plain,
  assert_model_matches_xla,
  assert_norm_matches_plain,
)

_CONV = functools.partial(layer_tpu.causal_conv_silu_tpu, interpret=True)
_NORM = functools.partial(layer_tpu.gated_rms_norm_tpu, interpret=True)


# (l, channels, documents): 300 positions are two blocks of 256 (the second ragged)
# with packed documents, the front's own document ids and 24 channels; 37 positions
# over B|C-shaped channels (2, 128) in one block; whole blocks, no documents.
@pytest.mark.parametrize("l,chan,docs", [(300, (24,), True), (37, (2, 128), True), (512, (16,), False)])
def test_conv_silu_kernel_matches_plain_form(l, chan, docs):
  assert_conv_matches_plain(_CONV, l, chan, docs, front_ids=True)


# 3 groups of 8 channels over a ragged 2 x 37 rows; 1 group of 64 over 144 rows (two
# blocks of 128, the second ragged).
@pytest.mark.parametrize("shape,groups", [((2, 37, 24), 3), ((3, 48, 64), 1)])
def test_gated_norm_kernel_matches_plain_form(shape, groups):
  assert_norm_matches_plain(_NORM, shape, groups)


def test_kernels_bfloat16_within_the_plain_forms_error():
  """bfloat16 inputs: the kernels' outputs and gradients deviate from the float32 plain
  form (on the same rounded inputs) by no more than the plain form run on the bfloat16
  inputs and rounded to bfloat16 as the model rounds it, to a factor 1.5."""
  assert_bfloat16_within_plain_error(_CONV, _NORM)


def test_model_with_mosaic_layer_kernels_matches_xla_model():
  """A one-layer tiny model with 4 groups over packed documents at a ragged length,
  logits and every parameter's gradient: the TPU kernels in the interpreter (remat
  save_in_proj, TPU's) against the XLA model (no remat); and what 'auto' resolves to."""
  from mamba_train import Runtime, config_for
  assert Runtime().resolve("cpu").layer_impl == Runtime().resolve("tpu").layer_impl == "xla"
  with pytest.raises(ValueError, match="layer_impl must be one of"):
    Runtime(layer_impl="pallas")
  assert_model_matches_xla(config_for("tiny", n_layer=1, chunk_size=16, ngroups=4, d_state=8),
                           Runtime(ssd_impl="xla", layer_impl="mosaic_interpret", ssd_form="parallel",
                                   remat="save_in_proj"),
                           Runtime(ssd_impl="xla", layer_impl="xla", ssd_form="parallel"))


_AOT = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import tpu_devices
from mamba_train.ops.layer_tpu import causal_conv_silu_tpu, gated_rms_norm_tpu
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
