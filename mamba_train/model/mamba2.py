"""The Mamba-2 language model in Flax NNX: the same function as mamba_ssm's
MambaLMHeadModel with Mamba2 mixers, and as transformers' Mamba2ForCausalLM;
with a `layer_pattern`, a hybrid of Mamba-2, attention, MLP and mixture-of-experts
layers, the same function as transformers' NemotronHForCausalLM.

Layers are stored stacked (a leading `layers` axis on every block parameter, one
stack per layer kind) and run with `jax.lax.scan` (`pattern.py`), so compile
time does not grow with depth. The per-layer math is written as pure functions
of a dict of that layer's arrays (attention and MLP layers: `attention.py`;
mixture-of-experts layers: `moe.py`).

Precision policy: parameters float32; the projections and the LM head run in the
runtime's compute dtype (`runtime.Runtime`) with float32 accumulation and float32
results (in_proj's z|x|B|C in the compute dtype, the one rounding they take anyway),
or in its matmul_precision (fp8, int8; every matmul goes through
`matmul.linear`, which says what stays float32); the residual stream, dt / A /
decay, convolution, SSD, norms and logits are float32.

Shapes: b batch, l length, d d_model, i d_inner (= h * p), h heads, p headdim,
g groups, n d_state, k conv kernel, v vocabulary.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

from mamba_train.model import (
  attention as attn_lib,
  lora as lora_lib,
  matmul as mm,
  moe as moe_lib,
  pattern as pattern_lib,
)
from mamba_train.model.config import ATTENTION, MAMBA, MLP, MOE, Mamba2Config
from mamba_train.model.decode_pallas import mixer_step_fused, norm_in_proj, out_proj_residual, pack_small
from mamba_train.model.layer_gpu import causal_conv_silu_gpu, gated_rms_norm_gpu
from mamba_train.model.layer_math import causal_conv, causal_conv_silu, gated_rms_norm
from mamba_train.model.layer_tpu import causal_conv_silu_tpu, gated_rms_norm_tpu
from mamba_train.model.runtime import Runtime
from mamba_train.model.ssd import ssd_chunked, ssd_step, ssd_window_step, state_outputs
from mamba_train.model.ssd_gpu import SAVE_NAMES as SSD_GPU_SAVE_NAMES, ssd_gpu
from mamba_train.model.ssd_pallas import SAVE_NAMES as SSD_PALLAS_SAVE_NAMES, ssd_fused
from mamba_train.parallel import sharding

F32 = jnp.float32
Array = jax.Array

# The parameters of one block, with their logical axes (the stacked `layers`
# axis is prepended). The in_proj of mamba_ssm is stored split into z|x, B|C and
# dt so that tensor parallelism cuts whole heads and never mixes the pieces.
BLOCK_PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "norm": ("embed",),
    "in_proj_zx": ("embed", None, "inner"),  # (d, 2, i): z then x
    "in_proj_bc": ("embed", None, "state"),  # (d, 2, g*n): B then C
    "in_proj_dt": ("embed", "heads"),  # (d, h)
    "conv_x": ("conv", "inner"),  # (k, i)
    "conv_x_bias": ("inner",),
    "conv_bc": ("conv", None, "state"),  # (k, 2, g*n)
    "conv_bc_bias": (None, "state"),
    "dt_bias": ("heads",),
    "A_log": ("heads",),
    "D": ("heads",),
    "gate_norm": ("inner",),
    "out_proj": ("inner", "embed"),  # (i, d)
}


# The parameters each layer multiplies by in the compute dtype (its projections);
# every other parameter enters float32 math.
MATMUL_WEIGHTS = frozenset({"in_proj_zx", "in_proj_bc", "in_proj_dt", "out_proj", "q_proj", "k_proj",
                            "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"}) | moe_lib.MATMUL_WEIGHTS


# The key under which a layer's adapters travel beside its weights (`Mamba2LM._compute_params`).
ADAPTERS = mm.ADAPTERS


# Each layer kind: its name in `Mamba2LM.params()` and the keys of its decoding
# state. The Mamba-2 stack is `layers` in pure models and hybrids alike, so a pure
# model's parameters and checkpoints carry no hybrid-only name.
KIND_PARAMS = {MAMBA: "layers", ATTENTION: "attn", MLP: "mlp", MOE: "moe"}
# (A mixture-of-experts layer has no decoding state; over a sequence it returns
# its router statistics, moe.STATS, in the place of one.)
STATE_KEYS = {MAMBA: ("conv_x", "conv_bc", "ssm"), ATTENTION: ("k", "v", "kv_valid", "kv_pos"),
              MLP: (), MOE: ()}
# A windowed Mamba-2 layer (`Mamba2Config.ssd_window`) holds its last W positions'
# inputs instead of an SSM state (`ssd.ssd_window_step`).
WINDOW_KEYS = ("conv_x", "conv_bc", "win_x", "win_B", "win_a")


def state_keys(cfg: Mamba2Config, kind: str) -> tuple[str, ...]:
  """The keys of one layer's decoding state of `kind`."""
  return WINDOW_KEYS if kind == MAMBA and cfg.ssd_window else STATE_KEYS[kind]


def kind_axes(cfg: Mamba2Config, kind: str) -> dict[str, tuple[str | None, ...]]:
  """One layer's parameter names of `kind` and their logical axes."""
  if kind == MAMBA:
    return BLOCK_PARAM_AXES
  if kind == ATTENTION:
    return attn_lib.param_axes(attn_lib.attn_shapes(cfg), attn_lib.ATTN_PARAM_AXES)
  if kind == MOE:
    return moe_lib.param_axes(cfg)
  return attn_lib.param_axes(attn_lib.mlp_shapes(cfg), attn_lib.MLP_PARAM_AXES)


def weight_names(cfg: Mamba2Config) -> set[str]:
  """The names of every layer parameter the model has (what LoRA targets are matched to)."""
  return {name for kind in KIND_PARAMS if cfg.count(kind) for name in kind_axes(cfg, kind)}


def _param(value, axes):
  return nnx.Param(value, logical_axes=tuple(axes))


def _block_uniform_shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
  d, i, h, gn, k = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.ngroups * cfg.d_state, cfg.d_conv
  return {"in_proj_zx": (d, 2, i), "in_proj_bc": (d, 2, gn), "in_proj_dt": (d, h),
          "conv_x": (k, i), "conv_x_bias": (i,), "conv_bc": (k, 2, gn), "conv_bc_bias": (2, gn),
          "out_proj": (i, d), "dt": (h,), "A": (h,)}


