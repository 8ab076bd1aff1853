"""The loss and the jitted train and eval steps, and `build`: everything a run
(or a benchmark, or an ahead-of-time compile) needs, from the run's plan.

Shapes: b batch (global, in sequences), l sequence length, k micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mamba_train.model.config import Mamba2Config
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.lora import LoraSpec
from mamba_train.model.runtime import Runtime
from mamba_train.parallel import sharding
from mamba_train.train import balance, dpo as dpo_lib, run_config
from mamba_train.train.dpo import DpoSpec
from mamba_train.train.loss import linear_cross_entropy
from mamba_train.train.optim import guard, guard_metrics, make_optimizer, param_norm
from mamba_train.train.state import (
  TrainState,
  abstract_train_state,
  init_train_state,
  state_shardings,
  weight_shardings,
)

F32 = jnp.float32
DPO_METRICS = dpo_lib.METRICS
ROUTER_METRICS = balance.METRICS + (balance.TOKENS_PER_EXPERT,)
BATCH_KEYS = ("input_ids", "targets", "seq_idx", "loss_mask")


def model_of(params, frozen, cfg: Mamba2Config, runtime: Runtime, lora: LoraSpec | None = None,
             dropout_key=None) -> Mamba2LM:
  """The model a state's (params, frozen) make: the params, or with LoRA the frozen
  base with the params as its adapters (their dropout on with a training step's key)."""
  if lora is None:
    return Mamba2LM.from_params(cfg, params, runtime)
  return Mamba2LM.from_params(cfg, frozen, runtime, adapters=params, lora=lora, dropout_key=dropout_key)


def loss_sums(params, batch: Mapping[str, jax.Array], cfg: Mamba2Config, runtime: Runtime,
              use_seq_idx: bool = True, frozen=None, lora: LoraSpec | None = None, dropout_key=None):
  """Cross entropy in float32, summed over unmasked tokens, and their count.

  Returning sums, not a mean, lets micro-batches add up to exactly the big batch.
  With use_seq_idx, no state passes between the documents packed in a row.
  """
  return _lm_sums(params, batch, cfg, runtime, use_seq_idx, frozen, lora, dropout_key=dropout_key)[:2]


def _lm_sums(params, batch, cfg, runtime, use_seq_idx=True, frozen=None, lora=None, moe=None, dropout_key=None):
  """`loss_sums` and the router sums of its MoE layers (`balance.sums`); with
  moe.aux_loss_coef the auxiliary loss (per token) is in the loss sum."""
  model = model_of(params, frozen, cfg, runtime, lora, dropout_key)
  h, states = model.backbone(batch["input_ids"], seq_idx=batch["seq_idx"] if use_seq_idx else None)
  mask = batch["loss_mask"].astype(F32)
  # LM head and cross entropy blockwise: no (b, l, vocab) logits (train/loss.py).
  total = linear_cross_entropy(*model.head_operands(h), batch["targets"], mask,
                               cfg.vocab_size, runtime.compute_dtype, batch_shards=_batch_shards())
  router = balance.sums(states, jnp.sum(mask), cfg)
  if router and moe is not None and moe.aux_loss_coef:
    total = total + moe.aux_loss_coef * router["moe_aux"]
  return total, jnp.sum(mask), router


def objective_sums(params, frozen, batch: Mapping[str, jax.Array], cfg: Mamba2Config, runtime: Runtime,
                   use_seq_idx: bool = True, lora: LoraSpec | None = None, dpo: DpoSpec | None = None,
                   moe: balance.MoeSpec | None = None, dropout_key=None):
  """(loss sum, count, {metric: sum}) of the run's objective: cross entropy over the
  unmasked tokens, or with `dpo` the DPO loss over the pairs (train/dpo.py), against
  the reference the state holds: the base with adapters off (LoRA), or `frozen`.
  An MoE model's router sums (`balance.sum_shapes`) are among the metric sums of
  the cross entropy objective. dropout_key: a training step's, for LoRA's dropout
  (the policy's alone)."""
  if dpo is None:
    return _lm_sums(params, batch, cfg, runtime, use_seq_idx, frozen, lora, moe, dropout_key)
  policy = model_of(params, frozen, cfg, runtime, lora, dropout_key)
  reference = (model_of(jax.tree.map(jnp.zeros_like, params), frozen, cfg, runtime, lora) if lora
               else Mamba2LM.from_params(cfg, frozen, runtime))
  return dpo_lib.dpo_sums(policy, reference, batch, dpo, batch_shards=_batch_shards())


def _batch_shards() -> int:
  """Devices the (b, l) tokens are split over under the active sharding rules (1 without)."""
  act = sharding.active()
  if act is None:
    return 1
  mesh, rules = act
  return math.prod(sharding.axes_size(mesh, axes)
                   for axes in sharding.logical_to_spec(("batch", "act_length"), rules))


def _split_micro(batch, k: int, mesh: Mesh, rules):
  """(b, l) -> (k, b/k, l). Row j*k + i goes to micro-batch i, so each
  micro-batch keeps the batch's split over devices and nothing moves."""
  spec = NamedSharding(mesh, sharding.logical_to_spec((None, "batch", "act_length"), rules))

  def split(x):
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, spec)

  return jax.tree.map(split, batch)


