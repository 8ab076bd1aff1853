"""The GPU layer kernels (ops/layer_gpu.py, Pallas Triton: the conv + SiLU and the
gated RMSNorm) against their plain forms (ops/layer_math.py) in Pallas' interpreter
on CPU: float32 forward and every gradient at 1e-5, ragged lengths over several
program spans, packed documents (the conv never reads across a document boundary),
a front of earlier inputs, several channel axes and groups, bfloat16 judged against
the float32 run's error; and the model with the kernels against the XLA model. Their
compile for sm_90a is in tests/test_ssd_gpu.py (one subprocess for every kernel)."""

import functools

import pytest

from mamba_train.ops import layer_gpu

from kernel_checks import (
  assert_bfloat16_within_plain_error,
  assert_conv_matches_plain,
  assert_model_matches_xla,
  assert_norm_matches_plain,
)

_CONV = functools.partial(layer_gpu.causal_conv_silu_gpu, interpret=True)
_NORM = functools.partial(layer_gpu.gated_rms_norm_gpu, interpret=True)


# (l, channels, documents): 300 positions are two program spans of 256 (the second
# ragged) with packed documents and a 24-channel axis padded to 32 inside; 37
# positions over B|C-shaped channels (2, 5); whole spans with no documents.
@pytest.mark.parametrize("l,chan,docs", [(300, (24,), True), (37, (2, 5), True), (256, (16,), False)])
def test_conv_silu_kernel_matches_plain_form(l, chan, docs):
  assert_conv_matches_plain(_CONV, l, chan, docs)


# 3 groups of 8 channels (padded to 16 inside) over a ragged 2 x 37 rows; 1 group of 64.
@pytest.mark.parametrize("shape,groups", [((2, 37, 24), 3), ((3, 16, 64), 1)])
def test_gated_norm_kernel_matches_plain_form(shape, groups):
  assert_norm_matches_plain(_NORM, shape, groups)


def test_kernels_bfloat16_within_the_plain_forms_error():
  """bfloat16 inputs: the kernels' outputs and gradients deviate from the float32
  plain form (on the same rounded inputs) by no more than the plain form run on the
  bfloat16 inputs and rounded to bfloat16 as the model rounds it, to a factor 1.5."""
  assert_bfloat16_within_plain_error(_CONV, _NORM)


def test_model_with_layer_kernels_matches_xla_model():
  """A one-layer tiny model with 2 groups over packed documents at a ragged length,
  logits and every parameter's gradient: the GPU kernels as a GPU runs them where the
  fused layer does not (`layer_impl` auto on GPU is 'fused_triton', whose conv and norm
  are these kernels; here in the interpreter; remat save_matmuls) against the XLA model
  (no remat)."""
  from mamba_train import Runtime, config_for
  from mamba_train.ops import table
  gpu = Runtime().resolve("gpu")
  assert gpu.layer_impl == "fused_triton" and Runtime().resolve("cpu").layer_impl == "xla"
  assert table.build(gpu, config_for("tiny")).chose("conv") == "triton"
  assert_model_matches_xla(config_for("tiny", n_layer=1, chunk_size=16, ngroups=2),
                           Runtime(ssd_impl="triton_interpret", layer_impl="triton_interpret", ssd_form="parallel",
                                   remat="save_matmuls"),
                           Runtime(ssd_impl="xla", layer_impl="xla", ssd_form="parallel"))


def test_gated_norm_kernel_reads_the_gate_in_place_from_a_joined_array():
  """z given as in_proj's joined output (its first i channels the gate, as the model
  passes it on GPUs: `Ops.norm_gate_joined`), read in place by the kernels, against the
  plain form on the gate's slice, float32: the output and the gradients of y, of the
  weight and of the whole joined array (the gate's slice at 1e-5, exact zeros past it)."""
  import jax
  import jax.numpy as jnp

  from mamba_train.ops import layer_math

  from kernel_checks import norm_grads, norm_inputs, rel
  shape, groups, width = (1, 16, 32), 2, 48  # two groups of 16 (no padding), 16 channels past the gate
  y, _, w, wo = norm_inputs(shape)
  joined = jax.random.normal(jax.random.PRNGKey(7), shape[:-1] + (width,))
  i = shape[-1]
  (_, o1), (dy1, dj1, dw1) = norm_grads(_NORM, groups, wo)(y, joined, w)
  (_, o2), (dy2, dz2, dw2) = norm_grads(layer_math.gated_rms_norm, groups, wo)(y, joined[..., :i], w)
  assert o1.shape == shape and rel(o1, o2) < 1e-5
  assert dj1.shape == joined.shape and rel(dj1[..., :i], dz2) < 1e-5 and not jnp.any(dj1[..., i:])
  assert rel(dy1, dy2) < 1e-5 and rel(dw1, dw2) < 1e-5
  # read in place: no slice of the joined array before the forward kernel
  jaxpr = str(jax.make_jaxpr(lambda y, z, w: _NORM(y, z, w, groups, 1e-5))(y, joined, w))
  assert "slice" not in jaxpr.split("pallas_call")[0], jaxpr
