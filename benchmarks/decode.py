"""Greedy decoding speed at a few context lengths, three ways, and how much of
the device's bandwidth it uses.

  * device loop: the whole loop of --new_tokens steps as one while_loop program
    (`mamba_train.generate.decode_loop`, what `generate` runs after its
    prefill), from a prefilled cache;
  * host loop: a Python loop calling a jitted one-token `step`, reading each
    token back to the host as a real loop must (to check for EOS);
  * recompute: no cache, a full forward pass over the whole prefix per token.

The three differ in what runs where, not in what they compute, which is why
they are timed side by side: a decode step reads every weight once, so its
speed is a bandwidth figure (bytes a step must move, times tokens/s, over the
measured copy and matvec rates). The programs are the benchmark's own, built on
the library's prefill, step and decode loop.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import peers, roofline
from benchmarks.common import add_rows, compile_fn, log, median_time, model_cfg, runtime
from mamba_train.generate import decode_loop, prefill, step
from mamba_train.metrics import Timer
from mamba_train.model.mamba2 import Mamba2LM


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"))
def _prefill_program(graphdef, params, input_ids, *, capacity):
  # capacity: a hybrid's key/value buffers hold the prompt and the new tokens.
  return prefill(nnx.merge(graphdef, params), input_ids, capacity=capacity)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _loop_program(graphdef, params, logits, cache, *, max_new_tokens):
  """The decode loop alone (greedy, no EOS), from a prefilled cache."""
  return decode_loop(nnx.merge(graphdef, params), logits, cache, jax.random.key(0),
                     jnp.float32(0), jnp.int32(0), jnp.float32(1), jnp.int32(-1), jnp.int32(0),
                     jnp.int32(max_new_tokens), buffer_len=max_new_tokens)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(3,))
def _greedy_step_program(graphdef, params, token, cache):
  logits, cache = step(nnx.merge(graphdef, params), token, cache)
  return jnp.argmax(logits, -1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _recompute_program(graphdef, params, buffer, pos):
  """Greedy next token from a full forward pass over the whole buffer (b, L);
  the token after position `pos` (causal, so positions past it do not matter)."""
  logits = nnx.merge(graphdef, params)(buffer)
  return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, pos, 1, keepdims=False), -1)


def _timed(fn, *args):
  """(fn(*args) blocked on, wall seconds)."""
  with Timer() as t:
    out = jax.block_until_ready(fn(*args))
  return out, t.seconds


def decode_benchmark(model: Mamba2LM, prompt_lens: Sequence[int], *, batch: int = 1,
                     new_tokens: int = 32, host_tokens: int | None = None, recompute_tokens: int = 3,
                     repeats: int = 3, seed: int = 0) -> list[dict]:
  """Greedy decode throughput of `model` at each prompt length, the three ways
  of the module docstring.

  Times exclude compilation (each program is compiled and run once first); the
  device and host loops report the best of `repeats` runs (this is for noisy
  shared machines; recompute, the slow one, runs once). Returns one dict per
  length: tokens/s for each way (batch * tokens / s), the prefill time, the
  loop's compile time (0 after the first length: its shapes do not depend on
  the length), and whether the host loop produced the device loop's tokens.
  """
  graphdef, params = nnx.split(model)
  cfg = model.config
  host_tokens = host_tokens or new_tokens
  rng = np.random.default_rng(seed)
  rows = []
  loops = {}
  for l in prompt_lens:
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, l)), jnp.int32)
    row = {"prompt_len": l, "batch": batch}
    capacity = l + max(new_tokens, host_tokens)

    pre, _ = compile_fn(_prefill_program, graphdef, params, ids, capacity=capacity)
    _timed(pre, params, ids)
    (logits, cache), row["prefill_s"] = _timed(pre, params, ids)
    row["cache_bytes"] = cache.nbytes  # a hybrid's grows with the capacity

    # Device loop: the loop program alone (one per cache shape: a pure model's
    # does not depend on the length, a hybrid's key/value buffers do).
    row["loop_compile_s"] = 0.0
    shapes = tuple(a.shape for a in jax.tree.leaves(cache))
    if shapes not in loops:
      loops[shapes], info = compile_fn(_loop_program, graphdef, params, logits, cache,
                                       max_new_tokens=new_tokens)
      row["loop_compile_s"] = info["compile_s"]
    loop = loops[shapes]
    _timed(loop, params, logits, cache)
    t = []
    for _ in range(repeats):
      (dev_tokens, _), sec = _timed(loop, params, logits, cache)
      t.append(sec)
    row["device_tok_s"] = batch * (new_tokens - 1) / min(t)  # the first token is from prefill

    # Host loop: one jitted step per token, the token read back each time.
    fresh = lambda: jax.tree.map(jnp.copy, cache)  # the step donates its cache
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    _greedy_step_program(graphdef, params, first, fresh())  # compile and warm
    t = []
    for _ in range(repeats):
      tok, c = first, fresh()
      host = [np.asarray(tok)]
      with Timer() as timer:
        for _ in range(host_tokens - 1):
          tok, c = _greedy_step_program(graphdef, params, tok, c)
          host.append(np.asarray(tok))  # the per-token host round trip
      t.append(timer.seconds)
    row["host_tok_s"] = batch * (host_tokens - 1) / min(t)
    n_cmp = min(host_tokens, new_tokens)
    row["host_matches_device"] = bool(np.array_equal(np.stack(host, 1)[:, :n_cmp],
                                                     np.asarray(dev_tokens)[:, :n_cmp]))

    # Recompute: a fixed buffer of l + recompute_tokens positions, one full pass per token.
    buf = jnp.concatenate([ids, jnp.zeros((batch, recompute_tokens), jnp.int32)], 1)
    rec, _ = compile_fn(_recompute_program, graphdef, params, buf, jnp.int32(l - 1))
    _timed(rec, params, buf, jnp.int32(l - 1))
    with Timer() as timer:
      for i in range(recompute_tokens):
        nxt = rec(params, buf, jnp.int32(l - 1 + i))
        buf = buf.at[:, l + i].set(nxt)
        np.asarray(nxt)
    row["recompute_tok_s"] = batch * recompute_tokens / timer.seconds
    rows.append(row)
  return rows


def bench_decode(args, results, size, contexts, batch):
  rf = roofline.measure(args, results)
  compared = peers.available(args)
  cfg, rt = model_cfg(args, size), runtime(args)
  per_tok = lambda ctx: roofline.decode_bytes_per_step(cfg, batch, ctx + new) / batch
  new = args.new_tokens
  rows = []

  def add(impl, ctx, tps, extra=None):
    row = {"bench": "decode", "impl": impl, "config": size, "batch": batch, "seq_len": ctx,
           "dtype": args.dtype, "tokens_per_s": tps,
           "bw_util": roofline.bandwidth_utilisation(tps, per_tok(ctx), rf["copy_bytes_per_s"]),
           "matvec_util": roofline.bandwidth_utilisation(tps, per_tok(ctx), rf["matvec_bytes_per_s"]),
           **(extra or {})}
    rows.append(row)
    log(f"  decode {size} b{batch} ctx {ctx} {impl:16s}: {tps:9.1f} tok/s  bandwidth {100 * row['bw_util']:.0f}%"
        f" of copy, {100 * row['matvec_util']:.0f}% of matvec")

  model = Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)
  got = decode_benchmark(model, prompt_lens=contexts, batch=batch, new_tokens=new,
                         host_tokens=min(new, 16), recompute_tokens=2, repeats=max(3, args.repeats // 2))
  del model
  for r in got:
    if not r["host_matches_device"]:
      log(f"  warning: ctx {r['prompt_len']}: the host loop's tokens differ from the device loop's")
    add("ours (device loop)", r["prompt_len"], r["device_tok_s"],
        {"compile_s": r["loop_compile_s"], "prefill_s": r["prefill_s"], "cache_bytes": r["cache_bytes"]})
    log(f"  decode {size} ctx {r['prompt_len']}: cache {r['cache_bytes'] / 2**20:.2f} MiB")
    add("ours (host loop)", r["prompt_len"], r["host_tok_s"])
    add("ours (recompute)", r["prompt_len"], r["recompute_tok_s"])
  n_peer = max(4, min(new, 16))
  chunk = rt.ssd_plan(cfg.chunk_size)[1]
  if "torch" in compared:
    import torch
    model = peers.torch_model(cfg, chunk, args.dtype).eval()
    for ctx in contexts:
      ids = torch.randint(0, cfg.vocab_size, (batch, ctx))
      gen = lambda k: model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                     use_cache=True, pad_token_id=0)
      with torch.no_grad():
        t1 = peers.torch_time(lambda: gen(1), 2)
        tk = peers.torch_time(lambda: gen(n_peer), 2)
      add("torch (cached)", ctx, batch * (n_peer - 1) / max(tk - t1, 1e-9))
    del model
  if "mamba2-jax" in compared:
    import mamba2_jax
    mcfg, m = peers.m2jax_model(cfg, chunk)
    gd, ps = nnx.split(m)

    @jax.jit
    def mstep(ps, ids, cache):
      out = nnx.merge(gd, ps)(ids, cache=cache)
      return jnp.argmax(out["logits"][:, -1], -1).astype(jnp.int32), out["cache"]
    for ctx in contexts:
      ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, ctx)), jnp.int32)
      tok, cache = mstep(ps, ids, mamba2_jax.create_empty_cache(mcfg, batch))
      mstep(ps, tok[:, None], cache)  # compile the one-token shape

      def loop():
        t, c = tok, cache
        for _ in range(n_peer - 1):
          t, c = mstep(ps, t[:, None], c)
          np.asarray(t)
        return t
      add("mamba2-jax (cached)", ctx, batch * (n_peer - 1) / median_time(loop, 2))
  return add_rows(results, rows)
