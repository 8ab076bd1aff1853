"""GRPO's rollouts on the device: G completions of each prompt, with the sampler's
per-token log-probabilities, and the same log-probabilities from one full forward
pass (what the trainer computes), so the two can be held to each other.

The device work is two programs, each compiled once per shape:

  prefill  the B prompts, left-padded to a power-of-two length (generation's padding:
           few programs serve all lengths), through the chunked scan once; then the
           cache and the last logits repeated G times along the batch
           (`Mamba2Cache.repeat`: row r is prompt r // G), pinned to the data axes;
  decode   generation's `decode_loop` over the B*G rows: temperature, top-k, top-p,
           EOS and stop strings as `generate` has them, each row with its own random
           stream (the key folded with the row's index, so a row's tokens depend on
           the key and its index alone, not on B, G or the devices), keeping each
           sampled token's log-probability.

Which log-probability (`logprob_of`, generation.token_logprob):
  sampling  (default) log_softmax(logits / temperature) of the sampled token, before
            top-k and top-p: what TRL's GRPOTrainer computes for the policy
            (`_get_per_token_logps_and_entropies` divides the logits by the temperature
            and applies no top-k / top-p) and what `sequence_logprobs` recomputes, so
            the sampler-trainer gap is rounding alone. TRL asks vLLM for the same
            (logprobs_mode="processed_logprobs"); vLLM's default is raw.
  filtered  under the distribution actually sampled, after top-k and top-p (the
            behaviour policy's exact probability when those are on).
  raw       log_softmax(logits), temperature 1 (vLLM's default raw_logprobs).
temperature 0 (greedy) counts as temperature 1 for `sampling`.

Sharding: under `sharding.use_rules(mesh)` the B*G rows split over the data axes
(the rules' 'batch': data, fsdp, expert), which must divide B*G; the prefill of the
B prompts splits the same way when they divide B, else runs whole on each replica.

Shapes: b = B prompts, n = B*G rows, l prompt length (padded), t new tokens, v vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mamba_train import generation
from mamba_train.generation import LOGPROB_OF, decode_loop, prefill, token_logprob
from mamba_train.metrics import Timer
from mamba_train.model.lm import Mamba2LM
from mamba_train.parallel import sharding


@dataclasses.dataclass
class Rollout:
  prompt_ids: np.ndarray  # (n, l) int32, left-padded prompts, row r is prompt r // G
  prompt_mask: np.ndarray  # (n, l) bool, False on left padding
  completion_ids: np.ndarray  # (n, t) int32, pad_id after the end
  completion_mask: np.ndarray  # (n, t) bool: True up to and including EOS / the stop string's last token
  logprobs: np.ndarray  # (n, t) float32: the sampler's log-probability of each token (0 where masked)
  lengths: np.ndarray  # (n,) int32
  stats: dict  # tokens, seconds, tokens_per_s, prefill_s, decode_s, compile_s, steps


# ----------------------------------------------------------------------------
# The device programs.


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "capacity"))
def _prefill_program(graphdef, params, input_ids, mask, *, group_size, capacity):
  """Prefill of the b prompts, then their last logits (n, v) and cache, each row
  repeated group_size times."""
  model = nnx.merge(graphdef, params)
  with _prefill_rules(input_ids.shape[0]):
    logits, cache = prefill(model, input_ids, mask, capacity=capacity)
  logits = sharding.constrain(jnp.repeat(logits, group_size, axis=0), ("batch", None))
  return logits, cache.repeat(group_size)


def _prefill_rules(b: int):
  """The active rules, or, when the data axes do not divide the b prompts, the same
  with the batch whole on every device (each replica prefills every prompt; the
  G copies split again)."""
  active = sharding.active()
  if active is None or b % data_parallel_size() == 0:
    return contextlib.nullcontext()
  mesh, rules = active
  return sharding.use_rules(mesh, tuple((k, None if k == "batch" else v) for k, v in rules))


@functools.partial(jax.jit, static_argnames=("graphdef", "buffer_len", "logprob_of"))
def _decode_program(graphdef, params, logits, cache, key, temperature, top_k, top_p, eos_id,
                    pad_id, max_new_tokens, stop, *, buffer_len, logprob_of):
  model = nnx.merge(graphdef, params)
  rows = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(logits.shape[0]))
  return decode_loop(model, logits, cache, rows, temperature, top_k, top_p, eos_id, pad_id,
                     max_new_tokens, stop, buffer_len=buffer_len, logprob_of=logprob_of)


# ----------------------------------------------------------------------------
# The trainer's side: the same log-probabilities from one forward pass.


def sequence_logprobs(model: Mamba2LM, prompt_ids, prompt_mask, completion_ids, temperature):
  """log_softmax(logits / temperature) (n, t) float32 of each completion token, from
  one forward pass over prompt + completion (n, l + t): the trainer's log-probabilities
  of a `Rollout`, TRL's `_get_per_token_logps`, and the sampler's with
  logprob_of="sampling" up to float32 rounding. Traceable (jit it, or call it inside a
  loss: it is differentiable in the model's parameters); temperature may be traced (0
  counts as 1). Positions after a completion's end hold the log-probability of pad_id
  there: mask them. Holds (n, t, v) float32 logits at once."""
  prompt_ids, completion_ids = jnp.asarray(prompt_ids), jnp.asarray(completion_ids)
  l, t = prompt_ids.shape[1], completion_ids.shape[1]
  ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
  mask = jnp.concatenate([jnp.asarray(prompt_mask, bool), jnp.ones(completion_ids.shape, bool)], axis=1)
  h, _ = model.backbone(ids, mask=mask)
  # Position l - 1 + j predicts completion token j.
  logits = model.logits(h[:, l - 1:l - 1 + t])
  return token_logprob(logits, completion_ids, jnp.float32(temperature), 0, 1.0, "sampling")


# ----------------------------------------------------------------------------
# The host side.


def data_parallel_size() -> int:
  """How many ways the active rules split a batch (the 'batch' axis's mesh axes); 1
  outside `sharding.use_rules`."""
  active = sharding.active()
  if active is None:
    return 1
  mesh, rules = active
  return sharding.axes_size(mesh, dict(rules).get("batch"))


def _check(prompts, group_size, logprob_of):
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
    raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
  if logprob_of not in LOGPROB_OF:
    raise ValueError(f"logprob_of must be one of {LOGPROB_OF}, got {logprob_of!r}")
  rows, dp = len(prompts) * group_size, data_parallel_size()
  if rows % dp:
    raise ValueError(f"{len(prompts)} prompts x group_size {group_size} = {rows} rows do not split "
                     f"over the data-parallel size {dp} (the mesh axes the 'batch' rule names); "
                     f"make prompts x group_size a multiple of {dp}")


def _key(key):
  """A typed key from a typed key, a raw uint32 key or an int seed."""
  if isinstance(key, (int, np.integer)):
    return jax.random.key(int(key))
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key)


def rollout(model: Mamba2LM, prompt_ids: list[np.ndarray], group_size: int, max_new_tokens: int, *,
            key, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_id: int = -1,
            pad_id: int = 0, stop_strings=(), token_bytes=None, logprob_of: str = "sampling",
            max_prompt_len: int = generation.MAX_PROMPT_LEN) -> Rollout:
  """group_size completions of each prompt, sampled on the device (module docstring).

  prompt_ids: B prompts (1-D token ids, any lengths). key: a `jax.random.key` (or raw
  key, or int seed); the same key gives the same rollout. temperature, top_k, top_p,
  stop_strings, token_bytes: as `generate`'s (stop_strings: one list for all prompts or
  one per prompt). eos_id: -1 for none. A completion ends at EOS or at the token that
  completes a stop string (kept, and masked in) or after max_new_tokens; after that its
  ids are pad_id, its mask False and its log-probabilities 0. The arrays have
  t = max_new_tokens columns whatever the steps run, so the trainer sees one shape.

  Raises ValueError before compiling for group_size < 1, an empty prompt, B*group_size
  not a multiple of the data-parallel size, and what `generate` refuses.
  """
  model = model.merged()  # a base plus LoRA adapters decodes as their merged weights
  cfg = model.config
  eos_id = -1 if eos_id is None else int(eos_id)
  prompts, _ = generation.checked_prompts(prompt_ids, cfg.vocab_size, max_new_tokens, temperature,
                                          top_k, top_p, None if eos_id == -1 else eos_id, pad_id,
                                          max_prompt_len)
  _check(prompts, group_size, logprob_of)
  b, g = len(prompts), int(group_size)
  per_row = stop_strings and not isinstance(stop_strings[0], (bytes, str))
  stop = generation.stop_operands(stop_strings, token_bytes, cfg.vocab_size, b if per_row else b * g)
  if stop is not None and per_row:  # one list per prompt: each of its G rows gets it
    stop = (stop[0], np.repeat(stop[1], g, axis=0), np.repeat(stop[2], g, axis=0))

  length, buffer_len = generation.padded_lengths(prompts, max_new_tokens)
  ids, mask = generation.left_pad(prompts, length, pad_id)
  graphdef, params = nnx.split(model)
  pre_args = (params, jnp.asarray(ids), jnp.asarray(mask))
  pre, compile_s = generation.compiled(_prefill_program, graphdef, pre_args, group_size=g,
                                       capacity=length + buffer_len)
  with Timer() as t_pre:
    logits, cache = jax.block_until_ready(pre(*pre_args))
  dec_args = (params, logits, cache, _key(key), jnp.float32(temperature),
              jnp.int32(min(int(top_k), 2**31 - 1)), jnp.float32(top_p), jnp.int32(eos_id),
              jnp.int32(pad_id), jnp.int32(max_new_tokens),
              None if stop is None else tuple(map(jnp.asarray, stop)))
  dec, dec_compile_s = generation.compiled(_decode_program, graphdef, dec_args, buffer_len=buffer_len,
                                           logprob_of=logprob_of)
  with Timer() as t_dec:
    out, n, lengths, logprobs = dec(*dec_args)
    out, n, lengths, logprobs = (sharding.to_host(out), int(sharding.to_host(n)),
                                 sharding.to_host(lengths), sharding.to_host(logprobs))

  t = int(max_new_tokens)
  completion_mask = np.arange(t)[None, :] < lengths[:, None]
  tokens = int(lengths.sum())
  seconds = t_pre.seconds + t_dec.seconds
  stats = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
           "prefill_s": t_pre.seconds, "decode_s": t_dec.seconds, "compile_s": compile_s + dec_compile_s,
           "steps": n}
  return Rollout(prompt_ids=np.repeat(ids, g, axis=0), prompt_mask=np.repeat(mask, g, axis=0),
                 completion_ids=np.where(completion_mask, out[:, :t], pad_id).astype(np.int32),
                 completion_mask=completion_mask,
                 logprobs=np.where(completion_mask, logprobs[:, :t], 0.0).astype(np.float32),
                 lengths=lengths.astype(np.int32), stats=stats)
