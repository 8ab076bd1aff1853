"""The Mamba-3 layer (arXiv 2603.15569; mamba_ssm's `modules/mamba3.py`): its mixer
over a sequence and for one decoding step, and the pre-norm residual block around
it; pure functions of a dict of one layer's arrays (`params.MAMBA3_PARAM_AXES`).

The mixer, in mamba_ssm's order:
  1. in_proj: [z, x, B, C, dd_dt, dd_A, trap, angles] (stored split: params.py);
  2. A = -max(f(dd_A), A_floor) per token and head (f: `Mamba2Config.A_activation`),
     dt = softplus(dd_dt + dt_bias), lam = sigmoid(trap);
  3. B and C: RMSNorm over n with weights B_norm / C_norm, broadcast from their
     groups to the heads, plus the per-head biases B_bias / C_bias (h, R, n);
  4. the angle theta_t = theta_{t-1} + pi tanh(angles_t) dt_t (per head through dt,
     restarted at a document's start), and B and C rotated by it: SISO the pairs
     (2i, 2i+1), MIMO the pairs (i, i + n/2), the first num_rope_angles pairs;
  5. the exponential-trapezoidal scan (`ops/ssd3.py`, through the selection table),
     with D, and under MIMO the values x * mimo_x (rank R, one y per rank);
  6. the output: y * silu(z), or (is_outproj_norm) RMSNorm of each head's y times
     gate_norm, then * silu(z); MIMO gates rank r with z * mimo_z[r] and sums the
     ranks weighted by mimo_o; then out_proj.

Precision policy, as the Mamba-2 layer's (`mamba2.py`): parameters float32; the
projections in the runtime's compute dtype or matmul_precision (`matmul.linear`);
A, dt, lam, the angle and its sines, the norms, the gate and the scan's decays and
state float32. The angle wraps to [0, 2 pi) after every cumulative sum (as
mamba_ssm's SISO reference does): a float32 angle that grew with the length would
lose the small increments of late tokens. Float64 inputs (tests, under x64) run
every piece in float64.

Shapes: b batch, l length, d d_model, i d_inner (= h * p), h heads, p headdim,
g groups, n d_state, R MIMO rank, a num_rope_angles.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mamba_train.model import matmul as mm
from mamba_train.model.config import Mamba2Config
from mamba_train.model.mamba2 import IN_PROJ_NAMES, residual
from mamba_train.model.runtime import Runtime
from mamba_train.model.select import ops_for
from mamba_train.ops.table import Ops
from mamba_train.parallel import sharding

F32 = jnp.float32
Array = jax.Array
# mamba_ssm's Mamba3 fixes the epsilon of its B/C norms and of its output norm.
NORM_EPS = 1e-5
TWO_PI = 2.0 * math.pi


def _dtypes(u, rt: Runtime):
  """(the matmuls' dtype, everything else's): the runtime's compute dtype and float32,
  or float64 for both when the input is float64 (tests under x64)."""
  if u.dtype == jnp.float64:
    return jnp.dtype(jnp.float64), jnp.dtype(jnp.float64)
  return jnp.dtype(rt.compute_dtype), jnp.dtype(F32)


def rms_norm(x, weight, eps, acc=F32):
  """RMSNorm over the last axis in `acc` (float32; float64 in x64 tests)."""
  x = x.astype(acc)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(acc)


def heavy_tail(u):
  """mamba_ssm's heavy-tail activation: 1 + u for u >= 0, 1 / (1 - u) below."""
  return jnp.maximum(u, 0.0) + 1.0 / (1.0 - jnp.minimum(u, 0.0))


def decay_rate(dd_A, cfg: Mamba2Config):
  """A = -max(f(dd_A), A_floor) < 0, f by `cfg.A_activation`."""
  f = heavy_tail(dd_A) if cfg.A_activation == "heavy_tail" else jax.nn.softplus(dd_A)
  return -jnp.maximum(f, cfg.A_floor)


