"""The Mamba-2 layer's elementwise math around its matmuls, in plain JAX: the
causal depthwise convolution (with the SiLU after it) between in_proj and the SSD,
and the gated RMSNorm between the SSD and out_proj. These are the reference forms,
what CPUs run, and what the GPU kernels of `layer_gpu` (same arguments, same
results) are tested against, as `ssd.ssd_chunked` is for the SSD kernels; and the
two pieces both kernel modules (TPU's `layer_tpu`, GPU's `layer_gpu`) use, the
padding to whole blocks and SiLU's derivative.

Float32 inside: the conv's taps and the norm's mean of squares are float32 whatever
the compute dtype of their inputs. Shapes: b batch, l length, k conv kernel, c
channels (any trailing shape), i d_inner, g groups. Imports nothing of the package
(`mixer_core`, the layer between the matmuls, takes the SSD it runs as an argument).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def pad_axis(x, axis: int, size: int, mode: str = "constant"):
  """x padded at the end of `axis` to `size`: the kernels' (TPU's and GPU's) whole
  blocks of positions or channels."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, mode=mode)


def dsilu(a, sig):
  """d silu(a) / da from a and sigmoid(a): what the kernels' backward passes take."""
  return sig * (1.0 + a * (1.0 - sig))


def gated_rms_norm(y, z, weight, groups, eps):
  """y * silu(z), then RMS over groups of i / g channels, times weight (norm after gate)."""
  x = y.astype(F32) * jax.nn.silu(z.astype(F32))
  xs = x.reshape(*x.shape[:-1], groups, -1)
  xs = xs * jax.lax.rsqrt(jnp.mean(xs * xs, axis=-1, keepdims=True) + eps)
  return xs.reshape(x.shape) * weight


def causal_conv(x, w, bias, front, seq_idx=None, front_idx=None):
  """Depthwise causal convolution along l.

  x: (b, l, *c); w: (k, *c); bias: (*c); front: (b, k-1, *c), the inputs before
  position 0 (zeros, a decoding cache's conv state, or the previous device's last
  inputs when the sequence is split). With seq_idx, an input from another
  document than the output position's contributes nothing; front_idx (b, k-1)
  are the front's document ids (default: position 0's).
  Written as k shifted multiply-adds: k is 4, and XLA fuses them into one loop.
  """
  k = w.shape[0]
  l = x.shape[1]
  # Joined in x's dtype and widened per tap, inside the conv's fusion: a float32
  # join is a whole (b, l, *c) float32 copy that XLA writes to HBM. The front is
  # a conv state of earlier inputs of the same projection, so x's dtype holds it.
  xp = jnp.concatenate([front.astype(x.dtype), x], axis=1)  # (b, k-1+l, *c)
  extra = x.ndim - 2
  if seq_idx is not None:
    if front_idx is None:
      front_idx = jnp.repeat(seq_idx[:, :1], k - 1, axis=1)
    ids = jnp.concatenate([front_idx, seq_idx], axis=1)
  out = jnp.broadcast_to(bias.astype(F32), x.shape)
  for j in range(k):  # tap j reads position t - (k-1-j)
    tap = xp[:, j:j + l].astype(F32) * w[j]
    if seq_idx is not None and j < k - 1:
      ok = (ids[:, j:j + l] == seq_idx).reshape(ids.shape[0], l, *([1] * extra))
      tap = jnp.where(ok, tap, 0.0)
    out = out + tap
  return out, xp[:, l:].astype(F32)  # new front: the last k-1 inputs


def causal_conv_silu(x, w, bias, front, seq_idx=None, front_idx=None):
  """silu(`causal_conv`(...)) and the new front: the conv of the mixer's x and B|C
  channels as the SSD takes them (float32)."""
  out, front = causal_conv(x, w, bias, front, seq_idx, front_idx)
  return jax.nn.silu(out), front


def mixer_core(zx, bc, dt_raw, w, chunk: int, *, ngroups: int, dt_limit=(0.0, float("inf")),
               front_x=None, front_bc=None, initial_state=None, seq_idx=None, ssd):
  """The Mamba-2 layer between in_proj and out_proj: conv + SiLU of x and B|C (after
  their fronts of earlier inputs, zeros by default), dt = clip(softplus(dt_raw +
  dt_bias)), the SSD (`ssd`) with the D skip, and the
  gate y * silu(z); the norm's row statistics as each row's sums of squares per
  group, which the caller folds into the norm (g * rsqrt(ssq / (i / g) + eps) * w).

  zx: z|x joined (b, l, 2i), as in_proj's one GEMM writes them, in the compute
  dtype; bc: (b, l, 2, g n); dt_raw: (b, l, h) float32; w: the layer's conv_x (k,
  i), conv_x_bias, conv_bc (k, 2, g n),
  conv_bc_bias, dt_bias, A_log and D (or None); front_x (b, k-1, i), front_bc
  (b, k-1, 2, g n): `causal_conv`'s fronts; ssd: the SSD, `ssd.ssd_chunked` or a
  kernel with its arguments. Returns the gated y (b, l, i) in the compute dtype, ssq
  (b, l, g) float32 and the final state (b, h, p, n).
  """
  b, l, i = zx.shape[0], zx.shape[1], zx.shape[2] // 2
  z, xr = zx[..., :i], zx[..., i:]
  h, g, k = dt_raw.shape[-1], ngroups, w["conv_x"].shape[0]
  n, cd = bc.shape[-1] // g, xr.dtype
  front_x = jnp.zeros((b, k - 1, i), cd) if front_x is None else front_x
  front_bc = jnp.zeros((b, k - 1, *bc.shape[2:]), cd) if front_bc is None else front_bc
  x, _ = causal_conv_silu(xr, w["conv_x"], w["conv_x_bias"], front_x, seq_idx)
  bcs, _ = causal_conv_silu(bc, w["conv_bc"], w["conv_bc_bias"], front_bc, seq_idx)
  dt = jax.nn.softplus(dt_raw.astype(F32) + w["dt_bias"])
  lo, hi = dt_limit
  if lo > 0.0 or hi < float("inf"):
    dt = jnp.clip(dt, lo, hi)
  y, final = ssd(x.astype(cd).reshape(b, l, h, i // h), dt, -jnp.exp(w["A_log"].astype(F32)),
                 bcs[:, :, 0].reshape(b, l, g, n), bcs[:, :, 1].reshape(b, l, g, n), chunk, D=w.get("D"),
                 initial_state=initial_state, seq_idx=seq_idx)
  gated = y.reshape(b, l, i).astype(F32) * jax.nn.silu(z.astype(F32))
  ssq = jnp.sum(jnp.square(gated.reshape(b, l, g, i // g)), axis=-1)
  return gated.astype(cd), ssq, final
