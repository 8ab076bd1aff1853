"""Causal attention's plain forms: which keys each query may see (`allowed`), and
softmax(q k^T) v in XLA's einsums (the reference), or through
`jax.nn.dot_product_attention` (XLA's implementation, or cuDNN's fused flash
attention). JAX's Pallas splash kernel beside them is `attention_tpu.py`; which runs
is decided in `table.py`.

Shapes: b batch, l queries, s keys, h query heads, k key/value heads, e head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

F32 = jnp.float32


def allowed(l: int, s: int, *, seq_idx=None, key_mask=None, q_offset=0):
  """(b|1, l, s) bool: which keys each query may see. Causal (key position <=
  query position + q_offset); with seq_idx (b, l = s) only keys of the query's
  document; with key_mask (b, s) only valid keys. A query always sees its own
  position, so a padding query's row is never empty (its output is unused)."""
  qpos = jnp.arange(l)[:, None] + q_offset
  kpos = jnp.arange(s)[None, :]
  ok = (kpos <= qpos)[None]
  if seq_idx is not None:
    ok = ok & (seq_idx[:, :, None] == seq_idx[:, None, :])
  if key_mask is not None:
    ok = ok & (key_mask[:, None, :] | (kpos == qpos)[None])
  return ok


def attend(q, k, v, ok, form: str, cd, scale: float | None = None):
  """softmax(scale q k^T, keys where `ok`) v; scale 1/sqrt(e) unless given
  (`Mamba2Config.attn_scale`).

  q (b, l, h, e), k and v (b, s, k, e), ok (b|1, l, s) bool, or None for plain
  causal attention (l = s) -> (b, l, h, e) float32.
  form 'xla' is the reference: grouped heads by reshape, scores and softmax in
  float32. 'dot_product' / 'cudnn' call jax.nn.dot_product_attention; with no
  mask beyond causality it takes is_causal, cuDNN's fused causal flash path
  (an explicit mask becomes an l x l bias there).
  """
  b, l, h, e = q.shape
  kv = k.shape[2]
  scale = 1.0 / math.sqrt(e) if scale is None else scale
  if form in ("dot_product", "cudnn"):
    out = jax.nn.dot_product_attention(
        q.astype(cd), k.astype(cd), v.astype(cd), mask=None if ok is None else ok[:, None],
        is_causal=ok is None, scale=scale, implementation="cudnn" if form == "cudnn" else None)
    return out.astype(F32)
  if ok is None:
    ok = allowed(l, k.shape[1])
  qg = q.reshape(b, l, kv, h // kv, e).astype(cd)
  s = jnp.einsum("blkre,bske->bkrls", qg, k.astype(cd), preferred_element_type=F32) * scale
  # A finite floor, not -inf: a fully masked row would give NaN, and `allowed`
  # keeps the diagonal so none is, but a finite value costs nothing.
  s = jnp.where(ok[:, None, None], s, jnp.finfo(F32).min)
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum("bkrls,bske->blkre", p.astype(cd), v.astype(cd), preferred_element_type=F32)
  return out.reshape(b, l, h, e)



SPLASH_BLOCKS = (512, 256, 128)  # the largest that divides the length is used


def splash_fits(l: int) -> bool:
  return any(l % blk == 0 for blk in SPLASH_BLOCKS)

