"""The blockwise LM head + cross entropy (train/loss.py) against the plain form
(all logits at once, padding rows sliced off): value and gradients, float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.train.loss import linear_cross_entropy

from helpers import rel


def plain(h, w, targets, mask, vocab_size):
  logits = jnp.einsum("bld,vd->blv", h, w[:vocab_size], precision="highest")
  lse = jax.nn.logsumexp(logits, -1)
  tgt = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return jnp.sum((lse - tgt) * mask)


# (b, l, block_tokens): one block; several blocks with a ragged last one.
@pytest.mark.parametrize("b,l,block", [(2, 9, 1024), (3, 10, 12)])
def test_blockwise_matches_plain_value_and_gradients(b, l, block):
  d, v, vp = 16, 37, 48  # vocabulary padded to 48 rows, as the model pads it
  ks = jax.random.split(jax.random.PRNGKey(b * l), 4)
  h = jax.random.normal(ks[0], (b, l, d))
  w = jax.random.normal(ks[1], (vp, d))
  targets = jax.random.randint(ks[2], (b, l), 0, v)
  mask = (jax.random.uniform(ks[3], (b, l)) > 0.3).astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    ours = jax.jit(jax.value_and_grad(
        lambda h, w: linear_cross_entropy(h, w, targets, mask, v, block_tokens=block), argnums=(0, 1)))
    ref = jax.jit(jax.value_and_grad(lambda h, w: plain(h, w, targets, mask, v), argnums=(0, 1)))
    (v1, (gh1, gw1)), (v2, (gh2, gw2)) = ours(h, w), ref(h, w)
  assert v1.dtype == jnp.float32
  assert abs(float(v1) - float(v2)) / abs(float(v2)) < 1e-5
  assert rel(gh1, gh2) < 1e-5 and rel(gw1, gw2) < 1e-5
  assert np.all(np.asarray(gw1)[v:] == 0)  # padding rows get no gradient


def test_bfloat16_blocks_sum_the_heads_gradient_in_float32():
  """bfloat16 compute: four blocks (the head's gradient summed two blocks a matmul)
  against one block of the whole sequence (one matmul): the same products, summed
  in float32, so within float32 rounding; and both within bfloat16's error of the
  float32 plain form (a few ulps of 2**-8), which bfloat16 really moved."""
  b, l, d, v, vp = 2, 16, 32, 37, 48
  ks = jax.random.split(jax.random.PRNGKey(7), 4)
  h = jax.random.normal(ks[0], (b, l, d))
  w = jax.random.normal(ks[1], (vp, d)) / 4
  targets = jax.random.randint(ks[2], (b, l), 0, v)
  mask = (jax.random.uniform(ks[3], (b, l)) > 0.3).astype(jnp.float32)

  def grads(block, cd):
    f = lambda h, w: linear_cross_entropy(h, w, targets, mask, v, cd, block_tokens=block)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)
  (v4, (gh4, gw4)), (v1, (gh1, gw1)) = grads(b * 4, "bfloat16"), grads(b * l, "bfloat16")
  assert abs(float(v4) - float(v1)) / abs(float(v1)) < 1e-6
  assert rel(gh4, gh1) < 1e-5 and rel(gw4, gw1) < 1e-5
  with jax.default_matmul_precision("highest"):
    v0, (gh0, gw0) = jax.jit(jax.value_and_grad(lambda h, w: plain(h, w, targets, mask, v), argnums=(0, 1)))(h, w)
  for got, want in ((gh4, gh0), (gw4, gw0)):
    assert 1e-4 < rel(got, want) < 2e-2
  assert abs(float(v4) - float(v0)) / abs(float(v0)) < 1e-2


def test_shape_mismatch_is_named():
  with pytest.raises(ValueError, match="do not agree"):
    linear_cross_entropy(jnp.zeros((2, 3, 4)), jnp.zeros((5, 4)), jnp.zeros((2, 4), jnp.int32),
                         jnp.ones((2, 4)), 5)
