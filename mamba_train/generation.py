"""Generation: prefill, one-token step, sampling, and `generate`.

`generate` compiles prefill and the whole decode loop into one device program:
a `jax.lax.while_loop` that steps every layer's recurrent state (`Mamba2Cache`,
fixed size; a hybrid's attention layers add key/value buffers sized once for the
prompt and the new tokens) one token at a time, samples on device, and stops as soon as every
sequence has produced EOS or one of its stop strings. The host sees only the finished token
buffer.

Stop strings are matched on the device against the bytes of the new tokens: the
caller gives each token id's bytes (`token_byte_table`), the loop keeps the last
few bytes of every row and compares them with the row's stop strings after each
token, as transformers' and lm-eval's string stopping criteria do on the host.

Prompts of different lengths are left-padded to one length (rounded up to a
power of two, so a handful of programs serve all lengths) and the model's
`mask` marks the padding: there the conv input and dt are zero, so padding
cannot touch the state and each sequence gets what it would get alone (its
logits agree to float32 rounding: padding moves the chunk boundaries).

Shapes: b batch, l prompt length, v vocabulary, t new tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mamba_train.metrics import Timer
from mamba_train.model.cache import Mamba2Cache
from mamba_train.model.lm import Mamba2LM
from mamba_train.parallel import sharding

# Longest prompt accepted. The released models were trained at context 2048 and
# a state-space model carries any length in its fixed state, so this limit is
# about prefill memory, not the cache: the chunked scan's intermediates grow
# linearly with l (docs/bench/design_notes.md). Pass max_prompt_len= to
# `generate` for more.
MAX_PROMPT_LEN = 16384
_MIN_LENGTH = 16  # the shortest padded prompt and output buffer


# ----------------------------------------------------------------------------
# The two model passes. Plain traceable functions: jit them (or call inside a
# jitted function) with the model merged from its graphdef and state.


def prefill(model: Mamba2LM, input_ids, mask=None, capacity: int | None = None
            ) -> tuple[jax.Array, Mamba2Cache]:
  """Run prompts through the chunked scan. input_ids (b, l); mask (b, l) bool,
  False on left padding. Returns the logits after the last position (b, v)
  float32 and the cache holding the state after it; a hybrid's attention layers
  get key/value buffers of `capacity` positions (default l: room for none more)."""
  h, states = model.backbone(input_ids, mask=mask)
  capacity = input_ids.shape[1] if capacity is None else capacity
  return model.logits(h[:, -1]), Mamba2Cache.from_prefill(states, capacity, mask).constrain()


def step(model: Mamba2LM, token, cache: Mamba2Cache) -> tuple[jax.Array, Mamba2Cache]:
  """One token per sequence (b,) through every layer. Returns its logits (b, v)
  and the new cache. Costs the same at any context length (a hybrid's attention
  layers: in proportion to the cache's capacity)."""
  h, states = model.step(token, cache.states())
  return model.logits(h), Mamba2Cache.from_states(states).constrain()


# ----------------------------------------------------------------------------
# Sampling.


def sample(key, logits, temperature, top_k, top_p):
  """Next tokens (b,) int32 from logits (b, v).

  temperature 0 picks the argmax (greedy). Otherwise softmax(logits/temperature)
  is sampled after top-k (0: off; tokens tied with the k-th are kept) and then
  nucleus filtering (keep the fewest most likely tokens whose mass reaches
  top_p; 1: off), in transformers' order. All three are traced values, so one
  compiled program serves every setting; the branch is a `lax.cond`, so greedy
  decoding never pays for the sort. key: one key for the batch, or one per row
  (b,) (each row's draw then depends on its own key alone, whatever the batch).
  """
  logits = logits.astype(jnp.float32)

  def greedy(_):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def filtered(_):
    kept = _filtered(logits / temperature, top_k, top_p)
    if key.ndim:  # a key per row
      return jax.vmap(jax.random.categorical)(key, kept).astype(jnp.int32)
    return jax.random.categorical(key, kept, axis=-1).astype(jnp.int32)

  return jax.lax.cond(temperature > 0.0, filtered, greedy, None)


def _filtered(scaled, top_k, top_p):
  """The temperature-scaled logits (b, v) with what top-k and then top-p drop set
  to -inf."""
  v = scaled.shape[-1]
  desc = -jnp.sort(-scaled, axis=-1)
  k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
  kth = jax.lax.dynamic_index_in_dim(desc, k - 1, axis=-1)  # (b, 1)
  desc = jnp.where(desc >= kth, desc, -jnp.inf)  # still sorted
  probs = jax.nn.softmax(desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  cutoff = jnp.min(jnp.where(mass_before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
  # top_p = 1 must keep everything: rounding can push mass_before to 1.0 early.
  cutoff = jnp.where(top_p < 1.0, cutoff, -jnp.inf)
  return jnp.where(scaled >= jnp.maximum(kth, cutoff), scaled, -jnp.inf)


# Which distribution a sampled token's log-probability is taken under (`token_logprob`).
LOGPROB_OF = ("sampling", "filtered", "raw")


def token_logprob(logits, tokens, temperature, top_k, top_p, of: str = "sampling"):
  """log p(tokens) (...,) float32 of tokens (...,) under logits (..., v):

    sampling  log_softmax(logits / temperature), before top-k and top-p: what TRL's
              GRPOTrainer computes for the policy (and vLLM's processed_logprobs
              without top-k / top-p), so the trainer's full forward can reproduce it;
    filtered  the distribution actually sampled, after top-k and top-p (0 for greedy:
              the argmax has all the mass);
    raw       log_softmax(logits), the model's own (vLLM's default raw_logprobs).

  temperature 0 (greedy) counts as 1 for `sampling`."""
  logits = logits.astype(jnp.float32)
  t = jnp.where(temperature > 0.0, temperature, 1.0)
  if of == "raw":
    scaled = logits
  elif of == "sampling":
    scaled = logits / t
  elif of == "filtered":
    flat = (logits / t).reshape(-1, logits.shape[-1])
    scaled = _filtered(flat, top_k, top_p).reshape(logits.shape)
  else:
    raise ValueError(f"logprob_of must be one of {LOGPROB_OF}, got {of!r}")
  picked = jnp.take_along_axis(scaled, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  lp = picked - jax.nn.logsumexp(scaled, axis=-1)
  return jnp.where(temperature > 0.0, lp, 0.0) if of == "filtered" else lp


# ----------------------------------------------------------------------------
# Stop strings, matched on the device.


def token_byte_table(token_bytes: Sequence[bytes]) -> np.ndarray:
  """(v, lt) int32: row i holds the bytes of token id i, then -1 (lt: the longest
  token). An empty entry (a special token, an id the tokenizer never emits) can
  never take part in a match."""
  width = max(1, max(len(b) for b in token_bytes))
  table = np.full((len(token_bytes), width), -1, np.int32)
  for i, b in enumerate(token_bytes):
    table[i, :len(b)] = np.frombuffer(b, np.uint8)
  return table


def stop_arrays(stop_strings, batch: int) -> tuple[np.ndarray, np.ndarray]:
  """Stop strings -> (b, s, m) int32 bytes (-1 after each string's end) and their
  lengths (b, s) (0: an unused slot). stop_strings is one list of byte strings for
  every row or one list per row; s and m are rounded up to powers of two so few
  programs serve all calls."""
  per_row = stop_strings if stop_strings and not isinstance(stop_strings[0], (bytes, str)) \
      else [stop_strings] * batch
  if len(per_row) != batch:
    raise ValueError(f"stop_strings holds {len(per_row)} lists for {batch} prompts; give one "
                     "list for all prompts or one per prompt")
  per_row = [[x.encode() if isinstance(x, str) else bytes(x) for x in row] for row in per_row]
  if any(not x for row in per_row for x in row):
    raise ValueError("an empty stop string would end every sequence at once; drop it")
  s = round_up_pow2(max(1, max(len(row) for row in per_row)))
  m = round_up_pow2(max([1] + [len(x) for row in per_row for x in row]))
  stops = np.full((batch, s, m), -1, np.int32)
  lengths = np.zeros((batch, s), np.int32)
  for r, row in enumerate(per_row):
    for j, x in enumerate(row):
      stops[r, j, :len(x)] = np.frombuffer(x, np.uint8)
      lengths[r, j] = len(x)
  return stops, lengths


def round_up_pow2(n: int, least: int = 1) -> int:
  """The smallest power of two >= n, and at least `least` (a power of two): padded
  shapes in few sizes, so few compiled programs serve all calls."""
  return max(least, 1 << (n - 1).bit_length())


def _push_bytes(window, token_bytes):
  """Append each row's token bytes (b, lt; -1 after the end) to its byte window
  (b, w), keeping the newest w bytes."""
  n = jnp.sum(token_bytes >= 0, axis=-1)
  both = jnp.concatenate([window, token_bytes], axis=-1)
  w = window.shape[-1]
  return jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (w,)))(both, n)


def _stop_hit(window, stops, lengths):
  """(b,) bool: the row's window (b, w) holds one of its stop strings (b, s, m),
  lengths (b, s). Bytes are >= 0 and the window's fill is -1, so only real bytes match."""
  b, w = window.shape
  m = stops.shape[-1]
  padded = jnp.concatenate([window, jnp.full((b, m), -1, window.dtype)], axis=-1)
  at = padded[:, np.arange(w)[:, None] + np.arange(m)[None, :]]  # (b, w, m): m bytes from each j
  same = at[:, None] == stops[:, :, None, :]  # (b, s, w, m)
  past_end = np.arange(m) >= lengths[:, :, None, None]
  found = jnp.all(same | past_end, axis=-1).any(axis=-1)  # (b, s)
  return jnp.any(found & (lengths > 0), axis=-1)


# ----------------------------------------------------------------------------
# The device program: prefill, then a while_loop of step + sample.


def decode_loop(model, logits, cache, key, temperature, top_k, top_p, eos_id, pad_id,
                 max_new_tokens, stop=None, *, buffer_len: int, logprob_of: str | None = None):
  """Sample up to max_new_tokens (traced, <= buffer_len) tokens starting from
  `logits`/`cache`. Returns the tokens (b, buffer_len) int32 (pad after a
  sequence's end and past the last step), how many steps ran, each sequence's
  length (b,) up to and including its EOS or the token that completed a stop
  string (the steps run if neither came), and with `logprob_of` (one of
  `LOGPROB_OF`, see `token_logprob`) each sampled token's log-probability
  (b, buffer_len) float32, 0 where the tokens are pad (else None). The loop stops
  early once every sequence has ended (eos_id -1: EOS never ends one).

  key: one key, or one per row (b,): a row's tokens then depend on its key alone.
  stop: None, or (token bytes (v, lt), stop strings (b, s, m), their lengths
  (b, s)) from `token_byte_table` and `stop_arrays`."""
  b = logits.shape[0]

  def pick(i, logits):
    k = jax.vmap(jax.random.fold_in, (0, None))(key, i) if key.ndim else jax.random.fold_in(key, i)
    tok = sample(k, logits, temperature, top_k, top_p)
    if logprob_of is None:
      return tok, None
    return tok, token_logprob(logits, tok, temperature, top_k, top_p, logprob_of)

  if stop is None:
    window, ended = None, lambda window, tok: (window, tok == eos_id)
  else:
    table, stops, lengths = stop
    # Enough bytes for a stop string that ends in the newest token's bytes.
    window = jnp.full((b, stops.shape[-1] + table.shape[-1]), -1, jnp.int32)

    def ended(window, tok):
      window = _push_bytes(window, table[tok])
      return window, (tok == eos_id) | _stop_hit(window, stops, lengths)

  tok, lp = pick(0, logits)
  window, done = ended(window, tok)
  out = jnp.full((b, buffer_len), pad_id, jnp.int32).at[:, 0].set(tok)
  lps = None if lp is None else jnp.zeros((b, buffer_len), jnp.float32).at[:, 0].set(lp)
  length = jnp.where(done, 1, 0).astype(jnp.int32)

  def cond(carry):
    i, _, _, _, _, _, done, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  # The weights every step reads, made once out here: matmul weights and the LM
  # head in the compute dtype, or quantized in the runtime's matmul_precision; per
  # layer (unstacked) when the layers run unrolled, see Mamba2LM.step_unrolled and
  # the runtime's decode_layers.
  unrolled = model.runtime.decode_layers != "scan"
  layers, head = model.decode_layers(unrolled), model.head_for_logits(decode=True)
  if unrolled:
    states = model.unstack_states(cache.states())
    step_fn = lambda tok, states: model.step_unrolled(tok, layers, states)
  else:
    states = cache.states()
    step_fn = lambda tok, states: model.step(tok, states, layers)

  def body(carry):
    i, tok, states, window, out, lps, done, length = carry
    h, states = step_fn(tok, states)
    nxt, lp = pick(i, model.logits(h, head))
    nxt = jnp.where(done, pad_id, nxt)
    out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
    if lps is not None:
      lps = jax.lax.dynamic_update_slice(lps, jnp.where(done, 0.0, lp)[:, None], (0, i))
    window, now = ended(window, nxt)
    length = jnp.where(now & ~done, i + 1, length)
    return i + 1, nxt, states, window, out, lps, done | now, length

  n, _, _, _, out, lps, done, length = jax.lax.while_loop(
      cond, body, (jnp.int32(1), tok, states, window, out, lps, done, length))
  return out, n, jnp.where(done, length, n), lps


@functools.partial(jax.jit, static_argnames=("graphdef", "buffer_len"))
def _generate_program(graphdef, params, input_ids, mask, key, temperature, top_k, top_p,
                      eos_id, pad_id, max_new_tokens, stop, *, buffer_len):
  model = nnx.merge(graphdef, params)
  # Room for the prompt and every new token in a hybrid's key/value buffers.
  logits, cache = prefill(model, input_ids, mask, capacity=input_ids.shape[1] + buffer_len)
  return decode_loop(model, logits, cache, key, temperature, top_k, top_p, eos_id, pad_id,
                     max_new_tokens, stop, buffer_len=buffer_len)[:3]


# ----------------------------------------------------------------------------
# Input checking and padding.


def _as_prompts(prompt_ids) -> tuple[list[np.ndarray], str]:
  """-> (list of 1-D int arrays, kind) where kind is '1d', '2d' or 'list'."""
  if isinstance(prompt_ids, (np.ndarray, jax.Array)):
    arr = np.asarray(prompt_ids)
    if arr.ndim not in (1, 2):
      raise ValueError(f"prompt_ids must be 1-D or 2-D (batch, length), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"prompt_ids must be integer token ids, got dtype {arr.dtype}")
    if arr.ndim == 1:
      return [arr], "1d"
    return list(arr), "2d"
  if isinstance(prompt_ids, Sequence) and not isinstance(prompt_ids, (str, bytes)):
    if all(isinstance(t, (int, np.integer)) for t in prompt_ids) and len(prompt_ids):
      return [np.asarray(prompt_ids)], "1d"
    prompts = []
    for i, p in enumerate(prompt_ids):
      if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray, jax.Array)):
        raise ValueError(f"prompt {i} is not a sequence of token ids: {p!r:.60}")
      a = np.asarray(p)
      if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"prompt {i} must be a 1-D sequence of integer token ids")
      prompts.append(a)
    return prompts, "list"
  raise ValueError(f"prompt_ids must be a list of token-id lists or an integer array, "
                   f"got {type(prompt_ids).__name__}")


def _check(prompts, vocab_size, max_new_tokens, temperature, top_k, top_p, eos_id, pad_id,
           max_prompt_len):
  if not prompts:
    raise ValueError("no prompts given: prompt_ids is empty")
  for i, p in enumerate(prompts):
    if p.size == 0:
      raise ValueError(f"prompt {i} is empty: give at least one token (for example a BOS id)")
    if p.size > max_prompt_len:
      raise ValueError(f"prompt {i} has {p.size} tokens, more than max_prompt_len="
                       f"{max_prompt_len}; shorten it or pass a larger max_prompt_len")
    lo, hi = int(p.min()), int(p.max())
    if lo < 0 or hi >= vocab_size:
      bad = lo if lo < 0 else hi
      raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  if not temperature >= 0.0:  # also rejects NaN
    raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"top_k must be an integer >= 0 (0 means off), got {top_k!r}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  for name, v in (("eos_id", eos_id), ("pad_id", pad_id)):
    if v is not None and not 0 <= v < vocab_size:
      raise ValueError(f"{name}={v} is outside the vocabulary [0, {vocab_size})")


def checked_prompts(prompt_ids, vocab_size, max_new_tokens, temperature, top_k, top_p, eos_id,
                    pad_id, max_prompt_len=MAX_PROMPT_LEN) -> tuple[list[np.ndarray], str]:
  """prompt_ids as a list of 1-D arrays and its kind ('1d', '2d' or 'list'), after
  checking it and the settings (ValueError: see `generate`)."""
  prompts, kind = _as_prompts(prompt_ids)
  _check(prompts, vocab_size, max_new_tokens, temperature, top_k, top_p, eos_id, pad_id,
         max_prompt_len)
  return prompts, kind


def padded_lengths(prompts: list[np.ndarray], max_new_tokens: int) -> tuple[int, int]:
  """(prompt length, output buffer length): the longest prompt and max_new_tokens
  rounded up to powers of two (at least 16); everything else is traced, so few
  programs serve all calls."""
  return (round_up_pow2(max(p.size for p in prompts), _MIN_LENGTH),
          round_up_pow2(int(max_new_tokens), _MIN_LENGTH))


def left_pad(prompts: list[np.ndarray], length: int, pad_id: int):
  """-> ids (b, length) int32 and mask (b, length) bool, prompts flush right."""
  ids = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for r, p in enumerate(prompts):
    ids[r, length - p.size:] = p
    mask[r, length - p.size:] = True
  return ids, mask


# ----------------------------------------------------------------------------
# The public entry points.


@dataclasses.dataclass
class GenerateStats:
  compile_s: float  # 0 when the program was already compiled
  run_s: float  # prefill and decode, excluding compile
  prompt_tokens: int  # real prompt tokens (no padding)
  new_tokens: int  # generated tokens over all sequences, up to and including EOS
  steps: int  # decode steps run (<= max_new_tokens)

  @property
  def tokens_per_s(self) -> float:
    return self.new_tokens / self.run_s if self.run_s > 0 else float("nan")


_COMPILED: dict = {}


def compiled(jitted, graphdef, args, **static):
  """(the program `jitted` compiled for graphdef, args (parameters first) and the static
  keywords, the seconds compiling took: 0 when an earlier call had compiled it). The
  active mesh and rules are part of the key: they decide the sharding constraints at
  trace time."""
  signature = (jitted, graphdef, sharding.active(), tuple(sorted(static.items())),
               jax.tree.structure(args),
               tuple((jnp.shape(a), a.dtype, getattr(a, "sharding", None)) for a in jax.tree.leaves(args)))
  if signature in _COMPILED:
    return _COMPILED[signature], 0.0
  with Timer() as t:
    _COMPILED[signature] = jitted.lower(graphdef, *args, **static).compile()
  return _COMPILED[signature], t.seconds


def stop_operands(stop_strings, token_bytes, vocab_size: int, batch: int):
  """decode_loop's `stop` for `batch` rows: (token bytes, stop strings, their lengths),
  or None without stop strings. Raises ValueError when token_bytes does not cover the
  vocabulary."""
  if not stop_strings:
    return None
  if token_bytes is None or token_bytes.ndim != 2 or token_bytes.shape[0] < vocab_size:
    raise ValueError("stop_strings needs token_bytes=token_byte_table(...) with a row for each "
                     f"of the model's {vocab_size} token ids, got "
                     f"{None if token_bytes is None else token_bytes.shape}")
  table = token_bytes if token_bytes.shape[0] == vocab_size else token_bytes[:vocab_size]
  return (table, *stop_arrays(stop_strings, batch))


def generate_with_stats(model: Mamba2LM, prompt_ids, max_new_tokens: int, *,
                        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        seed: int = 0, eos_id: int | None = None, pad_id: int | None = None,
                        max_prompt_len: int = MAX_PROMPT_LEN, stop_strings=None,
                        token_bytes=None):
  """`generate`, also returning a `GenerateStats` with compile and run time."""
  model = model.merged()  # a base plus LoRA adapters decodes as their merged weights
  cfg = model.config
  prompts, kind = checked_prompts(prompt_ids, cfg.vocab_size, max_new_tokens, temperature, top_k,
                                  top_p, eos_id, pad_id, max_prompt_len)
  stop = stop_operands(stop_strings, token_bytes, cfg.vocab_size, len(prompts))
  if pad_id is None:
    pad_id = eos_id if eos_id is not None else 0
  length, buffer_len = padded_lengths(prompts, max_new_tokens)
  ids, mask = left_pad(prompts, length, pad_id)
  graphdef, params = nnx.split(model)
  args = (params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed),
          jnp.float32(temperature), jnp.int32(min(int(top_k), 2**31 - 1)), jnp.float32(top_p),
          jnp.int32(-1 if eos_id is None else eos_id), jnp.int32(pad_id),
          jnp.int32(max_new_tokens), None if stop is None else tuple(map(jnp.asarray, stop)))
  program, compile_s = compiled(_generate_program, graphdef, args, buffer_len=buffer_len)
  with Timer() as t:
    out, n, lengths = program(*args)
    out, n, lengths = sharding.to_host(out), int(sharding.to_host(n)), sharding.to_host(lengths)
  run_s = t.seconds

  out = out[:, :n]  # like transformers: stop at the step where every sequence ended
  stats = GenerateStats(compile_s, run_s, sum(p.size for p in prompts), int(lengths.sum()), n)
  full = [np.concatenate([p.astype(np.int32), row]) for p, row in zip(prompts, out)]
  if kind == "1d":
    return full[0], stats
  if kind == "2d":
    return np.stack(full), stats
  return full, stats


