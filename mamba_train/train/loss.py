"""The LM head and cross entropy in one, blockwise: the (b, l, vocab) float32 logits
never exist at once.

`linear_cross_entropy` walks the sequence in blocks of positions (`lax.scan`, the
batch axis kept whole so its sharding over devices stays as it is); each block's
logits are made, reduced to their logsumexp and target logit, and dropped. Its
custom VJP makes them again for the gradients, a group of blocks a matmul (two
in bfloat16, whose p then takes a float32 block's memory; one in float32). The padding rows
of the vocabulary are masked to -inf inside the block, not sliced off, so no
(b, l, vocab) copy is made either. Precision: the head matmul in the compute
dtype with float32 accumulation, everything after it float32.

tokamax's `linear_softmax_cross_entropy_loss` (a Mosaic TPU kernel) was the
candidate to reuse; it returns only a sum or mean over all tokens (no per-token
weights, so no loss mask), knows no padded vocabulary, runs its kernel on TPU only
(elsewhere it materialises the logits), and brings seven dependencies. This form
runs on every backend and keeps the trainer's exact masked sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
# Tokens per block and device: the block's float32 logits are block_tokens x
# vocab x 4 bytes (412 MB at the 50k vocabulary), and each block reads the head
# weight once more (2 d vocab bytes in bfloat16), so blocks stay large.
BLOCK_TOKENS = 2048
# Up to this many blocks the loop is unrolled: XLA's cost analysis then counts
# every block (it counts a loop body once), and nothing serialises them.
UNROLL = 16


def _blocks(x, t):
  """(b, l, ...) -> (l / t, b, t, ...), l padded with zeros to a multiple of t.
  Block j holds positions j, j + l/t, j + 2 l/t, ...: strided, so that when the
  sequence is split over devices every block keeps the same split (its t axis)."""
  b, l = x.shape[:2]
  pad = (-l) % t
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(b, t, (l + pad) // t, *x.shape[2:]), 2, 0)


def _block_logits(hb, wc, vocab_size):
  logits = jnp.einsum("btd,vd->btv", hb.astype(wc.dtype), wc, preferred_element_type=F32)
  if vocab_size < wc.shape[0]:  # padding rows of the head: out of every softmax
    logits = jnp.where(jnp.arange(wc.shape[0]) < vocab_size, logits, -jnp.inf)
  return logits


def _unroll(blocks):
  return blocks.shape[0] if blocks.shape[0] <= UNROLL else 1


def _block_len(b, l, block_tokens):
  return max(1, min(l, block_tokens // max(b, 1)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _lce(h, w, targets, weights, vocab_size, compute_dtype, block):
  return _lce_fwd(h, w, targets, weights, vocab_size, compute_dtype, block)[0]


def _lce_fwd(h, w, targets, weights, vocab_size, compute_dtype, block):
  # weights (b, l, k): k sums per row, (b, k) (one for the loss, two for DPO's responses).
  wc = w.astype(compute_dtype)

  def body(total, xs):
    hb, tb, mb = xs
    logits = _block_logits(hb, wc, vocab_size)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # The target's logit as a masked sum, not a gather (take_along_axis): XLA fuses
    # it into the pass that reduces the logits, where on TPU a gather is an op of
    # its own that reads the block's logits again. Exact: one term is the logit.
    tgt = jnp.sum(jnp.where(jnp.arange(wc.shape[0]) == tb[..., None], logits, 0.0), -1)
    return total + jnp.einsum("bt,btk->bk", lse - tgt, mb), lse

  xs = (_blocks(h, block), _blocks(targets, block), _blocks(weights, block))
  b, k = weights.shape[0], weights.shape[-1]
  total, lse = jax.lax.scan(body, jnp.zeros((b, k), F32), xs, unroll=_unroll(xs[0]))
  return total, (h, w, targets, weights, lse)


def _lce_bwd(vocab_size, compute_dtype, block, res, g):
  h, w, targets, weights, lse = res
  wc = w.astype(compute_dtype)
  cd = wc.dtype

  def block_p(hb, tb, mb, lb):
    p = jnp.exp(_block_logits(hb, wc, vocab_size) - lb[..., None])  # softmax; 0 on padding rows
    p = p - jax.nn.one_hot(tb, wc.shape[0], dtype=F32)
    return (p * jnp.einsum("btk,bk->bt", mb, g)[..., None]).astype(cd)

  def body(dw, xs):  # xs: `group` blocks
    # The group's logits as one batched matmul whose epilogue writes p in the
    # compute dtype: XLA then reads no float32 logits here. (Made block by block,
    # XLA merged them with the forward's when the blocks were unrolled and read
    # those float32 logits back twice, once for each matmul below.)
    ps = jax.vmap(block_p)(*xs)
    dh = jnp.einsum("jbtv,vd->jbtd", ps, wc, preferred_element_type=F32)
    dw = dw + jnp.einsum("jbtv,jbtd->vd", ps, xs[0].astype(cd), preferred_element_type=F32)
    return dw, dh

  xs = (_blocks(h, block), _blocks(targets, block), _blocks(weights, block), lse)
  # The head's gradient takes `group` blocks a matmul: the float32 (vocab, d) sum it
  # carries is read and written once a group, not once a block. A group's p in the
  # compute dtype holds no more than one block's float32 logits (the forward's peak):
  # two blocks in bfloat16, one in float32 (then it is the block-by-block form).
  n = xs[0].shape[0]
  group = max(1, 4 // cd.itemsize)
  group = group if n % group == 0 else 1
  xs = jax.tree.map(lambda a: a.reshape(n // group, group, *a.shape[1:]), xs)
  dw, dh = jax.lax.scan(body, jnp.zeros(w.shape, F32), xs, unroll=_unroll(xs[0]))
  b, l = h.shape[:2]
  dh = jnp.moveaxis(dh.reshape(n, *dh.shape[2:]), 0, 2).reshape(b, -1, h.shape[-1])[:, :l]
  return dh.astype(h.dtype), dw.astype(w.dtype), None, None


_lce.defvjp(_lce_fwd, _lce_bwd)


def linear_cross_entropy(h, w, targets, weights, vocab_size: int, compute_dtype="float32",
                         block_tokens: int = BLOCK_TOKENS, batch_shards: int = 1):
  """sum over positions of weights * (logsumexp(logits) - logits[target]), float32,
  with logits = h @ w[:vocab_size].T made block by block (see the module doc).

  h: (b, l, d) float32 (after the final norm); w: (v_padded, d) the LM head;
  targets: (b, l) ints < vocab_size; weights: (b, l) float32 (the loss mask).
  Gradients flow to h and w. batch_shards: the devices the (b, l) tokens are
  split over (a block holds block_tokens tokens per device).
  """
  return jnp.sum(row_cross_entropy(h, w, targets, weights[..., None], vocab_size, compute_dtype,
                                   block_tokens, batch_shards))


def row_cross_entropy(h, w, targets, weights, vocab_size: int, compute_dtype="float32",
                      block_tokens: int = BLOCK_TOKENS, batch_shards: int = 1):
  """`linear_cross_entropy` summed per row and per weight channel: weights (b, l, k)
  -> (b, k) float32, sum over positions of weights[..., k] * (logsumexp - target logit)."""
  b, l = targets.shape
  if h.shape[:2] != (b, l) or w.shape[-1] != h.shape[-1] or weights.shape[:2] != (b, l):
    raise ValueError(f"linear_cross_entropy: h {h.shape}, w {w.shape}, targets {targets.shape}, "
                     f"weights {weights.shape} do not agree: need h (b, l, d), w (v, d), "
                     "targets (b, l), weights (b, l[, k])")
  block = _block_len(b, l, block_tokens * batch_shards)
  return _lce(h, w, targets.astype(jnp.int32), weights.astype(F32), vocab_size,
              jnp.dtype(compute_dtype), block)