def init_block_params(cfg: Mamba2Config, u: Array) -> dict[str, Array]:
  """One block's parameters, initialised as mamba_ssm does, from a flat vector of
  uniform [0, 1) draws (see `_init_params` for why the draws come in one piece)."""
  shapes = _block_uniform_shapes(cfg)
  sizes = [math.prod(s) for s in shapes.values()]
  pieces = jnp.split(u, list(itertools.accumulate(sizes))[:-1])
  parts = dict(zip(shapes, (c.reshape(s) for c, s in zip(pieces, shapes.values()))))
  sym = lambda name, bound: (2.0 * parts[name] - 1.0) * bound  # uniform(-bound, bound)
  lin = 1.0 / math.sqrt(cfg.d_model)  # torch nn.Linear default: kaiming_uniform(a=sqrt(5))
  conv = 1.0 / math.sqrt(cfg.d_conv)  # depthwise conv: fan_in = kernel size
  # dt log-uniform in [dt_min, dt_max], floored, stored through an inverse softplus.
  dt = jnp.exp(parts["dt"] * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min))
  dt = jnp.maximum(dt, cfg.dt_init_floor)
  lo, hi = cfg.A_init_range
  h, i, d = cfg.nheads, cfg.d_inner, cfg.d_model
  return {
      "norm": jnp.ones((d,), F32),
      "in_proj_zx": sym("in_proj_zx", lin),
      "in_proj_bc": sym("in_proj_bc", lin),
      "in_proj_dt": sym("in_proj_dt", lin),
      "conv_x": sym("conv_x", conv),
      "conv_x_bias": sym("conv_x_bias", conv),
      "conv_bc": sym("conv_bc", conv),
      "conv_bc_bias": sym("conv_bc_bias", conv),
      "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),
      "A_log": jnp.log(lo + (hi - lo) * parts["A"]),
      "D": jnp.ones((h,), F32),
      "gate_norm": jnp.ones((i,), F32),
      # mamba_ssm rescales out_proj by 1/sqrt(n_layer) (one residual per block).
      "out_proj": sym("out_proj", 1.0 / math.sqrt(i)) / math.sqrt(cfg.n_layer),
  }


# ----------------------------------------------------------------------------
# Per-layer math (pure functions).