def zero_state(cfg: Mamba2Config, batch: int) -> dict[str, Array]:
  """One layer's decoding state before any token (float32): the angle (b, h, a), the
  SSM state (b, h, p, n), the last position's rotated k (b, R, h, n) and x (b, h, p)."""
  h, p, n, R = cfg.nheads, cfg.headdim, cfg.d_state, cfg.mamba3_rank
  return {"m3_angle": jnp.zeros((batch, h, cfg.num_rope_angles), F32), "m3_ssm": jnp.zeros((batch, h, p, n), F32),
          "m3_k": jnp.zeros((batch, R, h, n), F32), "m3_v": jnp.zeros((batch, h, p), F32)}


def _project_in(p, u, rt, cd, acc):
  """z, x (.., h*p) and B|C (.., 2, R*g*n) in the compute dtype; dd_dt, dd_A, trap
  (.., 3, h) and the angles (.., a) in `acc`. As the Mamba-2 layer's: z|x|B|C one
  matmul written in the compute dtype, the small per-head and angle columns a second
  with a float32 result; with an adapter on in_proj (its B spans every piece, in
  mamba_ssm's order) one float32 dot. Both results are named for the remat policies."""
  prec = rt.matmul_precision
  zx, bcw, hw, aw = p["in_proj_zx"], p["in_proj_bc"], p["in_proj_heads"], p["in_proj_angles"]
  d, i, rgn, h = zx.shape[0], zx.shape[2], bcw.shape[2], hw.shape[2]
  big = jnp.concatenate([zx.reshape(d, 2 * i), bcw.reshape(d, 2 * rgn)], 1)
  small = jnp.concatenate([hw.reshape(d, 3 * h), aw], 1)
  adapter = mm.adapter_of(p, "in_proj")
  if adapter is None:
    r = mm.linear(u, big.astype(cd), cd, prec, out_dtype=cd)
    s = mm.linear(u, small.astype(cd), cd, prec, out_dtype=acc)
  else:
    r = mm.linear(u, jnp.concatenate([big, small], 1).astype(cd), cd, prec, 1, adapter, out_dtype=acc)
    r, s = r[..., :2 * i + 2 * rgn].astype(cd), r[..., 2 * i + 2 * rgn:]
  r, s = checkpoint_name(r, IN_PROJ_NAMES[0]), checkpoint_name(s, IN_PROJ_NAMES[1])
  z, x = r[..., :i], r[..., i:2 * i]
  bc = r[..., 2 * i:].reshape(*r.shape[:-1], 2, rgn)
  return z, x, bc, s[..., :3 * h].reshape(*s.shape[:-1], 3, h), s[..., 3 * h:]