def make_train_step(cfg: Mamba2Config, runtime: Runtime, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, mesh: Mesh, *, grad_accum: int = 1,
                    rules=sharding.DEFAULT_RULES, use_seq_idx: bool = True,
                    lora: LoraSpec | None = None, dpo: DpoSpec | None = None,
                    moe: balance.MoeSpec | None = None) -> Callable:
  """`step(state, batch) -> (state, metrics)`: one jax.jit with explicit
  shardings; the incoming state is donated. With `lora` only the adapters
  (`state.params`) are differentiated and updated; the base (`state.frozen`) is read.
  With `dpo` the loss is DPO's over the batch's pairs (`objective_sums`), and the
  metrics add dpo.METRICS, each a mean over the pairs.

  With grad_accum = k the global batch is scanned as k micro-batches; loss and
  gradient sums are added up and divided by the total token count once, so the
  update equals the one from the whole batch at once.
  `optimizer` is any optax transformation (`optax.adamw(...)`, a chain, one made by
  `optim.make_optimizer`): the step runs it wrapped by `optim.guard`, which skips a step
  whose gradient is non-finite or whose weights jump; states made by train/state.py
  (`init_train_state`, `abstract_train_state`) hold it wrapped in the same way.

  Metrics (float32 scalars, replicated): loss, grad_norm, param_norm, update_norm, lr,
  tokens (unmasked), nonfinite_streak (steps in a row skipped), weight_jump (1: this
  step was skipped for a norm jump); with MoE layers (cross entropy) the router's
  (`balance.metrics`), and with moe.bias_update_rate the correction biases move
  after the update (`balance.update_bias`; not with LoRA, whose base is frozen).
  """
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(f"make_train_step needs an optax GradientTransformation (e.g. optax.adamw(1e-3), "
                    f"or optim.make_optimizer(config.optim, steps)[0]), got {type(optimizer).__name__}")
  optimizer = guard(optimizer)
  st_sh = state_shardings(cfg, optimizer, mesh, rules, lora=lora, frozen_copy=dpo is not None)
  b_sh = {k: sharding.batch_sharding(mesh, rules) for k in BATCH_KEYS}
  replicated = NamedSharding(mesh, P())
  extra = {k: () for k in dpo_lib.METRICS} if dpo is not None else balance.sum_shapes(cfg)

  def sums_and_grads(params, mb, frozen, key):
    def loss(p):
      total, count, sums = objective_sums(p, frozen, mb, cfg, runtime, use_seq_idx, lora, dpo, moe, key)
      return total, (count, sums)
    (loss_sum, (count, sums)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return loss_sum, count, sums, grads

  def step(state: TrainState, batch):
    with sharding.use_rules(mesh, rules):
      params = state.params
      # The step's key (from the state, so a resumed run draws what the uninterrupted
      # one drew): LoRA's dropout masks, one micro-batch apart from the next.
      rng, key = jax.random.split(state.rng)
      key = key if lora is not None and lora.dropout > 0.0 else None
      if grad_accum == 1:
        loss_sum, count, sums, grads = sums_and_grads(params, batch, state.frozen, key)
      else:
        def body(carry, xs):
          i, mb = xs
          mkey = None if key is None else jax.random.fold_in(key, i)
          loss_sum, count, sums, grads = sums_and_grads(params, mb, state.frozen, mkey)
          acc_loss, acc_count, acc_sums, acc_grads = carry
          acc_grads = jax.tree.map(jnp.add, acc_grads, grads)
          acc_grads = jax.lax.with_sharding_constraint(acc_grads, st_sh.params)
          return (acc_loss + loss_sum, acc_count + count, jax.tree.map(jnp.add, acc_sums, sums), acc_grads), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        start = (jnp.zeros((), F32), jnp.zeros((), F32), {k: jnp.zeros(s, F32) for k, s in extra.items()}, zeros)
        (loss_sum, count, sums, grads), _ = jax.lax.scan(
            body, start, (jnp.arange(grad_accum), _split_micro(batch, grad_accum, mesh, rules)))
      denom = jnp.maximum(count, 1.0)
      grads = jax.tree.map(lambda g: g / denom, grads)
      loss = loss_sum / denom
      updates, opt_state, squares = optimizer.update_with_squares(grads, state.opt_state, params)
      guarded = optax.apply_updates(params, updates)
      new_params = guarded
      router = {k: sums.pop(k) for k in balance.sum_shapes(cfg) if k in sums}
      if router and moe is not None and lora is None:
        new_params = balance.update_bias(new_params, router["moe_load"], moe.bias_update_rate)
      new_state = TrainState(step=state.step + 1, params=new_params, opt_state=opt_state, rng=rng,
                             frozen=state.frozen)
      metrics = {
          "loss": loss,
          "grad_norm": optax.tree.norm(grads),
          "param_norm": param_norm(new_params, guarded, squares),
          "lr": jnp.asarray(schedule(state.step), F32),
          "tokens": count,
          **guard_metrics(opt_state),
          **{k: v / denom for k, v in sums.items()},
          **(balance.metrics(router["moe_load"], router["moe_aux"] / denom, router["moe_dropped"]) if router else {}),
      }
      return new_state, metrics

  return jax.jit(step, in_shardings=(st_sh, b_sh), out_shardings=(st_sh, replicated),
                 donate_argnums=(0,))


def make_eval_step(cfg: Mamba2Config, runtime: Runtime, mesh: Mesh, rules=sharding.DEFAULT_RULES,
                   use_seq_idx: bool = True, lora: LoraSpec | None = None,
                   dpo: DpoSpec | None = None) -> Callable:
  """`eval_step(params, batch, frozen) -> (loss_sum, count)` of the objective (tokens,
  or DPO's pairs), jitted with the state's shardings (frozen: the LoRA base or DPO's
  reference, None without)."""
  p_sh, f_sh = weight_shardings(cfg, mesh, rules, lora, frozen_copy=dpo is not None)
  b_sh = {k: sharding.batch_sharding(mesh, rules) for k in BATCH_KEYS}

  def step(params, batch, frozen):
    with sharding.use_rules(mesh, rules):
      return objective_sums(params, frozen, batch, cfg, runtime, use_seq_idx, lora, dpo)[:2]

  return jax.jit(step, in_shardings=(p_sh, b_sh, f_sh), out_shardings=NamedSharding(mesh, P()))


def evaluate(eval_step: Callable, params, batches: Iterable[Mapping[str, jax.Array]],
             frozen=None) -> dict[str, float]:
  """Mean loss over all unmasked tokens of `batches`, its perplexity, and the token count."""
  total, count = 0.0, 0.0
  for batch in batches:
    s, n = eval_step(params, batch, frozen)
    total, count = total + float(s), count + float(n)
  return _eval_row(total, count)


def _eval_row(total: float, count: float) -> dict[str, float]:
  loss = total / max(count, 1.0)
  return {"eval_loss": loss, "eval_ppl": float(np.exp(min(loss, 80.0))), "eval_tokens": count}


def pool_eval(rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
  """One `evaluate` row over the tokens of several (each source of a mixture)."""
  rows = list(rows)
  return _eval_row(sum(r["eval_loss"] * r["eval_tokens"] for r in rows),
                   sum(r["eval_tokens"] for r in rows))


def abstract_batch(batch_size: int, seq_len: int, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """A global batch's shapes, dtypes and shardings, for compiling without data."""
  dtypes = {"loss_mask": jnp.float32}
  sh = sharding.batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct((batch_size, seq_len), dtypes.get(k, jnp.int32), sharding=sh)
          for k in BATCH_KEYS}


def to_global(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """This process's rows of the batch's model inputs -> global arrays split over data x fsdp."""
  return sharding.to_global({k: batch[k] for k in BATCH_KEYS}, mesh)


# ----------------------------------------------------------------------------
# Everything a run (or a benchmark) needs, built from the run's plan.


@dataclasses.dataclass
class Built:
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  state: TrainState  # concrete, or abstract (shapes and shardings) with init=False
  train_step: Callable  # jitted (state, batch) -> (state, metrics); state donated
  eval_step: Callable  # jitted (params, batch) -> (loss_sum, count)


def build(plan: run_config.Plan, mesh: Mesh, *, params=None, init: bool = True) -> Built:
  """Optimizer, the initial sharded TrainState and the jitted steps of `plan`'s
  model, run by its runtime.

  `plan` is `run_config.validate`'s, made for the platform of the mesh's devices,
  so a mesh of TPU topology devices on a CPU host compiles what the TPU would run.
  `params` (e.g. loaded for finetuning) replace the random init; `init=False`
  builds the state's shapes and shardings only (for an ahead-of-time compile). To
  time the step: `b = build(plan, mesh)`, then `b.train_step.lower(b.state,
  batch).compile()` with a batch from `to_global`.
  """
  platform = mesh.devices.flat[0].platform
  if platform != plan.platform:
    raise ValueError(f"the plan's runtime is resolved for {plan.platform!r} devices, but the "
                     f"mesh's are {platform!r}: validate the run config for the mesh's platform")
  config, model_cfg, runtime, lora, dpo = plan.config, plan.model, plan.runtime, plan.lora, plan.dpo
  lr = plan.lr if plan.lr is not None else float(config.optim.lr)  # with adapters: lora.lr
  optimizer, schedule = make_optimizer({**config.optim, "lr": lr}, config.steps)
  copy = dpo is not None  # DPO's reference: the initial weights, frozen (with LoRA: the base)
  rules = plan.rules  # config.layout's table: where the weights, gradients and moments lie
  if init:
    state = init_train_state(model_cfg, optimizer, mesh, config.seed, params=params, lora=lora,
                             frozen_copy=copy, rules=rules)
  else:
    state = abstract_train_state(model_cfg, optimizer, mesh, rules, lora=lora, frozen_copy=copy)
  docs = bool(config.data.use_seq_idx)
  train_step = make_train_step(model_cfg, runtime, optimizer, schedule, mesh, rules=rules,
                               grad_accum=config.optim.grad_accum, use_seq_idx=docs, lora=lora, dpo=dpo,
                               moe=plan.moe)
  return Built(optimizer, schedule, state, train_step,
               make_eval_step(model_cfg, runtime, mesh, rules, use_seq_idx=docs, lora=lora, dpo=dpo))
