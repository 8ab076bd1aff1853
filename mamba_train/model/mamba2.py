"""The Mamba-2 layer: its mixer (in_proj, the causal conv + SiLU, dt and A, the SSD,
the gated RMSNorm, out_proj) over a sequence and for one decoding step, and the
pre-norm residual block around it; pure functions of a dict of one layer's arrays
(`params.BLOCK_PARAM_AXES`). The LM that stacks these blocks is `lm.py`.

Precision policy: parameters float32; the projections run in the runtime's compute
dtype (`runtime.Runtime`) with float32 accumulation and float32 results (in_proj's
z|x|B|C in the compute dtype, the one rounding they take anyway), or in its
matmul_precision (fp8, int8; every matmul goes through `matmul.linear`, which says
what stays float32); dt / A / decay, convolution, SSD and norms are float32.

Shapes: b batch, l length, d d_model, i d_inner (= h * p), h heads, p headdim,
g groups, n d_state, k conv kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

from mamba_train.model import matmul as mm
from mamba_train.model.config import Mamba2Config
from mamba_train.model.runtime import Runtime
from mamba_train.model.select import ops_for
from mamba_train.ops.layer_math import causal_conv, gated_rms_norm
from mamba_train.ops.ssd import ssd_step, ssd_window_step
from mamba_train.ops.table import Ops
from mamba_train.parallel import sharding

F32 = jnp.float32
Array = jax.Array


def rms_norm(x, weight, eps):
  x = x.astype(F32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _dt_and_A(p, dt_raw, cfg):
  dt = jax.nn.softplus(dt_raw.astype(F32) + p["dt_bias"])
  lo, hi = cfg.dt_limit
  if lo > 0.0 or hi < math.inf:
    dt = jnp.clip(dt, lo, hi)
  return dt, -jnp.exp(p["A_log"])


# Names of the in_proj results a remat policy can save (`lm.remat_policy`): z|x|B|C
# (b, l, 2i + 2gn) in the compute dtype, and dt before its softplus (b, l, h) float32.
IN_PROJ_NAMES = ("mamba_in_proj", "mamba_in_proj_dt")


def _project_in(p, u, rt, split: bool = False, joined_z: bool = False):
  """z, x, B|C and dt from the block input u. z|x|B|C is one matmul on the weights
  joined inside their cast to the compute dtype (one weight read, one dot), written
  by the GEMM in the compute dtype (float32 accumulation, one rounding); dt is a
  second, small (h columns) matmul with a float32 result, so that the large output
  never crosses HBM in float32 (its float32 write, reads and cotangent were the
  largest bytes of a GPU layer: docs/bench/gpu.md). With an
  adapter on in_proj (its B spans all five pieces) the five stay one float32 dot.
  split (`Ops.split_in_proj`): z, x and B|C as three GEMM outputs instead. joined_z
  (`Ops.norm_gate_joined`): z as the joined z|x|B|C output itself, the gate its first
  d_inner channels, for a norm that reads it in place."""
  cd, prec = jnp.dtype(rt.compute_dtype), rt.matmul_precision
  zx, bcw, dtw = p["in_proj_zx"], p["in_proj_bc"], p["in_proj_dt"]
  if u.ndim == 2:  # one position (decoding)
    zxr, bc, dt_raw = _project_in_step(p, u, rt)
    return zxr[..., 0, :], zxr[..., 1, :], bc, dt_raw
  d, i, gn = zx.shape[0], zx.shape[2], bcw.shape[2]
  adapter = mm.adapter_of(p, "in_proj")
  if adapter is None and split:
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
  z, x = (r if joined_z else r[..., :i]), r[..., i:2 * i]
  bc = r[..., 2 * i:].reshape(*r.shape[:-1], 2, gn)
  return z, x, bc, dt_raw


def _project_in_fused(p, u, rt):
  """in_proj for the fused layer (`ops.mixer`): z|x (b, l, 2i) as one GEMM writes them
  (compute dtype), on in_proj_zx's (d, 2, i) weight read as (d, 2i); B|C (b, l, 2, g n)
  (compute dtype) and dt (b, l, h) (float32) sliced from a second GEMM's float32
  result. The kernels read z's and x's blocks out of z|x in place, and write their
  gradients back into one joined cotangent, so in_proj's forward, weight-gradient and
  input-gradient GEMMs are one each for z|x (docs/bench/fused_layer.md, "One z|x").
  B|C is not joined to z|x: that would copy the weights into one (d, 2i + 2gn) matrix
  every step, for a GEMM reading u once less. Joined to dt's small weight instead, it
  makes the second and third GEMMs one, in both passes ("B|C with dt")."""
  cd, prec = jnp.dtype(rt.compute_dtype), rt.matmul_precision
  zxw, bcw, dtw = p["in_proj_zx"], p["in_proj_bc"], p["in_proj_dt"]
  d, i = zxw.shape[0], zxw.shape[2]
  adapter = mm.adapter_of(p, "in_proj")
  if adapter is not None:  # the adapter's B spans all five pieces: one float32 dot, sliced
    z, x, bc, dt_raw = _project_in(p, u, rt)
    return checkpoint_name(jnp.concatenate([z, x], -1), IN_PROJ_NAMES[0]), bc, dt_raw
  zx = checkpoint_name(mm.linear(u, zxw.reshape(d, 2 * i).astype(cd), cd, prec, out_dtype=cd), IN_PROJ_NAMES[0])
  # B|C and dt as one GEMM with a float32 result (u read once for both): B|C rounded
  # to the compute dtype after it is what a GEMM writing it so gives.
  gn2 = 2 * bcw.shape[-1]
  r = mm.linear(u, jnp.concatenate([bcw.reshape(d, gn2).astype(cd), dtw.astype(cd)], 1), cd, prec)
  bc = checkpoint_name(r[..., :gn2].astype(cd).reshape(*r.shape[:-1], 2, gn2 // 2), IN_PROJ_NAMES[0])
  return zx, bc, checkpoint_name(r[..., gn2:], IN_PROJ_NAMES[1])


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


def mixer(p, u, cfg: Mamba2Config, rt: Runtime, *, seq_idx=None, mask=None, state=None, ops: Ops | None = None):
  """The Mamba-2 mixer over a sequence, run as `rt` (a resolved runtime) says.

  u: (b, l, d) float32. seq_idx: (b, l) document ids. mask: (b, l) bool, False on
  padding: there the conv input and dt are zero, so padding cannot touch the
  state. state: a layer state (see `zero_state`) to continue from. ops: who runs the
  conv, the SSD and the norm (`select.ops_for(cfg, rt)` unless given).
  Returns (b, l, d) float32 and the layer state after the last position.
  """
  ops = ops_for(cfg, rt) if ops is None else ops
  b, l, _ = u.shape
  cd = jnp.dtype(rt.compute_dtype)
  if ops.mixer is not None and mask is None:
    # The layer between the matmuls as one op (an unpadded sequence).
    return _mixer_fused(p, *_project_in_fused(p, u, rt), cfg, rt, ops, state, seq_idx)
  if state is None:
    state = zero_state(cfg, b)
  z, xr, bc, dt_raw = _project_in(p, u, rt, ops.split_in_proj, ops.norm_gate_joined and ops.mixer is None)
  if mask is not None:
    xr = jnp.where(mask[..., None], xr, 0.0)
    bc = jnp.where(mask[..., None, None], bc, 0.0)
  # With the length split over devices (the 'sequence' mesh axis), the conv and
  # the SSD run per slice and exchange a halo and state summaries (parallel/sequence.py;
  # `ops` wraps them so).
  x, conv_x = ops.conv(xr, p["conv_x"], p["conv_x_bias"], state["conv_x"], seq_idx)
  bc, conv_bc = ops.conv(bc, p["conv_bc"], p["conv_bc_bias"], state["conv_bc"], seq_idx)
  dt, A = _dt_and_A(p, dt_raw, cfg)
  if mask is not None:
    dt = jnp.where(mask[..., None], dt, 0.0)
  g, n, h, hp = cfg.ngroups, cfg.d_state, cfg.nheads, cfg.headdim
  x = sharding.constrain(x.reshape(b, l, h, hp), ("batch", "act_length", "act_inner", None))
  chunk = ops.ssd_chunk
  x = x.astype(cd)
  chunk_major = ops.ssd_chunk_major and l % chunk == 0
  if chunk_major:
    # The kernels read x chunk-major with positions minor, (c, b, h, p, q): the
    # conv's fusion writes it so, not (b, l, i) and then a transposed copy.
    x = with_layout_constraint(x.reshape(b, l // chunk, chunk, h * hp), _CHUNK_MAJOR).reshape(b, l, h, hp)
  ssd_args = (x, dt, A, bc[:, :, 0].reshape(b, l, g, n), bc[:, :, 1].reshape(b, l, g, n), chunk)
  ssd_kw = dict(D=p["D"], initial_state=state.get("ssm"), seq_idx=seq_idx)
  if cfg.ssd_window:
    ssd_kw["window"] = cfg.ssd_window
  y, ssm = ops.ssd(*ssd_args, **ssd_kw)
  y = y.reshape(b, l, h * hp)
  if chunk_major:
    y = with_layout_constraint(y.reshape(b, l // chunk, chunk, h * hp), _CHUNK_MAJOR).reshape(b, l, h * hp)
  if ops.ssd_y_positions_minor:
    # The kernel writes y positions-minor; turned channels-minor here, in y's
    # dtype, the gate, norm and out_proj read it as they read z. Left to XLA, it
    # widens y to float32 and transposes and retiles that (3 float32 copies).
    y = with_layout_constraint(y, Layout(major_to_minor=(0, 1, 2)))
  out = _project_out(p, y, z, cfg, rt, ops.norm)
  if cfg.ssd_window:
    return out, {"conv_x": conv_x, "conv_bc": conv_bc,
                 **window_tail(x, dt, A, ssd_args[3], cfg.ssd_window, seq_idx)}
  return out, {"conv_x": conv_x, "conv_bc": conv_bc, "ssm": ssm}


_MIXER_WEIGHTS = ("conv_x", "conv_x_bias", "conv_bc", "conv_bc_bias", "dt_bias", "A_log", "D")


def _mixer_fused(p, zx, bc, dt_raw, cfg: Mamba2Config, rt: Runtime, ops: Ops, state, seq_idx):
  """`mixer` through `ops.mixer` (`layer_math.mixer_core`'s contract): the op writes the
  gated y and each row's sums of squares per group; the norm is folded into out_proj,
  out = rsqrt(ms) (y @ (diag(w) W)) with one group, so no normalised copy of y is
  written: the weight scaling is weight-sized, the row scaling fuses into the GEMM's
  output. Several groups scale y per group on the GEMM's operand; with an adapter on
  out_proj, which reads the normalised y, the whole norm is applied to y first."""
  b, l, i = zx.shape[0], zx.shape[1], zx.shape[2] // 2
  g, k = cfg.ngroups, cfg.d_conv
  # The kernels read z|x and write the gated y (and in the backward read its
  # cotangent and write dz|dx) row-major, as the GEMMs write and read them: no layout
  # constraint, no relayout copies (ops/layer_fused_tpu.py).
  # No state given: the op starts from zeros it need not read (the kernel makes them on chip).
  front_x, front_bc, initial = (None,) * 3 if state is None else (state["conv_x"], state["conv_bc"], state["ssm"])
  gated, ssq, ssm = ops.mixer(zx, bc, dt_raw, {name: p[name] for name in _MIXER_WEIGHTS}, ops.ssd_chunk,
                              ngroups=g, dt_limit=cfg.dt_limit, front_x=front_x,
                              front_bc=front_bc, initial_state=initial, seq_idx=seq_idx)
  rstd = jax.lax.rsqrt(ssq / (i // g) + cfg.norm_eps)  # (b, l, g) float32
  cd, prec = rt.compute_dtype, rt.matmul_precision
  adapter = mm.adapter_of(p, "out_proj")
  if adapter is not None:
    y = (gated.astype(F32).reshape(b, l, g, i // g) * rstd[..., None]).reshape(b, l, i) * p["gate_norm"]
    out = mm.linear(y, p["out_proj"], cd, prec, 1, adapter)
  elif g == 1:
    out = mm.linear_row_scaled(gated, p["out_proj"] * p["gate_norm"][:, None], rstd, cd, prec)
  else:  # a scale per group of a row: on out_proj's operand (XLA fuses it into the GEMM's operand)
    y = (gated.astype(F32).reshape(b, l, g, i // g) * rstd[..., None]).reshape(b, l, i)
    out = mm.linear(y, p["out_proj"] * p["gate_norm"][:, None], cd, prec)
  # The conv states after the sequence: its last k - 1 inputs (the front's where it is shorter).
  def tail(v, front):
    front = jnp.zeros((b, k - 1, *v.shape[2:]), v.dtype) if front is None else front.astype(v.dtype)
    return jnp.concatenate([front, v], 1)[:, -(k - 1):].astype(F32)
  return out, {"conv_x": tail(zx[..., i:], front_x), "conv_bc": tail(bc, front_bc), "ssm": ssm}


def fused_decode_weights(p, rt: Runtime, ops: Ops, lead: int = 0) -> dict[str, Array]:
  """A Mamba-2 layer's weights as the fused step reads them (`ops.decode`), made
  once before a decode loop (`Mamba2LM.decode_layers`; `lead` stacked axes): in_proj
  joined into one (d, 2i + 2g*n + h) matmul weight, so a token is one dot, not
  three, and the small parameters packed into one array (`decode_tpu.pack_small`);
  both matmul weights in the compute dtype or quantized as `_decode_weights` does
  (per output channel, so joining changes no value). In the compute dtype, in_proj
  is stored transposed, (2i + 2g*n + h, d), as its kernel reads it
  (`decode_tpu.norm_in_proj`). The pre-norm's weight rides along as (1, d)."""
  zx = p["in_proj_zx"]
  pre, d = zx.shape[:lead], zx.shape[lead]
  w = jnp.concatenate([zx.reshape(*pre, d, -1), p["in_proj_bc"].reshape(*pre, d, -1), p["in_proj_dt"]], -1)
  q = lambda w: mm.quantize_weights(w, rt.matmul_precision, 1, rt.compute_dtype, lead)
  if rt.matmul_precision == "default":  # read by `decode_tpu.norm_in_proj`: (W, d), a row per output
    w_in = jnp.swapaxes(w, -1, -2).astype(rt.compute_dtype)
  else:  # quantized: XLA's matvec dequantizes it (`_fused_step`)
    w_in = q(w)
  norm = p["norm"].reshape(*pre, 1, d)  # as the kernel reads it, so no step reshapes it
  return {"norm": norm, "in_proj": w_in, "small": ops.decode.pack_small(p), "out_proj": q(p["out_proj"])}


def _fused_step(p, x, cfg: Mamba2Config, rt: Runtime, ops: Ops, state, block: bool):
  """The fused step (`ops.decode`) of a mixer (x: its input u) or, with block, of
  the whole pre-norm residual block (x: the residual stream h): three TPU kernels,
  in_proj (after the pre-norm), the step between the matmuls, and out_proj (with
  the residual add), the two projections streaming their weight from HBM in column
  tiles (`decode_tpu.norm_in_proj`, `out_proj_residual`). Quantized weights
  (matmul_precision int8 / fp8) take XLA's dequantizing matvecs around the step
  kernel instead: the projection kernels read plain weights."""
  if "small" not in p:  # weights not made for it before the loop: joined here, every step
    p = fused_decode_weights(p, rt, ops)
  cd, prec, kernels = rt.compute_dtype, rt.matmul_precision, ops.decode
  plain = isinstance(p["in_proj"], jax.Array) and isinstance(p["out_proj"], jax.Array)
  if plain:
    proj = kernels.norm_in_proj(x, p["in_proj"], p["norm"] if block else None, eps=cfg.norm_eps)
  else:
    proj = mm.linear(rms_norm(x, p["norm"], cfg.norm_eps) if block else x, p["in_proj"], cd, prec)
  y, conv_x, conv_bc, ssm = kernels.step(
      proj, state["conv_x"], state["conv_bc"], state["ssm"], p["small"], ngroups=cfg.ngroups, eps=cfg.norm_eps,
      dt_limit=cfg.dt_limit)
  if plain:
    out = kernels.out_proj_residual(y, p["out_proj"], x if block else None,
                                    residual_multiplier=cfg.residual_multiplier)
  else:
    out = mm.linear(y, p["out_proj"], cd, prec)
    out = residual(x, out, cfg) if block else out
  return out, {"conv_x": conv_x, "conv_bc": conv_bc, "ssm": ssm}


def mixer_step(p, u, cfg: Mamba2Config, rt: Runtime, state, ops: Ops | None = None):
  """One position through the mixer, for decoding. u: (b, d). Returns (b, d), new state.
  p: the layer's parameters, or (the fused step, `ops.decode`) `fused_decode_weights`
  of them."""
  ops = ops_for(cfg, rt) if ops is None else ops
  b = u.shape[0]
  if ops.decode is not None:
    return _fused_step(p, u, cfg, rt, ops, state, block=False)
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
  """Pre-norm residual block: h + mixer(rmsnorm(h)); the residual stays float32.
  kw: `mixer`'s (seq_idx, mask, state, ops)."""
  out, state = mixer(p, rms_norm(h, p["norm"], cfg.norm_eps), cfg, rt, **kw)
  return residual(h, out, cfg), state


def block_step(p, h, cfg, rt, state, ops: Ops | None = None):
  """`block` for one position (h: (b, d)), from and to a layer state."""
  ops = ops_for(cfg, rt) if ops is None else ops
  if ops.decode is not None:  # the pre-norm and the residual inside the projection kernels
    return _fused_step(p, h, cfg, rt, ops, state, block=True)
  out, state = mixer_step(p, rms_norm(h, p["norm"], cfg.norm_eps), cfg, rt, state, ops)
  return residual(h, out, cfg), state

