"""A test-only Mamba-3 language model in plain PyTorch, as mamba_ssm's
MambaLMHeadModel defines it with `ssm_cfg = {"layer": "Mamba3", ...}`, and a writer of
its directories (`config.json` + `pytorch_model.bin`, mamba_ssm's state-dict names).

Written for these tests from reading mamba_ssm (state-spaces/mamba at e9594ce:
`modules/mamba3.py`, `models/mixer_seq_simple.py`, `modules/block.py`,
`modules/mlp.py`, the rotary reference in `ops/triton/mamba3/mamba3_mimo_rotary_step.py`);
none of its code is copied. mamba_ssm itself cannot serve: its Mamba3 module imports
Triton kernels at the top and runs its norms, scans and rotations only as GPU kernels.

It is deliberately the slow, literal form: one position at a time (`scan`), every
tensor in the dtype asked (float64 for the references), no chunking, no fusion.
The layer, per mixer (H heads of P channels, state N, groups G, MIMO rank R, S rotary
angles = int(N * rope_fraction) rounded down to even, halved):

  in_proj(u) -> z (H P), x (H P), B (R G N), C (R G N), dd_dt (H), dd_A (H), trap (H), angles (S)
  A = -max(f(dd_A), A_floor), f(u) = 1 + u (u >= 0), 1 / (1 - u) (u < 0)   # heavy tail
  dt = softplus(dd_dt + dt_bias), lam = sigmoid(trap)
  k = RMSNorm_N(B) * B_norm + B_bias,  q = RMSNorm_N(C) * C_norm + C_bias   (per head)
  theta_t = theta_{t-1} + pi tanh(angles_t) dt_t;  k, q rotated by theta: SISO pairs
    (2i, 2i+1), MIMO pairs (i, i + N/2), for i < S; the rest pass unrotated
  v_r = x * mimo_x[:, r] (MIMO), v = x (SISO)
  h_t = a h_{t-1} + (1 - lam) dt a sum_r v_{t-1,r} k_{t-1,r}^T + lam dt sum_r v_{t,r} k_{t,r}^T,
    a = exp(A dt);  y_{t,r} = h_t q_{t,r} + D v_{t,r}
  out: SISO y * silu(z), or RMSNorm_P(y) * norm * silu(z) (is_outproj_norm);
       MIMO sum_r mimo_o[:, r] * g(y_r) * silu(z * mimo_z[:, r]), g the same norm or none
  out_proj

and the block (mamba_ssm's Block: add, RMSNorm, mixer; then add, RMSNorm `norm2`,
GatedMLP `mlp` when d_intermediate > 0), a final RMSNorm `norm_f` and the head.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# mamba_ssm's Mamba3 defaults (its __init__), for fields a config.json leaves out.
SSM_DEFAULTS = dict(d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=0.001,
                    dt_max=0.1, dt_init_floor=1e-4, A_floor=1e-4, is_outproj_norm=False,
                    is_mimo=False, mimo_rank=4, chunk_size=64)
EPS = 1e-5  # every RMSNorm of the model: the blocks', norm_f, B_norm, C_norm, the out-proj norm


def lm_config(*, d_model, n_layer, vocab_size, d_intermediate=0, tie_embeddings=True,
              pad_vocab_size_multiple=16, **ssm) -> dict:
  """config.json's contents as MambaLMHeadModel.save_pretrained writes them (MambaConfig's
  fields); `ssm` goes into ssm_cfg beside layer = "Mamba3"."""
  return {"d_model": d_model, "d_intermediate": d_intermediate, "n_layer": n_layer,
          "vocab_size": vocab_size, "ssm_cfg": {"layer": "Mamba3", **ssm}, "attn_layer_idx": [],
          "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
          "pad_vocab_size_multiple": pad_vocab_size_multiple, "tie_embeddings": tie_embeddings}


class Dims:
  """The sizes a config implies, as mamba_ssm derives them."""

  def __init__(self, config: dict):
    s = {**SSM_DEFAULTS, **{k: v for k, v in config["ssm_cfg"].items() if k != "layer"}}
    self.ssm = s
    self.d = config["d_model"]
    self.inner = int(s["expand"] * self.d)
    self.P, self.N, self.G = s["headdim"], s["d_state"], s["ngroups"]
    self.H = self.inner // self.P
    self.mimo = bool(s["is_mimo"])
    self.R = s["mimo_rank"] if self.mimo else 1
    rot = int(self.N * s["rope_fraction"])
    self.S = (rot - rot % 2) // 2  # rotary angles: pairs rotated
    self.split = [self.inner, self.inner, self.R * self.G * self.N, self.R * self.G * self.N,
                  self.H, self.H, self.H, self.S]
    m = config["pad_vocab_size_multiple"]
    self.rows = -(-config["vocab_size"] // m) * m
    di = config["d_intermediate"]
    self.mlp = -(-di // 128) * 128 if di else 0  # GatedMLP rounds up to a multiple of 128


def random_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
  """float32 weights in mamba_ssm's names and shapes, drawn so that every part of the
  layer matters: dt of order 0.1-1 (rotations of a radian over a few tokens, decays
  that forget), biases, norms and MIMO projections away from their inits."""
  dm = Dims(config)
  g = np.random.default_rng(seed)
  t = lambda *s, scale=1.0, mean=0.0: torch.tensor((mean + scale * g.standard_normal(s)).astype(np.float32))
  d, H, R, N, P = dm.d, dm.H, dm.R, dm.N, dm.P
  sd = {"backbone.embedding.weight": t(dm.rows, d)}
  for i in range(config["n_layer"]):
    p = f"backbone.layers.{i}."
    sd[p + "norm.weight"] = t(d, scale=0.1, mean=1.0)
    sd[p + "mixer.in_proj.weight"] = t(sum(dm.split), d, scale=1 / math.sqrt(d))
    sd[p + "mixer.dt_bias"] = torch.tensor(g.uniform(-2.0, 0.0, H).astype(np.float32))
    sd[p + "mixer.B_bias"] = t(H, R, N, scale=0.3, mean=1.0)
    sd[p + "mixer.C_bias"] = t(H, R, N, scale=0.3, mean=1.0)
    sd[p + "mixer.B_norm.weight"] = t(N, scale=0.1, mean=1.0)
    sd[p + "mixer.C_norm.weight"] = t(N, scale=0.1, mean=1.0)
    if dm.mimo:
      for name in ("mimo_x", "mimo_z", "mimo_o"):
        sd[p + f"mixer.{name}"] = t(H, R, P, scale=0.3, mean=1.0 if name == "mimo_z" else 1.0 / R)
    sd[p + "mixer.D"] = t(H, scale=0.3, mean=1.0)
    if dm.ssm["is_outproj_norm"]:
      sd[p + "mixer.norm.weight"] = t(dm.inner, scale=0.1, mean=1.0)
    sd[p + "mixer.out_proj.weight"] = t(d, dm.inner, scale=1 / math.sqrt(dm.inner))
    if dm.mlp:
      sd[p + "norm2.weight"] = t(d, scale=0.1, mean=1.0)
      sd[p + "mlp.fc1.weight"] = t(2 * dm.mlp, d, scale=1 / math.sqrt(d))
      sd[p + "mlp.fc2.weight"] = t(d, dm.mlp, scale=1 / math.sqrt(dm.mlp))
  sd["backbone.norm_f.weight"] = t(d, scale=0.1, mean=1.0)
  # A tied head is the embedding's own tensor in mamba_ssm's state dict.
  sd["lm_head.weight"] = sd["backbone.embedding.weight"] if config["tie_embeddings"] else t(dm.rows, d)
  return sd


def write_dir(path, config: dict, sd: dict[str, torch.Tensor]) -> Path:
  """A mamba_ssm directory, as save_pretrained leaves it."""
  path = Path(path)
  path.mkdir(parents=True)
  torch.save(sd, path / "pytorch_model.bin")
  (path / "config.json").write_text(json.dumps(config, indent=4))
  return path


# ----------------------------------------------------------------------------
# The forward pass.


def heavy_tail(u):
  return torch.where(u >= 0, 1.0 + u.clamp_min(0), 1.0 / (1.0 - u.clamp_max(0)))


def rms(x, w, eps=EPS):
  return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def rotate(t, theta, mimo: bool):
  """t (..., N) by the angles theta (..., S): SISO pairs (2i, 2i+1), MIMO (i, i + N/2)."""
  S, N = theta.shape[-1], t.shape[-1]
  if mimo:
    a, b = t[..., :S], t[..., N // 2:N // 2 + S]
  else:
    a, b = t[..., 0:2 * S:2], t[..., 1:2 * S:2]
  c, s = torch.cos(theta), torch.sin(theta)
  ra, rb = a * c - b * s, a * s + b * c
  out = t.clone()
  if mimo:
    out[..., :S], out[..., N // 2:N // 2 + S] = ra, rb
  else:
    out[..., 0:2 * S:2], out[..., 1:2 * S:2] = ra, rb
  return out


def scan(v, dt, A, lam, k, q, D):
  """The exponential-trapezoidal recurrence, one position at a time, from a zero state
  and zero previous (k, v).

  v (b, l, R, H, P), dt, A, lam (b, l, H), k, q (b, l, R, H, N) per head, D (H,).
  Returns y (b, l, R, H, P) and the final state (b, H, P, N)."""
  b, l, R, H, P = v.shape
  h = v.new_zeros(b, H, P, k.shape[-1])
  kv_prev = torch.zeros_like(h)
  ys = []
  for t in range(l):
    alpha = torch.exp(A[:, t] * dt[:, t])[..., None, None]
    beta = (1 - lam[:, t])[..., None, None] * dt[:, t, :, None, None] * alpha
    gamma = (lam[:, t] * dt[:, t])[..., None, None]
    kv = torch.einsum("brhp,brhn->bhpn", v[:, t], k[:, t])
    h = alpha * h + beta * kv_prev + gamma * kv
    ys.append(torch.einsum("bhpn,brhn->brhp", h, q[:, t]) + D[:, None] * v[:, t])
    kv_prev = kv
  return torch.stack(ys, 1), h


def mixer(u, w: dict, dm: Dims):
  """One Mamba3 mixer on u (b, l, d); w its tensors by suffix (`in_proj.weight`, ...)."""
  b, l, _ = u.shape
  H, P, G, R, N = dm.H, dm.P, dm.G, dm.R, dm.N
  z, x, B, C, dd_dt, dd_A, trap, ang = torch.split(u @ w["in_proj.weight"].T, dm.split, dim=-1)
  z, x = z.reshape(b, l, H, P), x.reshape(b, l, H, P)
  A = -torch.clamp(heavy_tail(dd_A), min=dm.ssm["A_floor"])
  dt = F.softplus(dd_dt + w["dt_bias"])
  lam = torch.sigmoid(trap)

  def per_head(t, norm, bias):  # (b, l, R G N) -> (b, l, R, H, N)
    t = rms(t.reshape(b, l, R, G, N), norm).repeat_interleave(H // G, dim=3)
    return t + bias.transpose(0, 1)  # bias (H, R, N)

  k = per_head(B, w["B_norm.weight"], w["B_bias"])
  q = per_head(C, w["C_norm.weight"], w["C_bias"])
  theta = torch.cumsum(math.pi * torch.tanh(ang)[:, :, None, :] * dt[..., None], dim=1)  # (b, l, H, S)
  k, q = rotate(k, theta[:, :, None], dm.mimo), rotate(q, theta[:, :, None], dm.mimo)
  v = x[:, :, None] * w["mimo_x"].transpose(0, 1) if dm.mimo else x[:, :, None]
  y, _ = scan(v, dt, A, lam, k, q, w["D"])  # (b, l, R, H, P)

  norm = (lambda y: rms(y, w["norm.weight"].reshape(H, P))) if dm.ssm["is_outproj_norm"] else (lambda y: y)
  if dm.mimo:
    zr = z[:, :, None] * w["mimo_z"].transpose(0, 1)
    y = (w["mimo_o"].transpose(0, 1) * norm(y) * F.silu(zr)).sum(2)
  else:
    y = norm(y[:, :, 0]) * F.silu(z)
  return y.reshape(b, l, H * P) @ w["out_proj.weight"].T


def logits(config: dict, sd: dict[str, torch.Tensor], ids, dtype=torch.float64) -> torch.Tensor:
  """The LM's logits (b, l, padded vocabulary) for token ids (b, l), every tensor in `dtype`."""
  dm = Dims(config)
  sd = {k: v.to(dtype) for k, v in sd.items()}
  h = sd["backbone.embedding.weight"][torch.as_tensor(ids)]
  residual = torch.zeros_like(h)
  for i in range(config["n_layer"]):
    p = f"backbone.layers.{i}."
    residual = residual + h
    mix = {k[len(p) + 6:]: v for k, v in sd.items() if k.startswith(p + "mixer.")}
    h = mixer(rms(residual, sd[p + "norm.weight"]), mix, dm)
    if dm.mlp:
      residual = residual + h
      y, gate = (rms(residual, sd[p + "norm2.weight"]) @ sd[p + "mlp.fc1.weight"].T).chunk(2, dim=-1)
      h = (y * F.silu(gate)) @ sd[p + "mlp.fc2.weight"].T
  h = rms(residual + h, sd["backbone.norm_f.weight"])
  return h @ sd["lm_head.weight"].T
