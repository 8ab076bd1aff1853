"""A temporary stand-in for mamba_train/rollout.py (being built on branch `rollout`), with its
interface: the GRPO trainer's tests put it in sys.modules as `mamba_train.rollout` until the
real module is merged. Slow and plain: each new token is one full forward pass over a fixed
buffer (the model is causal, so the positions not yet written do not matter)."""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mamba_train import generation


@dataclasses.dataclass
class Rollout:
  prompt_ids: np.ndarray
  prompt_mask: np.ndarray
  completion_ids: np.ndarray
  completion_mask: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  stats: dict


def _scaled(logits, temperature):
  return logits / jnp.where(temperature > 0, temperature, 1.0)


def sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, temperature):
  lp, t = prompt_ids.shape[1], completion_ids.shape[1]
  ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
  mask = jnp.concatenate([prompt_mask, jnp.ones(completion_ids.shape, bool)], axis=1)
  h, _ = model.backbone(ids, mask=mask)
  logits = model.logits(h[:, lp - 1:lp + t - 1])
  logp = jax.nn.log_softmax(_scaled(logits, temperature), axis=-1)
  return jnp.take_along_axis(logp, completion_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _next(graphdef, params, ids, mask, pos, key, temperature, top_k, top_p):
  model = nnx.merge(graphdef, params)
  h, _ = model.backbone(ids, mask=mask)
  logits = model.logits(jax.lax.dynamic_index_in_dim(h, pos, axis=1, keepdims=False))
  tok = generation.sample(key, logits, temperature, top_k, top_p)
  logp = jax.nn.log_softmax(_scaled(logits, temperature), axis=-1)
  return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def rollout(model, prompt_ids, group_size, max_new_tokens, *, key, temperature=1.0, top_k=0, top_p=1.0,
            eos_id=-1, pad_id=0, stop_strings=(), token_bytes=None):
  prompts = [np.asarray(p, np.int32) for p in prompt_ids for _ in range(group_size)]
  lp = generation.round_up_pow2(max(p.size for p in prompts), 8)
  p_ids, p_mask = generation.left_pad(prompts, lp, pad_id)
  n, t = len(prompts), max_new_tokens
  ids = np.concatenate([p_ids, np.full((n, t), pad_id, np.int32)], 1)
  mask = np.concatenate([p_mask, np.ones((n, t), bool)], 1)
  graphdef, params = nnx.split(model)
  done = np.zeros(n, bool)
  out_mask = np.zeros((n, t), bool)
  logps = np.zeros((n, t), np.float32)
  for i in range(t):
    key, sub = jax.random.split(key)
    tok, lpr = jax.device_get(_next(graphdef, params, jnp.asarray(ids), jnp.asarray(mask), lp - 1 + i, sub,
                                    jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p)))
    live = ~done
    ids[:, lp + i] = np.where(live, tok, pad_id)
    out_mask[:, i] = live
    logps[:, i] = np.where(live, lpr, 0.0)
    done |= live & (tok == eos_id)
    if done.all():
      break
  return Rollout(p_ids, p_mask, ids[:, lp:], out_mask, logps, out_mask.sum(1).astype(np.int32),
                 {"tokens": int(out_mask.sum()), "seconds": 0.0, "tokens_per_s": 0.0,
                  "prefill_s": 0.0, "decode_s": 0.0})


def install():
  """Make `import mamba_train.rollout` find this module (when the real one is absent)."""
  try:
    import mamba_train.rollout  # noqa: F401
  except ImportError:
    import mamba_train
    sys.modules["mamba_train.rollout"] = sys.modules[__name__]
    mamba_train.rollout = sys.modules[__name__]