def generate(model: Mamba2LM, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             pad_id: int | None = None, max_prompt_len: int = MAX_PROMPT_LEN, stop_strings=None,
             token_bytes=None):
  """Continue prompts by up to max_new_tokens tokens; returns each prompt followed
  by its new tokens, as transformers' `generate` does.

  prompt_ids: one prompt (1-D ints), a batch of equal-length prompts (2-D array),
    or a list of prompts of any lengths (at most max_prompt_len tokens each).
  temperature: 0 picks the most likely token (greedy); > 0 samples from
    softmax(logits / temperature), after top_k (0: off) and top_p (1: off).
  seed: the sampling key; the same seed gives the same tokens.
  eos_id: a sequence stops at this token, the loop when all have; later
    positions hold pad_id (default eos_id, else 0). The output is cut after the
    last step run, so it can be shorter than prompt + max_new_tokens.
  stop_strings: byte (or UTF-8 str) strings; a sequence also stops, on the device,
    at the token whose bytes complete one of them (one list for all prompts, or a
    list per prompt). The stop string stays in the output, as in transformers;
    cutting the text at it is the caller's. Needs token_bytes.
  token_bytes: `token_byte_table(...)` of the tokenizer's bytes per token id
    (`mamba_train.data.tokenizer.token_bytes`); numpy or already on the device.

  Returns: for a 1-D prompt a 1-D array; for a 2-D array a 2-D array
  (b, l + steps); for a list, a list of 1-D arrays (each its own prompt, no padding).
  Raises ValueError for an empty prompt, one longer than max_prompt_len, ids
  outside the vocabulary, max_new_tokens < 1, temperature < 0, top_k < 0 or
  top_p outside (0, 1], an empty stop string, or stop_strings without token_bytes.
  """
  out, _ = generate_with_stats(model, prompt_ids, max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id,
                               pad_id=pad_id, max_prompt_len=max_prompt_len,
                               stop_strings=stop_strings, token_bytes=token_bytes)
  return out