def rms_norm(x, weight, eps):
  x = x.astype(F32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _dt_and_A(p, dt_raw, cfg):
  dt = jax.nn.softplus(dt_raw.astype(F32) + p["dt_bias"])
  lo, hi = cfg.dt_limit
  if lo > 0.0 or hi < math.inf:
    dt = jnp.clip(dt, lo, hi)
  return dt, -jnp.exp(p["A_log"])


# Names of the in_proj results a remat policy can save (`_REMAT_POLICIES`): z|x|B|C
# (b, l, 2i + 2gn) in the compute dtype, and dt before its softplus (b, l, h) float32.
IN_PROJ_NAMES = ("mamba_in_proj", "mamba_in_proj_dt")


def _project_in(p, u, rt):
  """z, x, B|C and dt from the block input u. z|x|B|C is one matmul on the weights
  joined inside their cast to the compute dtype (one weight read, one dot), written
  by the GEMM in the compute dtype (float32 accumulation, one rounding); dt is a
  second, small (h columns) matmul with a float32 result, so that the large output
  never crosses HBM in float32 (for 1.3b on H100s its float32 write, reads and
  float32 cotangent were about 1e9 bytes a layer: docs/bench/gpu.md). With an
  adapter on in_proj (its B spans all five pieces) the five stay one float32 dot."""
  cd, prec = jnp.dtype(rt.compute_dtype), rt.matmul_precision
  zx, bcw, dtw = p["in_proj_zx"], p["in_proj_bc"], p["in_proj_dt"]
  if u.ndim == 2:  # one position (decoding)
    zxr, bc, dt_raw = _project_in_step(p, u, rt)
    return zxr[..., 0, :], zxr[..., 1, :], bc, dt_raw
  d, i, gn = zx.shape[0], zx.shape[2], bcw.shape[2]
  adapter = mm.adapter_of(p, "in_proj")
  if adapter is None and rt.layer_impl in ("mosaic", "mosaic_interpret"):
    # The TPU layer kernels take z, x and B|C as operands of their own: sliced out of
    # one joined result each would be a copy (XLA's conv and norm fusions read the
    # slices in place, the kernels cannot). Three GEMMs write them whole instead, and
    # read u three times (docs/bench/tpu_ssd.md, "The layer's elementwise chain as Mosaic kernels").
    proj = lambda w: checkpoint_name(mm.linear(u, w.astype(cd), cd, prec, out_dtype=cd), IN_PROJ_NAMES[0])
    dt_raw = checkpoint_name(mm.linear(u, dtw.astype(cd), cd, prec), IN_PROJ_NAMES[1])
    return proj(zx[:, 0]), proj(zx[:, 1]), proj(bcw), dt_raw
  w = jnp.concatenate([zx.reshape(d, 2 * i), bcw.reshape(d, 2 * gn)], 1)
  if adapter is None:
    r = mm.linear(u, w.astype(cd), cd, prec, out_dtype=cd)
    dt_raw = mm.linear(u, dtw.astype(cd), cd, prec)
  else:
    r = mm.linear(u, jnp.concatenate([w, dtw], 1).astype(cd), cd, prec, 1, adapter)
    r, dt_raw = r[..., :2 * i + 2 * gn].astype(cd), r[..., 2 * i + 2 * gn:]
  # Named whole, before the slices: a policy that saves them keeps one buffer in the
  # compute dtype, and z, x, B, C are sliced again in the backward pass for free.
  r, dt_raw = checkpoint_name(r, IN_PROJ_NAMES[0]), checkpoint_name(dt_raw, IN_PROJ_NAMES[1])
  z, x = r[..., :i], r[..., i:2 * i]
  bc = r[..., 2 * i:].reshape(*r.shape[:-1], 2, gn)
  return z, x, bc, dt_raw


def _project_in_step(p, u, rt):
  """`_project_in` for one position u (b, d): z|x (b, 2, i) and B|C (b, 2, g*n) in
  the compute dtype, dt (b, h) float32; three dots, as joining the weights would
  copy them every token."""
  cd, prec = jnp.dtype(rt.compute_dtype), rt.matmul_precision
  proj = lambda w: mm.linear(u, w, cd, prec)
  return proj(p["in_proj_zx"]).astype(cd), proj(p["in_proj_bc"]).astype(cd), proj(p["in_proj_dt"])


def _project_out(p, y, z, cfg, rt, norm=gated_rms_norm):
  y = norm(y, z, p["gate_norm"], cfg.ngroups, cfg.norm_eps)
  return mm.linear(y, p["out_proj"], rt.compute_dtype, rt.matmul_precision, 1,
                   mm.adapter_of(p, "out_proj"))


def zero_state(cfg: Mamba2Config, batch: int) -> dict[str, Array]:
  """One layer's recurrent state: conv inputs of the last k-1 positions, and the SSM
  state (h, p, n); with a window, the last W positions' dt*x (W, h, p), B (W, g, n)
  and dt*A (W, h) instead (`ssd.ssd_window_step`)."""
  k, i, gn = cfg.d_conv, cfg.d_inner, cfg.ngroups * cfg.d_state
  out = {"conv_x": jnp.zeros((batch, k - 1, i), F32), "conv_bc": jnp.zeros((batch, k - 1, 2, gn), F32)}
  h, p, n, w = cfg.nheads, cfg.headdim, cfg.d_state, cfg.ssd_window
  if w:
    out.update(win_x=jnp.zeros((batch, w, h, p), F32),
               win_B=jnp.zeros((batch, w, cfg.ngroups, n), F32), win_a=jnp.zeros((batch, w, h), F32))
  else:
    out["ssm"] = jnp.zeros((batch, h, p, n), F32)
  return out


def window_tail(x, dt, A, B, window: int, seq_idx=None) -> dict[str, Array]:
  """A windowed layer's decoding state after a sequence: its last `window`
  positions' dt*x, B and dt*A, float32 (zeros in front when it is shorter, and for
  positions of an earlier document than the last: decoding continues the last)."""
  f32 = lambda t: t[:, -window:].astype(F32)
  xdt, Bw, a = f32(x) * f32(dt)[..., None], f32(B), f32(dt) * A.astype(F32)
  if seq_idx is not None:
    last = (seq_idx == seq_idx[:, -1:])[:, -window:]
    xdt = jnp.where(last[..., None, None], xdt, 0.0)
  front = window - xdt.shape[1]
  pad = lambda t: jnp.pad(t, [(0, 0), (front, 0)] + [(0, 0)] * (t.ndim - 2)) if front else t
  return {"win_x": pad(xdt), "win_B": pad(Bw), "win_a": pad(a)}


# (b, c, q, i) stored (c, b, i, q): the layout the SSD kernels read x in and write
# y in, positions on the lanes (with i = h p, the same bytes as their (c, b, h, p, q)).
_CHUNK_MAJOR = Layout(major_to_minor=(1, 0, 3, 2))


def _elementwise(cfg: Mamba2Config, rt: Runtime, split):
  """(conv, norm): the conv + SiLU (`causal_conv_silu`'s arguments) and the gated
  RMSNorm (`gated_rms_norm`'s) as `rt.layer_impl` says: the plain forms, or the GPU
  (Triton) or TPU (Mosaic) kernels, which under a mesh run on each device's batch and
  channels (`parallel/kernels.py`). A split sequence keeps the plain forms (its conv
  exchanges a halo inside its own map)."""
  conv, norm = causal_conv_silu, gated_rms_norm
  if split is not None:
    return functools.partial(split.conv, causal_conv_silu), norm
  kernels = {"triton": (causal_conv_silu_gpu, gated_rms_norm_gpu),
             "mosaic": (causal_conv_silu_tpu, gated_rms_norm_tpu)}
  impl = rt.layer_impl.removesuffix("_interpret")
  if impl in kernels:
    interpret = rt.layer_impl.endswith("_interpret")
    conv = functools.partial(kernels[impl][0], interpret=interpret)
    norm = functools.partial(kernels[impl][1], interpret=interpret)
    heads = sharding.head_split()
    if heads is not None:
      conv = functools.partial(heads.conv, conv)
      # A group split over devices needs its sum of squares from all of them: the
      # plain form, whose reduction XLA partitions, unless whole groups are local.
      norm = (functools.partial(heads.norm, norm) if cfg.ngroups % heads.head_devices == 0
              else gated_rms_norm)
  return conv, norm


def mixer(p, u, cfg: Mamba2Config, rt: Runtime, *, seq_idx=None, mask=None, state=None):
  """The Mamba-2 mixer over a sequence, run as `rt` (a resolved runtime) says.

  u: (b, l, d) float32. seq_idx: (b, l) document ids. mask: (b, l) bool, False on
  padding: there the conv input and dt are zero, so padding cannot touch the
  state. state: a layer state (see `zero_state`) to continue from.
  Returns (b, l, d) float32 and the layer state after the last position.
  """
  b, l, _ = u.shape
  cd = jnp.dtype(rt.compute_dtype)
  z, xr, bc, dt_raw = _project_in(p, u, rt)
  if state is None:
    state = zero_state(cfg, b)
  if mask is not None:
    xr = jnp.where(mask[..., None], xr, 0.0)
    bc = jnp.where(mask[..., None, None], bc, 0.0)
  # With the length split over devices (the 'sequence' mesh axis), the conv and
  # the SSD run per slice and exchange a halo and state summaries (parallel/sequence.py).
  split = sharding.sequence_split()
  conv, norm = _elementwise(cfg, rt, split)
  ssd = (ssd_chunked if split is None
         else functools.partial(split.ssd, ssd_chunked, state_outputs))
  x, conv_x = conv(xr, p["conv_x"], p["conv_x_bias"], state["conv_x"], seq_idx)
  bc, conv_bc = conv(bc, p["conv_bc"], p["conv_bc_bias"], state["conv_bc"], seq_idx)
  dt, A = _dt_and_A(p, dt_raw, cfg)
  if mask is not None:
    dt = jnp.where(mask[..., None], dt, 0.0)
  g, n, h, hp = cfg.ngroups, cfg.d_state, cfg.nheads, cfg.headdim
  x = sharding.constrain(x.reshape(b, l, h, hp), ("batch", "act_length", "act_inner", None))
  form, chunk = rt.ssd_plan(cfg.chunk_size, cfg.ssd_window)
  x = x.astype(cd)
  fused = form in ("pallas", "interpret")
  on_gpu = form in ("triton", "triton_interpret")  # the GPU kernels read the natural layout
  if fused and split is None and l % chunk == 0:
    # The kernels read x chunk-major with positions minor, (c, b, h, p, q): the
    # conv's fusion writes it so, not (b, l, i) and then a transposed copy.
    x = with_layout_constraint(x.reshape(b, l // chunk, chunk, h * hp), _CHUNK_MAJOR).reshape(b, l, h, hp)
  ssd_args = (x, dt, A, bc[:, :, 0].reshape(b, l, g, n), bc[:, :, 1].reshape(b, l, g, n), chunk)
  ssd_kw = dict(D=p["D"], initial_state=state.get("ssm"), seq_idx=seq_idx)
  if cfg.ssd_window:
    ssd_kw["window"] = cfg.ssd_window
  if fused or on_gpu:
    # XLA cannot partition a Pallas call: under a mesh it runs per device's batch and heads.
    kernel = (functools.partial(ssd_fused, interpret=form == "interpret") if fused
              else functools.partial(ssd_gpu, interpret=form == "triton_interpret"))
    heads = sharding.head_split()
    kernel = kernel if heads is None else functools.partial(heads.ssd, kernel)
    # A split sequence runs the kernels per slice from a zero state and adds what the
    # entering state gives in XLA (parallel/sequence.py), as it does for the XLA SSD.
    if split is not None:
      kernel = functools.partial(split.ssd, kernel, state_outputs, kernel=True)
    y, ssm = kernel(*ssd_args, **ssd_kw)
  else:
    y, ssm = ssd(*ssd_args, **ssd_kw, form=form)
  y = y.reshape(b, l, h * hp)
  if fused and split is None and l % chunk == 0:
    y = with_layout_constraint(y.reshape(b, l // chunk, chunk, h * hp), _CHUNK_MAJOR).reshape(b, l, h * hp)
  if fused:
    # The kernel writes y positions-minor; turned channels-minor here, in y's
    # dtype, the gate, norm and out_proj read it as they read z. Left to XLA, it
    # widens y to float32 and transposes and retiles that (3 float32 copies).
    y = with_layout_constraint(y, Layout(major_to_minor=(0, 1, 2)))
  out = _project_out(p, y, z, cfg, rt, norm)
  if cfg.ssd_window:
    return out, {"conv_x": conv_x, "conv_bc": conv_bc,
                 **window_tail(x, dt, A, ssd_args[3], cfg.ssd_window, seq_idx)}
  return out, {"conv_x": conv_x, "conv_bc": conv_bc, "ssm": ssm}


def fused_decode(cfg: Mamba2Config, rt: Runtime) -> bool:
  """Whether `mixer_step` and `block_step` run the fused kernels (`decode_pallas`) as
  `rt.decode_impl` asks: not for a windowed layer (its state is a window of inputs,
  not the kernel's (h, p, n) state), nor under a mesh (XLA cannot partition a
  Pallas call, and the plain step's sharding is the rules table's); those take the
  plain step."""
  return rt.decode_impl in ("pallas", "interpret") and not cfg.ssd_window and sharding.active() is None


def fused_decode_weights(p, rt: Runtime, lead: int = 0) -> dict[str, Array]:
  """A Mamba-2 layer's weights as the fused step reads them (`fused_decode`), made
  once before a decode loop (`Mamba2LM.decode_layers`; `lead` stacked axes): in_proj
  joined into one (d, 2i + 2g*n + h) matmul weight, so a token is one dot, not
  three, and the small parameters packed into one array (`decode_pallas.pack_small`);
  both matmul weights in the compute dtype or quantized as `_decode_weights` does
  (per output channel, so joining changes no value). In the compute dtype, in_proj
  is stored transposed, (2i + 2g*n + h, d), as its kernel reads it
  (`decode_pallas.norm_in_proj`). The pre-norm's weight rides along as (1, d)."""
  zx = p["in_proj_zx"]
  pre, d = zx.shape[:lead], zx.shape[lead]
  w = jnp.concatenate([zx.reshape(*pre, d, -1), p["in_proj_bc"].reshape(*pre, d, -1), p["in_proj_dt"]], -1)
  q = lambda w: mm.quantize_weights(w, rt.matmul_precision, 1, rt.compute_dtype, lead)
  if rt.matmul_precision == "default":  # read by `decode_pallas.norm_in_proj`: (W, d), a row per output
    w_in = jnp.swapaxes(w, -1, -2).astype(rt.compute_dtype)
  else:  # quantized: XLA's matvec dequantizes it (`_fused_step`)
    w_in = q(w)
  norm = p["norm"].reshape(*pre, 1, d)  # as the kernel reads it, so no step reshapes it
  return {"norm": norm, "in_proj": w_in, "small": pack_small(p), "out_proj": q(p["out_proj"])}


def _fused_step(p, x, cfg: Mamba2Config, rt: Runtime, state, block: bool):
  """The fused step (`fused_decode`) of a mixer (x: its input u) or, with block, of
  the whole pre-norm residual block (x: the residual stream h): three TPU kernels,
  in_proj (after the pre-norm), the step between the matmuls, and out_proj (with
  the residual add), the two projections streaming their weight from HBM in column
  tiles (`decode_pallas.norm_in_proj`, `out_proj_residual`). Quantized weights
  (matmul_precision int8 / fp8) take XLA's dequantizing matvecs around the step
  kernel instead: the projection kernels read plain weights."""
  if "small" not in p:  # weights not made for it before the loop: joined here, every step
    p = fused_decode_weights(p, rt)
  cd, prec, interpret = rt.compute_dtype, rt.matmul_precision, rt.decode_impl == "interpret"
  # Weights and states held in HBM for the kernels' own DMAs, except in a layer scan,
  # where they are XLA's slices of the stacked ones (`decode_pallas.in_hbm`).
  kw = dict(compute_dtype=cd, interpret=interpret, hbm=rt.decode_layers != "scan")
  plain = isinstance(p["in_proj"], jax.Array) and isinstance(p["out_proj"], jax.Array)
  if plain:
    proj = norm_in_proj(x, p["in_proj"], p["norm"] if block else None, eps=cfg.norm_eps, **kw)
  else:
    proj = mm.linear(rms_norm(x, p["norm"], cfg.norm_eps) if block else x, p["in_proj"], cd, prec)
  y, conv_x, conv_bc, ssm = mixer_step_fused(
      proj, state["conv_x"], state["conv_bc"], state["ssm"], p["small"], ngroups=cfg.ngroups, eps=cfg.norm_eps,
      dt_limit=cfg.dt_limit, **kw)
  if plain:
    out = out_proj_residual(y, p["out_proj"], x if block else None, residual_multiplier=cfg.residual_multiplier,
                            **kw)
  else:
    out = mm.linear(y, p["out_proj"], cd, prec)
    out = residual(x, out, cfg) if block else out
  return out, {"conv_x": conv_x, "conv_bc": conv_bc, "ssm": ssm}


def mixer_step(p, u, cfg: Mamba2Config, rt: Runtime, state):
  """One position through the mixer, for decoding. u: (b, d). Returns (b, d), new state.
  p: the layer's parameters, or (the fused step) `fused_decode_weights` of them."""
  b = u.shape[0]
  if fused_decode(cfg, rt):
    return _fused_step(p, u, cfg, rt, state, block=False)
  z, xr, bc, dt_raw = _project_in(p, u, rt)
  x, conv_x = causal_conv(xr[:, None], p["conv_x"], p["conv_x_bias"], state["conv_x"])
  bc, conv_bc = causal_conv(bc[:, None], p["conv_bc"], p["conv_bc_bias"], state["conv_bc"])
  x, bc = jax.nn.silu(x[:, 0]), jax.nn.silu(bc[:, 0])
  dt, A = _dt_and_A(p, dt_raw, cfg)
  g, n, h, hp = cfg.ngroups, cfg.d_state, cfg.nheads, cfg.headdim
  args = (x.reshape(b, h, hp), dt, A, bc[:, 0].reshape(b, g, n), bc[:, 1].reshape(b, g, n))
  if cfg.ssd_window:
    y, (wx, wb, wa) = ssd_window_step((state["win_x"], state["win_B"], state["win_a"]), *args, D=p["D"])
    new = {"win_x": wx, "win_B": wb, "win_a": wa}
  else:
    y, ssm = ssd_step(state["ssm"], *args, D=p["D"])
    new = {"ssm": ssm}
  out = _project_out(p, y.reshape(b, h * hp), z, cfg, rt)
  return out, {"conv_x": conv_x, "conv_bc": conv_bc, **new}


def residual(h, out, cfg: Mamba2Config):
  """The residual stream after a layer: h + out, or h + residual_multiplier * out
  (Granite); float32."""
  return h + out if cfg.residual_multiplier == 1.0 else h + cfg.residual_multiplier * out


def block(p, h, cfg, rt, **kw):
  """Pre-norm residual block: h + mixer(rmsnorm(h)); the residual stays float32."""
  out, state = mixer(p, rms_norm(h, p["norm"], cfg.norm_eps), cfg, rt, **kw)
  return residual(h, out, cfg), state


def block_step(p, h, cfg, rt, state):
  """`block` for one position (h: (b, d)), from and to a layer state."""
  if fused_decode(cfg, rt):  # the pre-norm and the residual inside the projection kernels
    return _fused_step(p, h, cfg, rt, state, block=True)
  out, state = mixer_step(p, rms_norm(h, p["norm"], cfg.norm_eps), cfg, rt, state)
  return residual(h, out, cfg), state


def unstack(tree, n: int) -> list:
  """[tree with every leaf's index i along axis 0, for i < n]: layer-stacked -> per layer."""
  return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(n)]


_save_names = jax.checkpoint_policies.save_only_these_names
_REMAT_POLICIES = {
    "full": None,  # recompute everything in the backward pass
    # The in_proj results (one (b, l, 2i + 2gn) buffer in the compute dtype, and dt):
    # the backward pass recomputes only what is cheap from them (the conv + SiLU, the
    # dt softplus, the SSD's forward, the gate and norm), not the pre-norm and the
    # in_proj matmul with its weight's read.
    "save_in_proj": _save_names(*IN_PROJ_NAMES),
    # And the SSD kernels' output and entering states (Pallas on TPU, Triton on
    # GPUs), so the backward pass does not run the forward kernel again.
    "save_in_proj_ssd": _save_names(*IN_PROJ_NAMES, *SSD_PALLAS_SAVE_NAMES, *SSD_GPU_SAVE_NAMES),
    # The GPU SSD kernels' output and entering states too: without them the backward
    # pass runs the forward kernel again (for 1.3b on 8 H100s, 4 x 2048 a GPU, about
    # 5% of the step's bytes, for 16 GiB a GPU: docs/bench/gpu.md).
    "save_matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*SSD_GPU_SAVE_NAMES)),
}


@functools.partial(jax.jit, static_argnums=0)
def _init_params(cfg: Mamba2Config, key) -> dict[str, Any]:
  # Two random draws in all, in one compiled program: XLA:CPU compiles each
  # threefry call slowly (seconds), so per-tensor draws made init take a minute.
  # (A hybrid's attention and MLP layers draw from keys folded off `key`, not from
  # `key_layers`: the Mamba-2 layers' draws then depend on the seed and their count
  # alone, the same in a pure model as in any pattern.)
  key_emb, key_layers = jax.random.split(key)
  v, d = cfg.padded_vocab_size, cfg.d_model
  n_emb = 1 if cfg.tie_embeddings else 2
  emb = 0.02 * jax.random.normal(key_emb, (n_emb, v, d), F32)
  out = {"embedding": emb[0], "norm_f": jnp.ones((d,), F32)}
  if cfg.count(MAMBA):
    per_layer = sum(math.prod(s) for s in _block_uniform_shapes(cfg).values())
    u = jax.random.uniform(key_layers, (cfg.count(MAMBA), per_layer), F32)
    out["layers"] = jax.vmap(lambda r: init_block_params(cfg, r))(u)
  for salt, kind, shapes, out_names in (
      (1, ATTENTION, attn_lib.attn_shapes(cfg), ("o_proj",)),
      (2, MLP, attn_lib.mlp_shapes(cfg), ("down_proj",))):
    if cfg.count(kind):
      u = jax.random.uniform(jax.random.fold_in(key, salt),
                             (cfg.count(kind), attn_lib.draws(shapes)), F32)
      out[KIND_PARAMS[kind]] = jax.vmap(lambda r: attn_lib.init_params(shapes, out_names, cfg, r))(u)
  if cfg.count(MOE):
    keys = jax.random.split(jax.random.fold_in(key, 3), cfg.count(MOE))
    out[KIND_PARAMS[MOE]] = jax.vmap(lambda k: moe_lib.init_params(cfg, k))(keys)
  if not cfg.tie_embeddings:
    out["lm_head"] = emb[1]
  return out


class Mamba2LM(nnx.Module):
  """Mamba-2 language model. `model(input_ids) -> logits (b, l, vocab_size)` in float32.

  `config` is the architecture; `runtime` how it runs (default `Runtime()`), resolved
  for JAX's default backend unless the caller resolved it for another target.
  """

  def __init__(self, config: Mamba2Config, *, rngs: nnx.Rngs, runtime: Runtime | None = None):
    self.config = config
    self.runtime = (runtime or Runtime()).resolve()
    # LoRA (model/lora.py): the spec and the adapters, set by `from_params`; None without.
    self.lora: lora_lib.LoraSpec | None = None
    self.adapters = nnx.data(None)
    # The adapters' dropout key for this training step (`lora.dropout`); None: no dropout.
    self.dropout_key = nnx.data(None)
    init = _init_params(config, rngs.params())
    self.embedding = _param(init["embedding"], ("vocab", "embed"))
    for kind, attr in KIND_PARAMS.items():
      if config.count(kind):
        setattr(self, attr, nnx.Dict({name: _param(init[attr][name], ("layers",) + axes)
                                      for name, axes in kind_axes(config, kind).items()}))
    self.norm_f = _param(init["norm_f"], ("embed",))
    if not config.tie_embeddings:
      self.lm_head = _param(init["lm_head"], ("vocab", "embed"))

  # -- pieces, also used by training (loss on hidden states) and generation --

  def layer_params(self, kind: str = MAMBA) -> dict[str, Array]:
    """The stacked parameters of the layers of `kind` (default the Mamba-2 ones)."""
    stack = getattr(self, KIND_PARAMS[kind])
    return {name: stack[name].get_value() for name in kind_axes(self.config, kind)}

  def _compute_params(self, kind: str) -> dict[str, Array]:
    """`layer_params(kind)` with the matmul weights in the compute dtype: cast once
    for the whole stack, before the layer loop, not inside every layer (where each
    use, and a remat's recompute, reads the float32 weight and writes a copy),
    and a sharded stack is gathered per layer in the compute dtype. Gradients are
    the same: a cast's cotangent is rounded to the cast dtype either way.

    With adapters the weights stay as stored (float32, or quantized) and travel with
    the kind's adapters under ADAPTERS: each layer merges (or, on the separate path,
    dequantizes) and casts its own (`_layer_fns`), so no whole merged or dequantized
    stack is made. On the separate path the adapters travel as `matmul.LayerAdapters`
    with one dropout key per layer when the model has a dropout key."""
    if self.lora is None:
      return self._matmuls_in_compute_dtype(self.layer_params(kind))
    ab = self.adapters.get(KIND_PARAMS[kind], {})
    if not self.lora.separate:
      return {**self.layer_params(kind), ADAPTERS: ab}
    keys = None
    if self.dropout_key is not None:
      salt = list(KIND_PARAMS).index(kind)
      keys = jax.random.split(jax.random.fold_in(self.dropout_key, salt), self.config.count(kind))
    return {**self.layer_params(kind),
            ADAPTERS: mm.LayerAdapters(ab, keys, self.lora.scale, self.lora.dropout)}

  def _merged_layer(self, p: dict[str, Array]) -> dict[str, Array]:
    """One layer's weights with its adapters merged in, matmuls in the compute dtype;
    on the separate path the base as it is (dequantized) and the adapters beside it."""
    weights = {n: a for n, a in p.items() if n != ADAPTERS}
    if self.lora.separate:
      return {**self._matmuls_in_compute_dtype({n: lora_lib.dense(w) for n, w in weights.items()}),
              ADAPTERS: p[ADAPTERS]}
    return self._matmuls_in_compute_dtype(lora_lib.merge_layer(weights, p[ADAPTERS], self.lora))

  def _matmuls_in_compute_dtype(self, params: dict[str, Array]) -> dict[str, Array]:
    cd = jnp.dtype(self.runtime.compute_dtype)
    return {n: a.astype(cd) if n in MATMUL_WEIGHTS else a for n, a in params.items()}

  def _kinds(self) -> list[str]:
    return [k for k in KIND_PARAMS if self.config.count(k)]

  def _layer_fns(self, *, seq_idx=None, mask=None, decode=False):
    """kind -> f(p, h, state) -> (h, state): one residual block of that kind, over
    a sequence (h (b, l, d)) or, with decode, one position (h (b, d))."""
    cfg, rt = self.config, self.runtime
    norm = lambda p, h: rms_norm(h, p["norm"], cfg.norm_eps)
    if decode:
      def attn(p, h, st):
        out, st = attn_lib.attention_step(p, norm(p, h), cfg, rt, st)
        return residual(h, out, cfg), st
      return {MAMBA: lambda p, h, st: block_step(p, h, cfg, rt, st), ATTENTION: attn,
              MLP: lambda p, h, st: (residual(h, attn_lib.mlp(p, norm(p, h), cfg, rt), cfg), None),
              MOE: lambda p, h, st: (residual(h, moe_lib.moe(p, norm(p, h), cfg, rt)[0], cfg), None)}
    act = lambda h: sharding.constrain(h, ("batch", "act_length", "act_embed"))

    def mamba(p, h, st):
      h, st = block(p, h, cfg, rt, seq_idx=seq_idx, mask=mask, state=st)
      return act(h), st

    def attn(p, h, _):
      out, kv = attn_lib.attention(p, norm(p, h), cfg, rt, seq_idx=seq_idx, mask=mask)
      return act(residual(h, out, cfg)), kv

    def mlp(p, h, _):
      return act(residual(h, attn_lib.mlp(p, norm(p, h), cfg, rt), cfg)), None

    def moe(p, h, _):  # its router statistics travel as its state (moe.STATS)
      out, stats = moe_lib.moe(p, norm(p, h), cfg, rt)
      return act(residual(h, out, cfg)), stats

    fns = {MAMBA: mamba, ATTENTION: attn, MLP: mlp, MOE: moe}
    if self.lora is not None:  # inside the remat: the backward pass merges again, nothing is kept
      fns = {k: (lambda p, h, st, f=f: f(self._merged_layer(p), h, st)) for k, f in fns.items()}
    return fns

  def _remat(self):
    """`pattern.run`'s remat: the runtime's policy, or None for 'none'."""
    policy = self.runtime.remat
    if policy == "none":
      return None
    return lambda f, prevent_cse: jax.checkpoint(f, policy=_REMAT_POLICIES[policy], prevent_cse=prevent_cse)

  def _by_kind(self, states) -> dict[str, Any]:
    """A flat states dict -> {kind: its states} (kinds without state: None)."""
    return {k: ({n: states[n] for n in state_keys(self.config, k)} if STATE_KEYS[k] else None)
            for k in self._kinds()}

  @staticmethod
  def _flat(by_kind) -> dict[str, Array]:
    return {n: a for st in by_kind.values() if st is not None for n, a in st.items()}

  def embed(self, input_ids):
    """The embedding rows of input_ids (..., d) float32, times embedding_multiplier (Granite)."""
    h = jnp.take(self.embedding.get_value(), input_ids, axis=0)
    m = self.config.embedding_multiplier
    return h if m == 1.0 else h * m

  def head_operands(self, h):
    """(x, w) whose product x w^T is the logits (padded vocabulary) of the residual
    stream h (..., d): what the blockwise loss takes. x is the final norm of h and w
    the head (float32), merged with its adapter; on LoRA's separate path the
    adapter instead joins as r more columns, x = [norm(h), scale dropout(norm(h)) A]
    and w = [W, B^T], so the loss's one matmul runs it (its backward forms the
    gradient of every column, the base's too, as it does for a merged head)."""
    x = self.final_norm(h)
    ad = self.adapters.get(lora_lib.HEAD) if self.lora is not None else None
    if ad is None or not self.lora.separate:
      return x, self.head_weight()
    w = (self.embedding if self.config.tie_embeddings else self.lm_head).get_value()
    key = None if self.dropout_key is None else jax.random.fold_in(self.dropout_key, len(KIND_PARAMS))
    adapter = mm.Adapter(ad["a"], ad["b"], key, self.lora.scale, self.lora.dropout)
    xa = adapter.project_in(x, self.runtime.compute_dtype)
    return jnp.concatenate([x, xa], -1), jnp.concatenate([lora_lib.dense(w), ad["b"].T], -1)

  def head_weight(self):
    """The LM head (padded vocabulary, d) float32, with its adapter when it has one."""
    w = (self.embedding if self.config.tie_embeddings else self.lm_head).get_value()
    if self.lora is not None:
      return lora_lib.merge_head(w, self.adapters.get(lora_lib.HEAD), self.lora)
    return w

  def final_norm(self, h):
    """The norm before the LM head: (..., d) float32; divided by logits_scaling
    (Granite) here, so every product with the head (logits, the blockwise loss,
    decoding) gives logits / logits_scaling."""
    x = rms_norm(h, self.norm_f.get_value(), self.config.norm_eps)
    s = self.config.logits_scaling
    return x if s == 1.0 else x / s

  def head_for_logits(self, decode: bool = False):
    """The LM head as `logits` multiplies by it: (vocab_size, d) in the compute dtype;
    for decoding (`decode`), quantized once in the runtime's matmul_precision."""
    # The padding rows are dropped from the weight, inside its cast to the compute
    # dtype, not from the logits: slicing (b, l, padded vocab) logits copies them.
    w = self.head_weight()[: self.config.vocab_size]
    if decode:
      return mm.quantize_head(w, self.runtime.matmul_precision, self.runtime.compute_dtype)
    return w.astype(self.runtime.compute_dtype)

  def logits(self, h, head=None):
    """Final norm and LM head: (..., d) -> (..., vocab_size) float32 (padding rows
    dropped). head: `head_for_logits()` computed once by a caller that reuses it
    (a decode loop), else made here."""
    w = self.head_for_logits() if head is None else head
    return mm.head(self.final_norm(h), w, self.runtime.compute_dtype)

  def backbone(self, input_ids, *, seq_idx=None, mask=None, states=None):
    """Embedding and all blocks. Returns the residual stream (b, l, d) before the
    final norm, and the per-layer states stacked over each kind's layers: the
    Mamba-2 layers' recurrent states (continued from `states` when given), an
    attention layer's keys and values {k, v} (b, l, kv, e) (`Mamba2Cache.from_prefill`
    puts them in a decoding buffer), a mixture-of-experts layer's router
    statistics (`moe.STATS`: tokens per expert, auxiliary loss)."""
    cfg = self.config
    h = sharding.constrain(self.embed(input_ids), ("batch", "act_length", "act_embed"))
    b = input_ids.shape[0]
    if states is not None and cfg.count(ATTENTION):
      raise ValueError("backbone cannot continue attention layers from earlier states; "
                       "run the whole prefix, or decode with `step`")
    if states is not None and cfg.ssd_window:
      raise ValueError(f"backbone cannot continue a windowed model (ssd_window={cfg.ssd_window}) "
                       "from earlier states: run the whole prefix, or decode with `step`")
    init = {}
    if cfg.count(MAMBA):
      init[MAMBA] = (states if states is not None else
                     jax.vmap(lambda _: zero_state(cfg, b))(jnp.arange(cfg.count(MAMBA))))
    h, new = pattern_lib.run(pattern_lib.plan(cfg.pattern), self._layer_fns(seq_idx=seq_idx, mask=mask),
                             {k: self._compute_params(k) for k in self._kinds()}, init, h,
                             unroll=self.runtime.unroll_layers, remat=self._remat())
    return h, self._flat(new)

  def step(self, input_ids, states, layers=None):
    """One token per sequence through every block, for decoding: input_ids (b,),
    states stacked over layers as a `Mamba2Cache` holds them. Returns the residual
    stream (b, d) before the final norm and the new states. Never goes through
    the chunked scan, so a Mamba-2 layer's step costs the same at any context
    length; an attention layer's grows with its buffer's capacity. layers: the
    stacked layer parameters per kind to use instead of the model's
    (`decode_layers(unrolled=False)`)."""
    if self.lora is not None:
      raise ValueError("decode a model with adapters through `merged()` (generate does)")
    if layers is None:
      layers = {k: self.layer_params(k) for k in self._kinds()}
    h, new = pattern_lib.run(pattern_lib.plan(self.config.pattern), self._layer_fns(decode=True),
                             layers, self._by_kind(states), self.embed(input_ids))
    return h, self._flat(new)

  def decode_layers(self, unrolled: bool):
    """The layer parameters a decode loop reads every token, made once before the
    loop: the matmul weights (`MATMUL_WEIGHTS`) already in the compute dtype, or
    quantized once in the runtime's matmul_precision (`matmul.quantize_weights`),
    so no step converts them again (the converted values are the ones each step
    would make, so the tokens are the same); norms, conv, dt, A and D stay
    float32. Per layer in pattern order for `step_unrolled` (unrolled), else
    stacked per kind for `step`."""
    if self.lora is not None:
      raise ValueError("decode a model with adapters through `merged()` (generate does)")
    if unrolled:
      return [self._decode_weights(p, 0) for p in self.unstacked_layers()]
    return {k: self._decode_weights(self.layer_params(k), 1) for k in self._kinds()}

  def _decode_weights(self, params: dict[str, Array], lead: int) -> dict[str, Array]:
    rt = self.runtime
    if "in_proj_zx" in params and fused_decode(self.config, rt):
      return fused_decode_weights(params, rt, lead)
    return {n: (mm.quantize_weights(a, rt.matmul_precision, 2 if n == "o_proj" else 1, rt.compute_dtype, lead)
                if n in MATMUL_WEIGHTS else a) for n, a in params.items()}

  def unstacked_layers(self) -> list[dict[str, Array]]:
    """Each layer's parameters as separate arrays (copies), in pattern order, for
    `step_unrolled`."""
    per_kind = {k: iter(unstack(self.layer_params(k), self.config.count(k))) for k in self._kinds()}
    return [next(per_kind[k]) for k in self.config.pattern]

  def unstack_states(self, states) -> list:
    """Stacked states (as `step` takes them) -> one per layer in pattern order
    (None for an MLP layer), for `step_unrolled`."""
    per_kind = {k: iter(unstack(st, self.config.count(k)) if st is not None else [])
                for k, st in self._by_kind(states).items()}
    return [next(per_kind[k], None) for k in self.config.pattern]

  def stack_states(self, per_layer: list) -> dict[str, Array]:
    """The inverse of `unstack_states`."""
    by_kind = {}
    for k in self._kinds():
      mine = [st for kind, st in zip(self.config.pattern, per_layer) if kind == k]
      if state_keys(self.config, k):
        by_kind[k] = jax.tree.map(lambda *a: jnp.stack(a), *mine)
    return self._flat(by_kind)

  def step_unrolled(self, input_ids, layers, states):
    """`step` with the layers unrolled over per-layer parameters and states (lists
    in pattern order: `unstacked_layers()`, and `unstack_states(states)`).

    Decoding is memory-bound: each step reads every weight once. Inside a layer
    scan XLA:CPU first copies the layer's slice of each stacked weight, then
    multiplies, so a step moves the weights twice or more. The decode loop
    unstacks the weights once, before it starts (`decode_layers`), and runs this;
    compile time grows with depth instead (figures: docs/bench/design_notes.md,
    docs/bench/decode_tpu.md).
    """
    fns = self._layer_fns(decode=True)
    h, new = self.embed(input_ids), []
    for kind, p, state in zip(self.config.pattern, layers, states):
      h, state = fns[kind](p, h, state)
      new.append(state)
    return h, new

  def __call__(self, input_ids, *, seq_idx=None):
    h, _ = self.backbone(input_ids, seq_idx=seq_idx)
    return self.logits(h)

  # -- parameters as a plain nested dict (the paths conversion and checkpoints use) --

  def params(self) -> dict[str, Any]:
    out = {"embedding": self.embedding.get_value(), "norm_f": self.norm_f.get_value()}
    out.update({KIND_PARAMS[k]: self.layer_params(k) for k in self._kinds()})
    if not self.config.tie_embeddings:
      out["lm_head"] = self.lm_head.get_value()
    return out

  def merged(self) -> "Mamba2LM":
    """This model with its adapters merged into the weights (itself without adapters)."""
    if self.lora is None:
      return self
    params = lora_lib.merge(self.params(), self.adapters, self.lora)
    # An adapted tied head is no longer the embedding: the merged model unties it.
    cfg = self.config.replace(tie_embeddings=self.config.tie_embeddings and "lm_head" not in params)
    return Mamba2LM.from_params(cfg, params, self.runtime)

  @classmethod
  def from_params(cls, config: Mamba2Config, params: dict[str, Any], runtime: Runtime | None = None,
                  *, adapters: dict[str, Any] | None = None,
                  lora: lora_lib.LoraSpec | None = None, dropout_key=None) -> "Mamba2LM":
    """Build a model holding `params` (as `params()` returns them) without a random init;
    with `lora`, also its `adapters` (`lora.init_adapters`' layout), and the adapted
    weights of `params` may be quantized (`lora.quantize_base`); `dropout_key` (a
    training step's) turns the adapters' dropout on."""
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), runtime=runtime))
    bad = shape_problems(param_shapes(model.params()), param_shapes(params))
    if lora is not None:
      bad += shape_problems(param_shapes(lora_lib.adapter_shapes(model.params(), lora)), param_shapes(adapters))
    if bad:
      raise ValueError(f"Parameters do not match the model config: {'; '.join(bad)}")
    weight = lambda a: a if lora_lib.is_quantized(a) else jnp.asarray(a, F32)
    model.embedding.set_value(weight(params["embedding"]))
    model.norm_f.set_value(weight(params["norm_f"]))
    for kind in model._kinds():
      attr = KIND_PARAMS[kind]
      for name in kind_axes(config, kind):
        getattr(model, attr)[name].set_value(weight(params[attr][name]))
    if not config.tie_embeddings:
      model.lm_head.set_value(weight(params["lm_head"]))
    if lora is not None:
      model.lora, model.adapters = lora, nnx.data(adapters)
      model.dropout_key = nnx.data(dropout_key)
    return model


def param_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{'layers/A_log': shape, ...}: every array-like leaf of a parameter tree by its path."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): tuple(v.shape)
          for path, v in flat}


def shape_problems(wanted: dict[str, tuple], got: dict[str, tuple]) -> list[str]:
  """Every parameter whose shape in `got` differs from `wanted`, or that one side lacks."""
  msgs = []
  for name in sorted(set(wanted) | set(got)):
    w, g = wanted.get(name), got.get(name)
    if w is None:
      msgs.append(f"unexpected {name}")
    elif g is None:
      msgs.append(f"missing {name} (expected shape {w})")
    elif w != g:
      msgs.append(f"{name}: shape {g}, expected {w}")
  return msgs
