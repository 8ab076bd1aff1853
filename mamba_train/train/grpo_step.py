"""GRPO's device programs: the policy's (and reference's) log-probabilities of a rollout's
completions, and the optimizer step on a rollout batch (train/grpo.py's loss), and `build`:
the state and both programs from a run's plan.

A rollout batch (`BATCH_KEYS`) holds n = prompts x G rows: the left-padded prompts and
their mask (n, lp), the completions and their mask (n, t) (True up to and including EOS
or the stop string), the sampler's log-probability of each sampled token (n, t), the
advantages (n,), and, when the loop computed them, the rollout policy's log-probabilities
(`old_logps`, num_iterations > 1) and the reference's (`ref_logps`, beta > 0).

The trainer's log-probabilities are rollout.sequence_logprobs's: one forward pass over
prompt and completion, at the sampler's temperature (TRL divides the logits by it too).
The reference is the policy the run started from: with LoRA the base with its adapters
off (their B at zero), else a frozen copy of the initial weights (`TrainState.frozen`),
held only when beta > 0.

Shapes: n completions (rows), lp prompt length, t completion length.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mamba_train.model.config import Mamba2Config
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.lora import LoraSpec
from mamba_train.model.runtime import Runtime
from mamba_train.parallel import sharding
from mamba_train.train import grpo as grpo_lib, run_config
from mamba_train.train.grpo import GrpoSpec
from mamba_train.train.optim import guard, guard_metrics, make_optimizer, param_norm
from mamba_train.train.state import TrainState, init_train_state, state_shardings, weight_shardings
from mamba_train.train.step import model_of

F32 = jnp.float32
TOKEN_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logps")
# The sampler-trainer gap, logged whatever the importance-sampling mode.
GAP_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")


def _logprobs(model: Mamba2LM, batch, temperature: float):
  from mamba_train import rollout  # the sampler's module: the trainer scores as it samples
  return rollout.sequence_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                   batch["completion_ids"], temperature)


def _reference(params, frozen, cfg, runtime, lora):
  if lora is not None:  # the base: adapters off
    return model_of(jax.tree.map(jnp.zeros_like, params), frozen, cfg, runtime, lora)
  return Mamba2LM.from_params(cfg, frozen, runtime)


def batch_shardings(mesh: Mesh, keys, rules=sharding.DEFAULT_RULES) -> dict:
  """The rollout batch split over the data-parallel devices by rows (positions whole)."""
  rows = sharding.logical_to_spec(("batch",), rules)
  two = NamedSharding(mesh, P(*rows, None))
  return {k: NamedSharding(mesh, rows) if k == "advantages" else two for k in keys}


def make_logps(cfg: Mamba2Config, runtime: Runtime, mesh: Mesh, spec: GrpoSpec, temperature: float, *,
               lora: LoraSpec | None = None, old: bool, rules=sharding.DEFAULT_RULES) -> Callable:
  """`logps(params, frozen, batch) -> {"old_logps"?, "ref_logps"?}` (n, t) float32: the rollout
  policy's (`old`), and the reference's when spec.beta > 0. One jit."""
  frozen_copy = spec.beta > 0 and lora is None
  p_sh, f_sh = weight_shardings(cfg, mesh, rules, lora, frozen_copy=frozen_copy)
  b_sh = batch_shardings(mesh, TOKEN_KEYS, rules)
  out_sh = batch_shardings(mesh, ("old_logps", "ref_logps"), rules)

  def logps(params, frozen, batch):
    with sharding.use_rules(mesh, rules):
      out = {}
      if old:
        out["old_logps"] = _logprobs(model_of(params, frozen, cfg, runtime, lora), batch, temperature)
      if spec.beta > 0:
        out["ref_logps"] = _logprobs(_reference(params, frozen, cfg, runtime, lora), batch, temperature)
      return out

  jitted = jax.jit(logps, in_shardings=(p_sh, f_sh, b_sh),
                   out_shardings={k: out_sh[k] for k in (("old_logps",) if old else ()) + (
                       ("ref_logps",) if spec.beta > 0 else ())})
  return lambda params, frozen, batch: jitted(params, frozen, {k: batch[k] for k in TOKEN_KEYS})


def make_grpo_step(cfg: Mamba2Config, runtime: Runtime, optimizer: optax.GradientTransformation,
                   schedule: optax.Schedule, mesh: Mesh, spec: GrpoSpec, temperature: float, *,
                   lora: LoraSpec | None = None, old: bool, rules=sharding.DEFAULT_RULES) -> Callable:
  """`step(state, batch) -> (state, metrics)`: one optimizer step of the clipped objective on a
  rollout batch (`old`: it holds old_logps; else the rollout policy is the current one, as
  with num_iterations = 1, and the ratio is 1). One jit; the state is donated.

  Metrics (float32 scalars): loss, grad_norm, param_norm, update_norm, lr, tokens (completion
  tokens), the guard's (train/optim.py), and grpo_loss's: the clip ratios, kl (beta > 0),
  the sampler-trainer gap and importance weights."""
  optimizer = guard(optimizer)
  st_sh = state_shardings(cfg, optimizer, mesh, rules, lora=lora, frozen_copy=spec.beta > 0)
  keys = TOKEN_KEYS + ("advantages",) + (("old_logps",) if old else ()) + (("ref_logps",) if spec.beta > 0 else ())
  b_sh = batch_shardings(mesh, keys, rules)
  replicated = NamedSharding(mesh, P())

  def step(state: TrainState, batch):
    with sharding.use_rules(mesh, rules):
      rng, key = jax.random.split(state.rng)  # LoRA's dropout, as step.py draws it
      key = key if lora is not None and lora.dropout > 0.0 else None
      mask = batch["completion_mask"].astype(F32)

      def loss_fn(params):
        logps = _logprobs(model_of(params, state.frozen, cfg, runtime, lora, key), batch, temperature)
        loss, metrics = grpo_lib.grpo_loss(
            logps, batch["advantages"], mask, spec, old_logps=batch.get("old_logps"),
            sampler_logps=batch["sampler_logps"], ref_logps=batch.get("ref_logps"))
        if spec.sampler_is == "off":  # the gap is logged all the same
          _, gap = grpo_lib.sampler_weights(batch.get("old_logps", logps), batch["sampler_logps"], mask, spec)
          metrics |= {k: gap[k] for k in GAP_METRICS}
        return loss, metrics

      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
      updates, opt_state, squares = optimizer.update_with_squares(grads, state.opt_state, state.params)
      new_params = optax.apply_updates(state.params, updates)
      new_state = TrainState(step=state.step + 1, params=new_params, opt_state=opt_state, rng=rng,
                             frozen=state.frozen)
      return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads),
                         "param_norm": param_norm(new_params, new_params, squares),
                         "lr": jnp.asarray(schedule(state.step), F32), "tokens": jnp.sum(mask),
                         **guard_metrics(opt_state), **metrics}

  return jax.jit(step, in_shardings=(st_sh, b_sh), out_shardings=(st_sh, replicated), donate_argnums=(0,))


@dataclasses.dataclass
class Built:
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  state: TrainState
  train_step: Callable  # jitted (state, batch) -> (state, metrics); state donated
  logps: Callable  # jitted (params, frozen, batch) -> {"old_logps"?, "ref_logps"?}
  needs_logps: bool  # whether a step calls `logps` before its optimizer steps


def build(plan: run_config.Plan, mesh: Mesh, *, params=None) -> Built:
  """The optimizer (its schedule over steps x num_iterations optimizer steps, at plan.lr), the
  initial state (a frozen copy of the weights when beta > 0 without LoRA) and the programs."""
  config, g = plan.config, plan.grpo
  lr = plan.lr if plan.lr is not None else float(config.optim.lr)
  optimizer, schedule = make_optimizer({**config.optim, "lr": lr}, config.steps * g.num_iterations)
  state = init_train_state(plan.model, optimizer, mesh, config.seed, params=params, lora=plan.lora,
                           frozen_copy=g.spec.beta > 0, rules=plan.rules)
  old = g.num_iterations > 1
  args = (plan.model, plan.runtime)
  return Built(optimizer, schedule, state,
               make_grpo_step(*args, optimizer, schedule, mesh, g.spec, g.temperature, lora=plan.lora, old=old,
                              rules=plan.rules),
               make_logps(*args, mesh, g.spec, g.temperature, lora=plan.lora, old=old, rules=plan.rules),
               needs_logps=old or g.spec.beta > 0)
