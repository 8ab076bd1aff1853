"""Every matmul of the model, in one place that knows its precision and its adapter:
the Mamba-2 in_proj (the joined z|x|B|C dot, and dt's) and out_proj, attention q/k/v/o,
the MLP's up/gate/down, and the LM head (`head_operands`, which the blockwise loss
and `Mamba2LM.logits` both take).

Precision (`Runtime.matmul_precision`):

  default  the compute dtype (float32 or bfloat16), float32 accumulation and result.
  int8     qwix's quantized dot with a quantized backward pass: symmetric absmax,
           weights one scale per output channel, activations one per token (row),
           the incoming gradients of both backward dots one per channel of their
           own rows. int8 has one uniform grid of 255 steps, so a scale per
           tensor would leave a row of small values a handful of levels; per channel
           is what MaxText's int8 does. int8 x int8 accumulates in int32.
  fp8      e4m3 weights and activations (3 mantissa bits), e5m2 gradients (the
           range gradients need), one scale per tensor, as Nemotron-H trained and as
           Transformer Engine does: a float format keeps its relative precision
           across magnitudes, so one scale suffices. Current scaling (the absmax of
           this step's tensor), not delayed scaling: delayed scaling keeps an amax
           history in the train state, which would make the precision a property of
           the checkpoint instead of a runtime field any run may change.

Quantized operands are quantized from the compute dtype's operands, what the
default path would multiply: a bfloat16 run gathers, casts and keeps for the
backward pass what it did, and the int8/fp8 values come from there (their own
error, 2^-8 of a row's largest value for int8 and 2^-4 relative for e4m3, is
above bfloat16's 2^-9 rounding). The scales are then in that dtype, and so is the
dot's result before it is widened to float32. What never
goes through a quantized dot: dt, A, the decays and segment sums, the SSD state
and its chunked and step forms, the convolution, norms, the residual stream, the
attention scores and softmax, logits and the loss. The LM head of the training loss
stays in the compute dtype (the loss's own blockwise backward runs it; logits
feed a softmax over the whole vocabulary, the one matmul whose error lands on the
loss directly); decoding's head takes the decoding weights' format
(`quantize_weights`).

qwix is used through its core quantized dot (`dot_general_qt`, the function its
`QtProvider` calls for each intercepted `dot_general`): the provider finds weights
as Flax module parameters, and here they reach their dots sliced out of layer
stacks inside a `lax.scan`, where it cannot see them.

LoRA (`Adapter`): y = x W + scale * dropout(x) A B, peft's form, with A and B run in
the compute dtype (they are small, and B starts at zero, which a scale per tensor
or channel of a quantized format cannot hold apart from W). Dropout is inverted
(kept inputs scaled by 1 / (1 - rate)) and happens only when the adapter carries a
key, which training gives it (one per step, per layer and per target: see
`Mamba2LM.dropout_key`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import qwix

F32 = jnp.float32
# The key under which a layer's adapters travel beside its weights.
ADAPTERS = "lora"

try:  # qwix's quantized dot with its quantized backward: not in qwix's top-level names
  from qwix._src.core.dot_general_qt import DotGeneralQtConfig, dot_general_qt
except ImportError:  # pragma: no cover - a qwix that moved it; 'default' still runs
  DotGeneralQtConfig = dot_general_qt = None


def _qt_config(precision: str):
  if dot_general_qt is None:
    raise ValueError(f"matmul_precision={precision!r} needs qwix's dot_general_qt, which this "
                     f"qwix ({qwix.__version__}) lacks; pip install 'qwix>=0.1.5'")
  if precision == "int8":
    i8 = jnp.int8
    return DotGeneralQtConfig(lhs_qtype=i8, rhs_qtype=i8, dlhs_grad_qtype=i8, drhs_grad_qtype=i8)
  fwd, bwd = jnp.float8_e4m3fn, jnp.float8_e5m2
  return DotGeneralQtConfig(
      lhs_qtype=fwd, rhs_qtype=fwd, dlhs_grad_qtype=bwd, drhs_grad_qtype=bwd,
      lhs_disable_channelwise_axes=True, rhs_disable_channelwise_axes=True,
      dlhs_grad_disable_channelwise_axes=True, drhs_grad_disable_channelwise_axes=True)


# ----------------------------------------------------------------------------
# LoRA adapters as the matmuls take them.


def dropout_mask(key, shape, rate: float):
  """The kept inputs of inverted dropout: 0 or 1 / (1 - rate), float32."""
  keep = jax.random.bernoulli(key, 1.0 - rate, shape)
  return keep.astype(F32) / (1.0 - rate)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adapter:
  """One matmul's adapter: A (in, r), B (r, out) over the weight's input and output
  axes flattened; key: its dropout key for this step, None outside training."""
  a: jax.Array
  b: jax.Array
  key: jax.Array | None
  scale: float = dataclasses.field(metadata=dict(static=True))
  dropout: float = dataclasses.field(metadata=dict(static=True))

  def project_in(self, x, cd):
    """scale * dropout(x) A for x (..., in) -> (..., r) float32."""
    if self.key is not None and self.dropout > 0.0:
      x = x.astype(F32) * dropout_mask(self.key, x.shape, self.dropout)
    return self.scale * jnp.einsum("...i,ir->...r", x.astype(cd), self.a.astype(cd),
                                   preferred_element_type=F32)

  def delta(self, x, cd):
    """scale * dropout(x) A B for x (..., in) -> (..., out) float32."""
    return jnp.einsum("...r,ro->...o", self.project_in(x, cd).astype(cd), self.b.astype(cd),
                      preferred_element_type=F32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerAdapters:
  """A layer's adapters {target: {'a', 'b'}} (stacked over a kind's layers like the
  weights, and sliced with them inside the layer scan) and their dropout keys
  (L, 2), one per layer (None outside training)."""
  ab: dict[str, Any]
  keys: jax.Array | None
  scale: float = dataclasses.field(metadata=dict(static=True))
  dropout: float = dataclasses.field(metadata=dict(static=True))

  def get(self, target: str) -> Adapter | None:
    ab = self.ab.get(target)
    if ab is None:
      return None
    key = None
    if self.keys is not None:  # one key a layer: a different mask per target
      key = jax.random.fold_in(self.keys, _TARGET_SALT[target])
    return Adapter(ab["a"], ab["b"], key, self.scale, self.dropout)


_TARGET_SALT = {t: i for i, t in enumerate(("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                                            "up_proj", "gate_proj", "down_proj", "lm_head"))}


def adapter_of(p: dict[str, Any], target: str) -> Adapter | None:
  """The adapter of `target` in a layer's parameters (None without, and on the merged
  path, where the adapters are already in the weights)."""
  ad = p.get(ADAPTERS)
  if not isinstance(ad, LayerAdapters):
    return None
  return None if ad is None else ad.get(target)


# ----------------------------------------------------------------------------
# The matmul.


def linear(x, w, compute_dtype, precision: str = "default", n_in: int = 1,
           adapter: Adapter | None = None, out_dtype=F32):
  """x (..., *in) times w (*in, *out), contracting w's first n_in axes -> (..., *out)
  float32, in `precision` (PRECISIONS), plus the adapter's scale * dropout(x) A B.

  out_dtype: the result's dtype (float32 accumulation either way). A caller that
  rounds the result to the compute dtype at once asks for it here: the GEMM then
  writes it so (half the bytes of a float32 result, read back and rounded), and its
  backward takes the cotangent in that dtype too (the cotangent of a rounding to
  the compute dtype is in that dtype already, so no value changes).

  w may be a qwix QArray, a weight quantized once for decoding (`quantize_weights`):
  then it is dequantized into the compute dtype in the dot's operand fusion, so
  the weight reads are its format's, and the activations stay in the compute dtype."""
  cd = jnp.dtype(compute_dtype)
  xn = x.ndim
  dn = ((tuple(range(xn - n_in, xn)), tuple(range(n_in))), ((), ()))
  out = F32 if adapter is not None else jnp.dtype(out_dtype)  # the adapter adds in float32
  if isinstance(w, qwix.QArray):
    y = jax.lax.dot_general(x.astype(cd), qwix.dequantize(w).astype(cd), dn, preferred_element_type=out)
  elif precision == "default":
    y = jax.lax.dot_general(x.astype(cd), w.astype(cd), dn, preferred_element_type=out)
  else:
    y = dot_general_qt(x.astype(cd), w.astype(cd), dn, _qt_config(precision)).astype(out)
  if adapter is not None:
    lead = x.shape[:xn - n_in]
    d = adapter.delta(x.reshape(*lead, -1), cd)
    y = (y + d.reshape(y.shape)).astype(out_dtype)
  return y


