"""The two other layer kinds of a hybrid (`Mamba2Config.layer_pattern`): causal
self-attention ('*') and the MLP ('-'), as pure functions of one layer's arrays,
with their parameter tables and initialisation. Each is a pre-norm residual
block like the Mamba-2 one: h + f(rmsnorm(h)), the residual in float32.

Attention is multi-head or grouped-query (kv heads <= heads), causal, with no
positional encoding by default (Nemotron-H: the Mamba-2 layers carry position)
and optional rotary embeddings. Packed documents (`seq_idx`) and left padding
(`mask`) become a key mask: no query sees a key of another document or a
padding key. The decoding state of a layer is a fixed-size key/value buffer.

Precision: projections in the runtime's compute dtype with float32
accumulation, or its matmul_precision (`matmul.linear`); scores, softmax and the key/value buffer in float32 (the buffer
holds what the projections return; it is cast to the compute dtype only for the
products).

Shapes: b batch, l length (queries), s key positions, d d_model, h query heads,
k kv heads, r = h / k query heads per kv head, e head dim, f MLP hidden units.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mamba_train.model import matmul as mm
from mamba_train.model.config import Mamba2Config
from mamba_train.model.runtime import Runtime
from mamba_train.model.select import ops_for
from mamba_train.ops.attention import attend
from mamba_train.ops.table import Ops
from mamba_train.parallel import sharding

F32 = jnp.float32
Array = jax.Array

# One layer's parameters and their logical axes (the stacked `layers` axis is
# prepended). Heads and MLP hidden units are what tensor parallelism splits.
ATTN_PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "norm": ("embed",),
    "q_proj": ("embed", "attn_heads", None),  # (d, h, e)
    "k_proj": ("embed", "kv_heads", None),  # (d, k, e)
    "v_proj": ("embed", "kv_heads", None),  # (d, k, e)
    "o_proj": ("attn_heads", None, "embed"),  # (h, e, d)
}
MLP_PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "norm": ("embed",),
    "up_proj": ("embed", "mlp"),  # (d, f)
    "gate_proj": ("embed", "mlp"),  # (d, f), gated SiLU only
    "down_proj": ("mlp", "embed"),  # (f, d)
}


def attn_shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
  d, h, k, e = cfg.d_model, cfg.attn_num_heads, cfg.n_kv_heads, cfg.attn_head_dim
  return {"norm": (d,), "q_proj": (d, h, e), "k_proj": (d, k, e), "v_proj": (d, k, e),
          "o_proj": (h, e, d)}


def mlp_shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
  d, f = cfg.d_model, cfg.d_intermediate
  out = {"norm": (d,), "up_proj": (d, f), "gate_proj": (d, f), "down_proj": (f, d)}
  if cfg.mlp_act != "swiglu":
    del out["gate_proj"]
  return out


def param_axes(kind_shapes: dict, table: dict) -> dict:
  return {name: table[name] for name in kind_shapes}


def init_params(shapes: dict[str, tuple[int, ...]], out_names: tuple[str, ...],
                cfg: Mamba2Config, u: Array) -> dict[str, Array]:
  """One attention or MLP layer from a flat vector of uniform [0, 1) draws, as
  mamba_ssm initialises its MHA and GatedMLP: torch's nn.Linear default
  uniform(+-1/sqrt(fan_in)), and the projections back into the residual stream
  (`out_names`) scaled by 1/sqrt(n_layer), as mamba_ssm rescales out_proj and fc2."""
  out, start = {}, 0
  for name, shape in shapes.items():
    if name == "norm":
      out[name] = jnp.ones(shape, F32)
      continue
    size = math.prod(shape)
    fan_in = math.prod(shape[:-1]) if name in out_names else shape[0]
    bound = 1.0 / math.sqrt(fan_in) / (math.sqrt(cfg.n_layer) if name in out_names else 1.0)
    out[name] = (2.0 * u[start:start + size].reshape(shape) - 1.0) * bound
    start += size
  return out


def draws(shapes: dict[str, tuple[int, ...]]) -> int:
  """How many uniform draws `init_params` takes for these shapes."""
  return sum(math.prod(s) for n, s in shapes.items() if n != "norm")


# ----------------------------------------------------------------------------
# Attention.


def positions(seq_idx, length: int, offset=0):
  """Rotary positions (b, l) or (l,): the index from the start of each packed
  document (`seq_idx` (b, l)), or offset + index without it."""
  idx = jnp.arange(length, dtype=jnp.int32)
  if seq_idx is None:
    return idx + offset
  new_doc = jnp.concatenate([jnp.ones_like(seq_idx[:, :1], bool), seq_idx[:, 1:] != seq_idx[:, :-1]], 1)
  start = jax.lax.cummax(jnp.where(new_doc, idx, 0), axis=1)
  return idx - start


def rotary(x, pos, cfg: Mamba2Config):
  """Rotary embedding on the first attn_rotary_emb_dim dims of each head, in the
  rotate-half (GPT-NeoX) form. x: (b, l, heads, e) float32; pos: (l,) or (b, l)."""
  r = cfg.attn_rotary_emb_dim
  inv = cfg.attn_rotary_base ** (-jnp.arange(0, r, 2, dtype=F32) / r)  # (r/2,)
  ang = pos.astype(F32)[..., None] * inv  # (..., l, r/2)
  if ang.ndim == 2:
    ang = ang[None]
  cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]  # (b|1, l, 1, r/2)
  x1, x2, rest = x[..., : r // 2], x[..., r // 2: r], x[..., r:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _linear(p, name, x, rt, n_in=1):
  """x times the layer's weight `name` in the runtime's precision, with its adapter."""
  return mm.linear(x, p[name], rt.compute_dtype, rt.matmul_precision, n_in, mm.adapter_of(p, name))


def _qkv(p, u, rt):
  return _linear(p, "q_proj", u, rt), _linear(p, "k_proj", u, rt), _linear(p, "v_proj", u, rt)


def _out(p, o, rt):
  return _linear(p, "o_proj", o, rt, n_in=2)


def attention(p, u, cfg: Mamba2Config, rt: Runtime, ops: Ops | None = None, *, seq_idx=None, mask=None):
  """Causal self-attention over a sequence. u: (b, l, d) float32 (normed).
  seq_idx (b, l): packed documents; mask (b, l) bool: False on padding. ops: who
  computes softmax(q k^T) v (`Ops.attend`; `select.ops_for(cfg, rt)` unless given).
  Returns (b, l, d) float32 and the layer's keys and values {k, v} (b, l, k, e)
  float32, rotary applied: what a decoding cache starts from."""
  ops = ops_for(cfg, rt) if ops is None else ops
  cd = jnp.dtype(rt.compute_dtype)
  q, k, v = _qkv(p, u, rt)
  q = sharding.constrain(q, ("batch", "act_length", "act_heads", None))
  if cfg.attn_rotary_emb_dim:
    pos = positions(seq_idx, u.shape[1])
    q, k = rotary(q, pos, cfg), rotary(k, pos, cfg)
  # With the length split over devices (the 'sequence' mesh axis), queries stay
  # split and every device gathers all keys and values (an all-gather over the
  # axis, then (l / n) x l scores per device).
  if sharding.sequence_split() is not None:
    k, v = (sharding.constrain(a, ("batch", None, "act_kv_heads", None)) for a in (k, v))
  o = ops.attend(q, k, v, seq_idx, mask, cd, cfg.attn_scale)
  return _out(p, o, rt), {"k": k, "v": v}


def empty_kv(cfg: Mamba2Config, batch: int, capacity: int) -> dict[str, Array]:
  """One attention layer's decoding state before any token: buffers for
  `capacity` positions, none valid, the next write at 0."""
  shape = (batch, capacity, cfg.n_kv_heads, cfg.attn_head_dim)
  return {"k": jnp.zeros(shape, F32), "v": jnp.zeros(shape, F32),
          "kv_valid": jnp.zeros((batch, capacity), bool), "kv_pos": jnp.zeros((), jnp.int32)}


def kv_from_prefill(kv: dict[str, Array], capacity: int, mask=None) -> dict[str, Array]:
  """A layer's decoding state from the {k, v} `attention` returned for l prompt
  positions: the buffers padded to `capacity` (>= l), padding keys invalid."""
  b, l = kv["k"].shape[:2]
  if capacity < l:
    raise ValueError(f"key/value capacity {capacity} is smaller than the prompt ({l})")
  pad = lambda a: jnp.pad(a, [(0, 0), (0, capacity - l)] + [(0, 0)] * (a.ndim - 2))
  valid = jnp.ones((b, l), bool) if mask is None else mask.astype(bool)
  return {"k": pad(kv["k"]), "v": pad(kv["v"]), "kv_valid": pad(valid),
          "kv_pos": jnp.asarray(l, jnp.int32)}


def attention_step(p, u, cfg: Mamba2Config, rt: Runtime, state):
  """One position per sequence: u (b, d) float32 (normed), state as `empty_kv`.
  Writes this position's key and value at kv_pos and attends over the valid
  buffer. Costs O(capacity) whatever the number of tokens seen."""
  cd = jnp.dtype(rt.compute_dtype)
  q, k, v = _qkv(p, u[:, None], rt)  # (b, 1, heads, e)
  pos = state["kv_pos"]
  if cfg.attn_rotary_emb_dim:
    q, k = rotary(q, pos[None], cfg), rotary(k, pos[None], cfg)
  write = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), pos, axis=1)
  kb, vb = write(state["k"], k), write(state["v"], v)
  valid = write(state["kv_valid"], jnp.ones((u.shape[0], 1), bool))
  o = attend(q, kb, vb, valid[:, None, :], "xla", cd, cfg.attn_scale)  # one query: the plain form on every backend
  return _out(p, o[:, 0], rt), {"k": kb, "v": vb, "kv_valid": valid, "kv_pos": pos + 1}


# ----------------------------------------------------------------------------
# MLP.


def mlp(p, u, cfg: Mamba2Config, rt: Runtime):
  """down(act(up u)): act squared ReLU (relu2, Nemotron-H) or, for swiglu,
  silu(gate u) * (up u) (mamba_ssm's GatedMLP). u: (..., d) float32."""
  up = _linear(p, "up_proj", u, rt)
  if cfg.mlp_act == "swiglu":
    a = jax.nn.silu(_linear(p, "gate_proj", u, rt)) * up
  else:
    a = jnp.square(jax.nn.relu(up))
  if a.ndim == 3:
    a = sharding.constrain(a, ("batch", "act_length", "act_mlp"))
  return _linear(p, "down_proj", a, rt)
