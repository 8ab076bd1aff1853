"""Causal attention by tokamax's flash attention (Pallas Triton, NVIDIA GPUs; the `gpu`
extra), in the layout and with the result of `attention.attend`.

The plain form (`attention.attend`, form 'xla') writes the float32 scores of every
query against every key and reads them back through the softmax, forward, in full
remat's recompute and backward (what that costs the Nano recipe's h100-8 step:
docs/bench/moe.md, "Attention by tokamax's flash kernel"). tokamax's kernels keep the
scores on chip: the forward returns the output and the softmax's row statistics, the
backward recomputes the scores block by block. cuDNN's flash attention (form 'cudnn')
does the same but needs a GPU to compile; these compile on any host.

Shapes: b batch, l queries (= keys), h query heads, k key/value heads, r = h / k, e head dim.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from mamba_train.ops.experts_gpu import import_tokamax

F32 = jnp.float32

# Which of tokamax's attention implementations runs: its Pallas Triton kernels. Tests
# on a CPU set tokamax's XLA implementation (the kernels have no interpreter there).
IMPLEMENTATION = "triton"


def flash(q, k, v, seq_idx, key_mask, cd, scale: float | None = None, *, shard=None):
  """softmax(scale q k^T, causal keys of the query's document) v, as `attention.attend`
  gives it for `attention.allowed(l, l, seq_idx=, key_mask=)`.

  q (b, l, h, e), k and v (b, l, k, e), seq_idx (b, l) or None, key_mask (b, l) bool or
  None -> (b, l, h, e) float32. Documents and padding are segments, as splash takes
  them (`attention_tpu.splash`): a query sees the earlier keys of its own segment, and
  padding (key_mask False) is a segment of its own, so no real query sees it (a padding
  query's output, which nothing reads, may differ from the plain form's). Without
  either it is tokamax's causal path alone. tokamax takes the key/value heads grouped
  (h a multiple of k), in the compute dtype, float32 accumulation inside.
  shard: under a mesh, shard(run, q, k, v, seg) runs it per shard as splash is run
  (`parallel.sharding.kv_head_map`: batch over data/fsdp, kv heads over tensor), as
  XLA cannot partition a Pallas call. q then travels as (b, k, r, l, e)."""
  tokamax = import_tokamax()
  b, l, h, e = q.shape
  kv = k.shape[2]
  r = h // kv
  scale = 1.0 / math.sqrt(e) if scale is None else scale
  seg = None
  if seq_idx is not None or key_mask is not None:
    seg = jnp.zeros((b, l), jnp.int32) if seq_idx is None else seq_idx.astype(jnp.int32)
    if key_mask is not None:
      seg = jnp.where(key_mask, seg, -1)

  def run(qs, ks, vs, seg):
    n, kvn = qs.shape[:2]
    qq = qs.transpose(0, 3, 1, 2, 4).reshape(n, l, kvn * r, e)
    mask = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]  # (n, 1, l, l)
    out = tokamax.dot_product_attention(qq, ks, vs, mask=mask, is_causal=True, scale=scale,
                                        implementation=IMPLEMENTATION)
    return out.reshape(n, l, kvn, r, e).transpose(0, 2, 3, 1, 4)

  qs = q.astype(cd).reshape(b, l, kv, r, e).transpose(0, 2, 3, 1, 4)  # (b, k, r, l, e)
  ks, vs = k.astype(cd), v.astype(cd)
  if shard is None:
    out = run(qs, ks, vs, seg)
  else:  # kv_head_map's layout: k and v (b, k, l, e), seg (b, l)
    segs = jnp.zeros((b, l), jnp.int32) if seg is None else seg
    out = shard(lambda qs, ks, vs, s: run(qs, ks.transpose(0, 2, 1, 3), vs.transpose(0, 2, 1, 3),
                                          None if seg is None else s),
                qs, ks.transpose(0, 2, 1, 3), vs.transpose(0, 2, 1, 3), segs)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, l, h, e).astype(F32)