def _keys_queries(p, bc, cfg: Mamba2Config, acc):
  """B and C (.., 2, R*g*n) -> normed, per head, biased: (.., R, h, n) each, in acc."""
  R, g, n, h = cfg.mamba3_rank, cfg.ngroups, cfg.d_state, cfg.nheads
  bc = bc.reshape(*bc.shape[:-1], R, g, n)
  B = rms_norm(bc[..., 0, :, :, :], p["B_norm"], NORM_EPS, acc)
  C = rms_norm(bc[..., 1, :, :, :], p["C_norm"], NORM_EPS, acc)
  # Heads of a group are consecutive (mamba_ssm's "(h_bc g)" repeat).
  per_head = lambda t, bias: jnp.repeat(t, h // g, axis=-2) + jnp.swapaxes(bias, 0, 1).astype(acc)
  return per_head(B, p["B_bias"]), per_head(C, p["C_bias"])


def rotate(t, theta, mimo: bool):
  """t (.., n) rotated by theta (.., a) (broadcast over t's leading axes): SISO the
  adjacent pairs (2j, 2j+1), MIMO the pairs (j, j + n/2), for j < a; the rest pass."""
  a, n = theta.shape[-1], t.shape[-1]
  cos, sin = jnp.cos(theta), jnp.sin(theta)
  if mimo:
    t0, t1 = t[..., :a], t[..., n // 2:n // 2 + a]
    r0, r1 = t0 * cos - t1 * sin, t0 * sin + t1 * cos
    return jnp.concatenate([r0, t[..., a:n // 2], r1, t[..., n // 2 + a:]], -1)
  pairs = t[..., :2 * a].reshape(*t.shape[:-1], a, 2)
  t0, t1 = pairs[..., 0], pairs[..., 1]
  rot = jnp.stack([t0 * cos - t1 * sin, t0 * sin + t1 * cos], -1).reshape(*t.shape[:-1], 2 * a)
  return jnp.concatenate([rot, t[..., 2 * a:]], -1)


def _wrap(theta):
  return theta - TWO_PI * jax.lax.stop_gradient(jnp.floor(theta / TWO_PI))


def cumulative_angle(inc, start, seq_idx=None):
  """theta_t = theta_{t-1} + inc_t over the length (axis 1), from `start` (b, h, a)
  at position 0, restarted from zero where seq_idx changes; wrapped to [0, 2 pi).
  inc: (b, l, h, a). A segmented sum (`associative_scan`) rather than a difference
  of running sums across a document boundary."""
  inc = inc.at[:, 0].add(start)
  if seq_idx is None:
    return _wrap(jnp.cumsum(inc, axis=1))
  first = jnp.concatenate([jnp.ones_like(seq_idx[:, :1], bool), seq_idx[:, 1:] != seq_idx[:, :-1]], 1)
  first = jnp.broadcast_to(first[..., None, None], inc.shape)

  def combine(left, right):
    (vl, fl), (vr, fr) = left, right
    return jnp.where(fr, vr, vl + vr), fl | fr

  theta, _ = jax.lax.associative_scan(combine, (inc, first), axis=1)
  return _wrap(theta)


def _gate(p, y, z, cfg: Mamba2Config, acc):
  """The output before out_proj: y (b, l, [R,] h, p), z (b, l, h, p) -> (b, l, h*p).
  SISO y * silu(z) or norm(y) * silu(z); MIMO the same per rank with z * mimo_z[r],
  summed over ranks with weights mimo_o (mamba_ssm's fused pre-gate head-wise norm
  and its unfused form compute this same function)."""
  h, hp = cfg.nheads, cfg.headdim
  y, z = y.astype(acc), z.astype(acc)
  if cfg.is_mimo:
    z = z[..., None, :, :] * jnp.swapaxes(p["mimo_z"], 0, 1).astype(acc)  # (b, l, R, h, p)
  if cfg.is_outproj_norm:
    y = rms_norm(y, jnp.ones((), acc), NORM_EPS, acc) * p["gate_norm"].reshape(h, hp).astype(acc)
  out = y * jax.nn.silu(z)
  if cfg.is_mimo:
    out = jnp.einsum("...rhp,rhp->...hp", out, jnp.swapaxes(p["mimo_o"], 0, 1).astype(acc))
  return out.reshape(*out.shape[:-2], h * hp)


def _scan_inputs(p, u, cfg, rt, seq_idx=None, mask=None, angle0=None):
  """What the scan takes, from the mixer's input u (b, l, d): z, x (b, l, h, p) in the
  compute dtype; dt, A, lam (b, l, h), B, C rotated (b, l, R, h, n) and the angles
  (b, l, h, a), in acc."""
  b, l, _ = u.shape
  cd, acc = _dtypes(u, rt)
  h, hp = cfg.nheads, cfg.headdim
  z, x, bc, heads, ang = _project_in(p, u, rt, cd, acc)
  x = x.reshape(b, l, h, hp)
  if mask is not None:  # padding: no input, no step (dt = 0), so the state passes it unchanged
    x = jnp.where(mask[..., None, None], x, 0.0)
  dt = jax.nn.softplus(heads[..., 0, :] + p["dt_bias"].astype(acc))
  if mask is not None:
    dt = jnp.where(mask[..., None], dt, 0.0)
  A = decay_rate(heads[..., 1, :], cfg)
  lam = jax.nn.sigmoid(heads[..., 2, :])
  B, C = _keys_queries(p, bc, cfg, acc)  # (b, l, R, h, n)
  inc = math.pi * jnp.tanh(ang)[..., None, :] * dt[..., None]  # (b, l, h, a)
  start = jnp.zeros((b, h, inc.shape[-1]), acc) if angle0 is None else angle0.astype(acc)
  theta = cumulative_angle(inc, start, seq_idx)
  B, C = (rotate(t, theta[:, :, None], cfg.is_mimo) for t in (B, C))
  x = sharding.constrain(x, ("batch", "act_length", "act_inner", None))
  return z.reshape(b, l, h, hp), x, dt, A, lam, B, C, theta


def mixer(p, u, cfg: Mamba2Config, rt: Runtime, *, seq_idx=None, mask=None, state=None, ops: Ops | None = None):
  """The Mamba-3 mixer over a sequence. u: (b, l, d) float32 (float64: all float64).
  seq_idx: (b, l) document ids; mask: (b, l) bool, False on padding; state: a layer
  state (`zero_state`) to continue from; ops: `select.ops_for(cfg, rt)` unless given.
  Returns (b, l, d) in float32 and the layer state after the last position."""
  ops = ops_for(cfg, rt) if ops is None else ops
  b = u.shape[0]
  cd, acc = _dtypes(u, rt)
  state = zero_state(cfg, b) if state is None else state
  z, x, dt, A, lam, B, C, theta = _scan_inputs(p, u, cfg, rt, seq_idx, mask, state["m3_angle"])
  siso = not cfg.is_mimo
  pick = (lambda t: t[:, :, 0]) if siso else (lambda t: t)  # SISO: (b, l, h, n), no rank axis
  k_prev = state["m3_k"][:, 0] if siso else state["m3_k"]
  initial = (state["m3_ssm"].astype(acc), k_prev.astype(cd), state["m3_v"].astype(cd))
  y, (ssm, k_last, v_last) = ops.ssd3(
      x.astype(cd), dt, A, lam, pick(B).astype(cd), pick(C).astype(cd), ops.ssd3_chunk, D=p["D"].astype(acc),
      x_proj=None if siso else p["mimo_x"].astype(acc), initial=initial, seq_idx=seq_idx)
  out = mm.linear(_gate(p, y, z, cfg, acc), p["out_proj"], cd, rt.matmul_precision, 1,
                  mm.adapter_of(p, "out_proj"), out_dtype=acc)
  new = {"m3_angle": theta[:, -1], "m3_ssm": ssm, "m3_k": (k_last[:, None] if siso else k_last),
         "m3_v": v_last}
  return out, {k: v.astype(acc) for k, v in new.items()}


def mixer_step(p, u, cfg: Mamba2Config, rt: Runtime, state, ops: Ops | None = None):
  """One position through the mixer, for decoding: u (b, d) -> (b, d), new state.
  The same functions as `mixer` on a length of one, and the scan's one-step form."""
  ops = ops_for(cfg, rt) if ops is None else ops
  cd, acc = _dtypes(u, rt)
  z, x, dt, A, lam, B, C, theta = _scan_inputs(p, u[:, None], cfg, rt, angle0=state["m3_angle"])
  siso = not cfg.is_mimo
  pick = (lambda t: t[:, 0, 0]) if siso else (lambda t: t[:, 0])
  k_prev = state["m3_k"][:, 0] if siso else state["m3_k"]
  cache = (state["m3_ssm"].astype(acc), k_prev.astype(cd), state["m3_v"].astype(cd))
  y, (ssm, k_last, v_last) = ops.ssd3_step(
      cache, x[:, 0].astype(cd), dt[:, 0], A[:, 0], lam[:, 0], pick(B).astype(cd), pick(C).astype(cd),
      D=p["D"].astype(acc), x_proj=None if siso else p["mimo_x"].astype(acc))
  out = mm.linear(_gate(p, y[:, None], z, cfg, acc)[:, 0], p["out_proj"], cd, rt.matmul_precision, 1,
                  mm.adapter_of(p, "out_proj"), out_dtype=acc)
  new = {"m3_angle": theta[:, 0], "m3_ssm": ssm, "m3_k": (k_last[:, None] if siso else k_last), "m3_v": v_last}
  return out, {k: v.astype(acc) for k, v in new.items()}


def block(p, h, cfg, rt, **kw):
  """Pre-norm residual block: h + mixer(rmsnorm(h)). kw: `mixer`'s."""
  acc = _dtypes(h, rt)[1]
  out, state = mixer(p, rms_norm(h, p["norm"], cfg.norm_eps, acc), cfg, rt, **kw)
  return residual(h, out, cfg), state


def block_step(p, h, cfg, rt, state, ops: Ops | None = None):
  """`block` for one position (h: (b, d)), from and to a layer state."""
  acc = _dtypes(h, rt)[1]
  out, state = mixer_step(p, rms_norm(h, p["norm"], cfg.norm_eps, acc), cfg, rt, state, ops)
  return residual(h, out, cfg), state
