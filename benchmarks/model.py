"""The whole model: forward (prefill, logits) and the train step (forward,
backward, AdamW), tokens/s and MFU against this run's measured matmul rate.

Ours is what a run executes: the forward of `Mamba2LM` with the runtime the
flags give, and the train step `mamba_train.train.step.build` makes from the run
config. The peers run the same shapes with their own AdamW (same betas, weight
decay and clipping).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import peers, roofline
from benchmarks.common import (
  add_rows,
  compile_fn,
  log,
  median_time,
  model_cfg,
  one_device_mesh,
  random_batch,
  run_plan,
  runtime,
)
from mamba_train import metrics
from mamba_train.model.lm import Mamba2LM
from mamba_train.parallel.sharding import batch_sharding
from mamba_train.train.step import build


def speed_row(kind, impl, size, batch, l, chunk, dtype, sec, flops_per_token, rf, info=None):
  """One forward/train table row (tokens/s and MFU against this run's roofline), logged."""
  tps = batch * l / sec
  row = {"bench": kind, "impl": impl, "config": size, "batch": batch, "seq_len": l,
         "chunk": chunk, "dtype": dtype, "tokens_per_s": tps,
         "mfu": metrics.mfu(tps, flops_per_token, rf["matmul_flops"]), **(info or {})}
  log(f"  {kind} {size} {batch}x{l} {impl:10s}: {tps:9.0f} tok/s  MFU {100 * row['mfu']:.0f}%"
      + (f"  compile {info['compile_s']:.1f}s" if info else ""))
  return row


def bench_forward(args, results, size, lengths, batch):
  rf = roofline.measure(args, results)
  compared = peers.available(args)
  rt = runtime(args)
  rows = []
  for l in lengths:
    cfg = model_cfg(args, size)
    chunk = rt.ssd_plan(cfg.chunk_size)[1]
    ids_np = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, l)).astype(np.int32)
    ids = jnp.asarray(ids_np)
    fl = metrics.forward_flops_per_token(cfg, rt, l)

    def add(impl, sec, info=None):
      rows.append(speed_row("forward", impl, size, batch, l, chunk, args.dtype, sec, fl, rf, info))

    graphdef, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt))
    fwd = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))
    compiled, info = compile_fn(fwd, params, ids)
    # partial, not a lambda: the del below must not leave a closure over deleted names.
    add("ours", median_time(functools.partial(compiled, params, ids), args.repeats), info)
    del params, compiled
    if "torch" in compared:
      import torch
      model = peers.torch_model(cfg, chunk, args.dtype).eval()
      tids = torch.tensor(ids_np, dtype=torch.long)
      with torch.no_grad():
        add("torch", peers.torch_time(lambda: model(tids).logits, args.repeats))
      del model
    if "mamba2-jax" in compared:
      _, m = peers.m2jax_model(cfg, chunk)
      gd, ps = nnx.split(m)
      fwd = jax.jit(lambda ps, ids: nnx.merge(gd, ps)(ids)["logits"])
      compiled, info = compile_fn(fwd, ps, ids)
      add("mamba2-jax", median_time(lambda: compiled(ps, ids), args.repeats), info)
      del ps, compiled
  return add_rows(results, rows)


def bench_train(args, results, size, lengths, batch):
  rf = roofline.measure(args, results)
  compared = peers.available(args)
  rows = []
  mesh = one_device_mesh()
  for l in lengths:
    plan = run_plan(args, size, batch, l)
    built = build(plan, mesh)
    cfg = plan.model
    chunk = plan.runtime.ssd_plan(cfg.chunk_size)[1]
    fl = metrics.train_flops_per_token(cfg, plan.runtime, l)
    data = jax.device_put(random_batch(cfg, batch, l), batch_sharding(mesh))

    def add(impl, sec, info=None):
      rows.append(speed_row("train", impl, size, batch, l, chunk, args.dtype, sec, fl, rf, info))

    compiled, info = compile_fn(built.train_step, built.state, data)
    box = {"state": built.state}

    def step():
      box["state"], m = compiled(box["state"], data)
      return m["loss"]
    add("ours", median_time(step, args.repeats), info)
    del box, built, compiled
    if "torch" in compared:
      import torch
      model = peers.torch_model(cfg, chunk, args.dtype).train()
      opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
      tids = torch.tensor(np.asarray(data["input_ids"]), dtype=torch.long)

      def tstep():
        loss = model(tids, labels=tids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
      add("torch", peers.torch_time(tstep, args.repeats))
      del model, opt
    if "mamba2-jax" in compared:
      import optax
      _, m = peers.m2jax_model(cfg, chunk)
      gd, ps = nnx.split(m)
      tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1))
      opt_state = tx.init(ps)
      ids = data["input_ids"]

      def mstep(ps, opt_state, ids):
        loss, g = jax.value_and_grad(lambda ps: nnx.merge(gd, ps)(ids, labels=ids)["loss"])(ps)
        upd, opt_state = tx.update(g, opt_state, ps)
        return optax.apply_updates(ps, upd), opt_state, loss
      compiled, info = compile_fn(jax.jit(mstep, donate_argnums=(0, 1)), ps, opt_state, ids)
      box = {"s": (ps, opt_state)}

      def mrun():
        p_, o_, loss = compiled(*box["s"], ids)
        box["s"] = (p_, o_)
        return loss
      add("mamba2-jax", median_time(mrun, args.repeats), info)
      del box, compiled
  return add_rows(results, rows)
