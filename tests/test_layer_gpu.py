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
from kernel_checks import (
  assert_bfloat16_within_plain_error,
  assert_model_matches_xla,
  conv_grads,
  conv_inputs,
  norm_grads,
  norm_inputs,
)

_CONV = functools.partial(layer_gpu.causal_conv_silu_gpu, interpret=True)
_NORM = functools.partial(layer_gpu.gated_rms_norm_gpu, interpret=True)


# (l, channels, documents): 300 positions are two program spans of 256 (the second
# ragged) with packed documents and a 24-channel axis padded to 32 inside; 37
# positions over B|C-shaped channels (2, 5); whole spans with no documents.
@pytest.mark.parametrize("l,chan,docs", [(300, (24,), True), (37, (2, 5), True), (256, (16,), False)])
def test_conv_silu_kernel_matches_plain_form(l, chan, docs):
  x, w, bias, front, wy, wf = conv_inputs(2, l, chan, 4)
  seq = packed_ids(l, 2, l) if docs else None
  (_, (y1, t1)), g1 = conv_grads(_CONV, seq, wy, wf)(x, w, bias, front)
  (_, (y2, t2)), g2 = conv_grads(layer_math.causal_conv_silu, seq, wy, wf)(x, w, bias, front)
  assert y1.shape == x.shape and y1.dtype == x.dtype and t1.dtype == jnp.float32
  assert rel(y1, y2) < 1e-5 and rel(t1, t2) == 0.0
  for name, a, b in zip(("x", "w", "bias", "front"), g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name
  if docs:  # an input of another document changes nothing at positions after the boundary
    cut = int(jnp.argmax(seq[0] > seq[0, 0]))
    y3, _ = jax.jit(_CONV)(x.at[0, cut - 1].add(5.0), w, bias, front, seq)
    assert rel(y3[0, cut:], y1[0, cut:]) == 0.0 and rel(y3[0, cut - 1], y1[0, cut - 1]) > 0


# 3 groups of 8 channels (padded to 16 inside) over a ragged 2 x 37 rows; 1 group of 64.
@pytest.mark.parametrize("shape,groups", [((2, 37, 24), 3), ((3, 16, 64), 1)])
def test_gated_norm_kernel_matches_plain_form(shape, groups):
  y, z, w, wo = norm_inputs(shape)
  (_, o1), g1 = norm_grads(_NORM, groups, wo)(y, z, w)
  (_, o2), g2 = norm_grads(layer_math.gated_rms_norm, groups, wo)(y, z, w)
  assert o1.shape == shape and o1.dtype == jnp.float32 and rel(o1, o2) < 1e-5
  for name, a, b in zip(("y", "z", "weight"), g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name


def test_kernels_bfloat16_within_the_plain_forms_error():
  """bfloat16 inputs: the kernels' outputs and gradients deviate from the float32
  plain form (on the same rounded inputs) by no more than the plain form run on the
  bfloat16 inputs and rounded to bfloat16 as the model rounds it, to a factor 1.5."""
  assert_bfloat16_within_plain_error(_CONV, _NORM)


def test_model_with_layer_kernels_matches_xla_model():
  """A one-layer tiny model with 2 groups over packed documents at a ragged length,
  logits and every parameter's gradient: the GPU kernels as a GPU runs them
  (`layer_impl` and `ssd_impl` auto on GPU: triton, here in the interpreter; remat
  save_matmuls) against the XLA model (no remat)."""
  from mamba_train import Runtime, config_for
  assert Runtime().resolve("gpu").layer_impl == "triton" and Runtime().resolve("cpu").layer_impl == "xla"
  assert_model_matches_xla(config_for("tiny", n_layer=1, chunk_size=16, ngroups=2),
                           Runtime(ssd_impl="triton_interpret", layer_impl="triton_interpret", ssd_form="parallel",
                                   remat="save_matmuls"),
                           Runtime(ssd_impl="xla", layer_impl="xla", ssd_form="parallel"))