def linear_row_scaled(x, w, scale, compute_dtype, precision: str = "default"):
  """(x @ w) * scale, float32: x (..., i), w (i, o), scale (..., 1) float32 (out_proj
  with the fused layer's RMSNorm folded in: `mamba2._mixer_fused`).

  In the default precision the backward is written out (`_row_scaled`): scale's
  cotangent comes from x's, sum(dx x) / scale, where autodiff wants x @ w again (under
  remat a rerun of the whole GEMM, fused with the reduction); and the cotangent enters
  both GEMMs in the compute dtype, so the weight's gradient is written, and reduced
  over devices, in it (as in_proj's is). On TPU the default precision rounds a float32
  operand to bfloat16 in the GEMM anyway."""
  cd = jnp.dtype(compute_dtype)
  if precision != "default" or isinstance(w, qwix.QArray):
    return linear(x, w, cd, precision) * scale
  return _row_scaled(x.astype(cd), w.astype(cd), scale)


def _row_dims(x):
  return ((x.ndim - 1,), (0,)), ((), ())


@jax.custom_vjp
def _row_scaled(x, w, scale):
  return jax.lax.dot_general(x, w, _row_dims(x), preferred_element_type=F32) * scale


def _row_scaled_fwd(x, w, scale):
  return _row_scaled(x, w, scale), (x, w, scale)


