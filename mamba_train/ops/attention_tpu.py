"""Causal attention through JAX's Pallas splash kernel (TPU), with the arguments
and result of the plain form (`attention.attend`), and documents and padding as its
segment ids."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mamba_train.ops.attention import SPLASH_BLOCKS

F32 = jnp.float32


def splash(q, k, v, seq_idx, key_mask, cd, scale: float | None = None, *, interpret: bool = False,
           shard=None):
  """Causal attention through JAX's Pallas splash kernel (TPU), in the layout and
  with the result of `attend`. Documents and padding become its segment ids: a
  query sees keys of its own segment only, and padding (key_mask False) is a
  segment of its own, so it never reaches a real position. The kernel takes one
  kv head and its r query heads at a time (its MQA form), mapped over batch and
  kv heads. shard: under a mesh, shard(run, qs, ks, vs, seg) runs it per shard
  (batch over data/fsdp, kv heads over tensor: `parallel.sharding.kv_head_map`),
  as a Pallas call cannot be partitioned by XLA."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as sk,
    splash_attention_mask as sm,
  )
  b, l, h, e = q.shape
  kv = k.shape[2]
  r = h // kv
  blk = next(x for x in SPLASH_BLOCKS if l % x == 0)
  names = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
           "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")
  kernel = sk.make_splash_mqa_single_device(
      sm.MultiHeadMask([sm.CausalMask((l, l))] * r), interpret=interpret,
      block_sizes=sk.BlockSizes(**dict.fromkeys(names, blk)))
  seg = jnp.zeros((b, l), jnp.int32) if seq_idx is None else seq_idx.astype(jnp.int32)
  if key_mask is not None:
    seg = jnp.where(key_mask, seg, -1)
  scale = 1.0 / math.sqrt(e) if scale is None else scale
  qs = (q * scale).astype(cd).reshape(b, l, kv, r, e).transpose(0, 2, 3, 1, 4)
  ks, vs = (a.astype(cd).transpose(0, 2, 1, 3) for a in (k, v))  # (b, kv, l, e)

  def run(qs, ks, vs, seg):
    one = lambda qg, kk, vv, s: kernel(qg, kk, vv, segment_ids=sk.SegmentIds(q=s, kv=s))
    return jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(qs, ks, vs, seg)

  out = run(qs, ks, vs, seg) if shard is None else shard(run, qs, ks, vs, seg)  # (b, kv, r, l, e)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, l, h, e).astype(F32)