def _row_scaled_bwd(res, ct):
  x, w, scale = res
  cts = (ct * scale).astype(w.dtype)  # the cotangent of x @ w
  lead = tuple(range(x.ndim - 1))
  dx = jax.lax.dot_general(cts, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=x.dtype)
  dw = jax.lax.dot_general(x, cts, ((lead, lead), ((), ())), preferred_element_type=w.dtype)
  # d scale = sum(ct (x @ w)) = sum((ct @ w^T) x) = sum(dx x) / scale (scale > 0: an rstd).
  dscale = jnp.sum(dx.astype(F32) * x.astype(F32), -1, keepdims=True) / scale
  return dx, dw, dscale.astype(scale.dtype)


_row_scaled.defvjp(_row_scaled_fwd, _row_scaled_bwd)


# ----------------------------------------------------------------------------
# Decoding weights.


def quantize_weights(w, precision: str, n_in: int, compute_dtype, lead: int = 0):
  """A matmul weight ([L,] *in, *out; `lead` stacked axes) for decoding in
  `precision`: in the compute dtype for 'default', else quantized once (int8, or
  e4m3 for fp8) with one float32 scale per output channel (and layer): each output
  is one dot over a whole input row."""
  if precision == "default":
    return w.astype(compute_dtype)
  qtype = jnp.int8 if precision == "int8" else jnp.float8_e4m3fn
  axes = tuple(range(lead)) + tuple(range(lead + n_in, w.ndim))
  return qwix.quantize(w.astype(F32), qtype, channelwise_axes=axes)


def quantize_head(w, precision: str, compute_dtype):
  """The LM head (v, d) for decoding: `quantize_weights` with its output axis first."""
  if precision == "default":
    return w.astype(compute_dtype)
  qtype = jnp.int8 if precision == "int8" else jnp.float8_e4m3fn
  return qwix.quantize(w.astype(F32), qtype, channelwise_axes=(0,))


def head(x, w, compute_dtype):
  """Logits x (..., d) times the head w (v, d) -> (..., v) float32, in the compute
  dtype (w quantized for decoding is dequantized in the dot's operand fusion)."""
  cd = jnp.dtype(compute_dtype)
  if isinstance(w, qwix.QArray):
    w = qwix.dequantize(w)
  return jnp.einsum("...d,vd->...v", x.astype(cd), w.astype(cd), preferred_element_type=F32)

