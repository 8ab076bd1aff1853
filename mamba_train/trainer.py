"""The pieces of training: the train state, its shardings, the loss, the jitted
train and eval steps, and the hooks that periodic work hangs on.

The train state is one pytree, `TrainState(step, params, opt_state, rng)`, with
`params` the plain nested dict of `Mamba2LM.params()`. Its shardings come from
the parameters' logical axes and the rules table in `sharding.py`; the
optimizer state mirrors the parameters' shardings, so FSDP shards both.

Shapes: b batch (global, in sequences), l sequence length, k micro-batches.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mamba_train import data, sharding
from mamba_train.config import Mamba2Config
from mamba_train.model import Mamba2LM
from mamba_train.optim import make_optimizer, nonfinite_streak
from mamba_train.run_config import model_config

F32 = jnp.float32
BATCH_KEYS = ("input_ids", "targets", "seq_idx", "loss_mask")


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: train steps taken (skipped non-finite steps included)
  params: Any  # Mamba2LM.params(): {"embedding", "norm_f", "layers": {...}[, "lm_head"]}
  opt_state: Any
  rng: jax.Array  # uint32[2], split once per step, for anything stochastic


# ----------------------------------------------------------------------------
# Shardings.


def param_logical_axes(cfg: Mamba2Config) -> dict[str, Any]:
  """The logical axes of every parameter, as a tree shaped like `Mamba2LM.params()`."""
  model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
  by_path = {tuple(str(k) for k in path): var.logical_axes
             for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}
  return jax.tree_util.tree_map_with_path(
      lambda path, _: by_path[tuple(str(getattr(k, "key", k)) for k in path)], jax.eval_shape(model.params))


def _fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """Drop mesh axes from dimensions they do not divide (those stay replicated)."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    if size > 1 and dim % size:
      logging.warning("dimension %d does not divide over mesh axes %s (%d); replicating it",
                      dim, names, size)
      axes = None
    out.append(axes)
  return P(*out)


def param_shardings(cfg: Mamba2Config, mesh: Mesh, rules=sharding.DEFAULT_RULES):
  """NamedShardings for `Mamba2LM.params()`, from the logical axes by `rules`."""
  return jax.tree.map(
      lambda s, a: NamedSharding(mesh, _fit_spec(sharding.logical_to_spec(a, rules), s.shape, mesh)),
      _param_shapes(cfg), param_logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sequences split over data x fsdp; positions whole."""
  return NamedSharding(mesh, P(("data", "fsdp"), None))


def state_shardings(cfg: Mamba2Config, optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules=sharding.DEFAULT_RULES) -> TrainState:
  """Shardings of the whole TrainState: the optimizer's per-parameter state
  follows the parameters; its counters and the rest are replicated."""
  p_sh = param_shardings(cfg, mesh, rules)
  replicated = NamedSharding(mesh, P())
  abstract_opt = jax.eval_shape(optimizer.init, _param_shapes(cfg))
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, p_sh,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))
  return TrainState(step=replicated, params=p_sh, opt_state=opt_sh, rng=replicated)


def _param_shapes(cfg: Mamba2Config):
  """ShapeDtypeStructs of `Mamba2LM.params()`, without creating any array."""
  model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
  return jax.eval_shape(model.params)


def init_train_state(cfg: Mamba2Config, optimizer: optax.GradientTransformation, mesh: Mesh,
                     seed: int, params=None) -> TrainState:
  """A fresh TrainState, created directly in its shardings (no full copy on one device).

  `params`, if given (e.g. loaded for finetuning), replace the random init.
  """
  shardings = state_shardings(cfg, optimizer, mesh)

  def make(key, params):
    init_key, rng = jax.random.split(key)
    if params is None:
      params = Mamba2LM(cfg, rngs=nnx.Rngs(params=init_key)).params()
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), rng=rng)

  key = jax.random.PRNGKey(seed)
  if params is not None:
    params = jax.device_put(params, shardings.params)
  with sharding.use_rules(mesh):
    return jax.jit(make, out_shardings=shardings)(key, params)


# ----------------------------------------------------------------------------
# Loss and steps.


def loss_sums(params, batch: Mapping[str, jax.Array], cfg: Mamba2Config, use_seq_idx: bool = True):
  """Cross entropy in float32, summed over unmasked tokens, and their count.

  Returning sums, not a mean, lets micro-batches add up to exactly the big batch.
  With use_seq_idx, no state passes between the documents packed in a row.
  """
  model = Mamba2LM.from_params(cfg, params)
  h, _ = model.backbone(batch["input_ids"], seq_idx=batch["seq_idx"] if use_seq_idx else None)
  logits = model.logits(h)  # (b, l, vocab) float32
  logz = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, batch["targets"][..., None].astype(jnp.int32), -1)[..., 0]
  mask = batch["loss_mask"].astype(F32)
  return jnp.sum((logz - target_logit) * mask), jnp.sum(mask)


def _split_micro(batch, k: int, mesh: Mesh):
  """(b, l) -> (k, b/k, l). Row j*k + i goes to micro-batch i, so each
  micro-batch keeps the batch's split over devices and nothing moves."""
  spec = NamedSharding(mesh, P(None, ("data", "fsdp"), None))

  def split(x):
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, spec)

  return jax.tree.map(split, batch)


def make_train_step(cfg: Mamba2Config, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, mesh: Mesh, *, grad_accum: int = 1,
                    rules=sharding.DEFAULT_RULES, use_seq_idx: bool = True) -> Callable:
  """`step(state, batch) -> (state, metrics)`: one jax.jit with explicit
  shardings; the incoming state is donated.

  With grad_accum = k the global batch is scanned as k micro-batches; loss and
  gradient sums are added up and divided by the total token count once, so the
  update equals the one from the whole batch at once.
  Metrics (float32 scalars, replicated): loss, grad_norm, param_norm, lr,
  tokens (unmasked), nonfinite_streak.
  """
  st_sh = state_shardings(cfg, optimizer, mesh, rules)
  b_sh = {k: batch_sharding(mesh) for k in BATCH_KEYS}
  replicated = NamedSharding(mesh, P())

  def sums_and_grads(params, mb):
    loss = lambda p: loss_sums(p, mb, cfg, use_seq_idx)
    (loss_sum, count), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return loss_sum, count, grads

  def step(state: TrainState, batch):
    with sharding.use_rules(mesh, rules):
      params = state.params
      if grad_accum == 1:
        loss_sum, count, grads = sums_and_grads(params, batch)
      else:
        def body(carry, mb):
          loss_sum, count, grads = sums_and_grads(params, mb)
          acc_loss, acc_count, acc_grads = carry
          acc_grads = jax.tree.map(jnp.add, acc_grads, grads)
          acc_grads = jax.lax.with_sharding_constraint(acc_grads, st_sh.params)
          return (acc_loss + loss_sum, acc_count + count, acc_grads), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss_sum, count, grads), _ = jax.lax.scan(
            body, (jnp.zeros((), F32), jnp.zeros((), F32), zeros), _split_micro(batch, grad_accum, mesh))
      denom = jnp.maximum(count, 1.0)
      grads = jax.tree.map(lambda g: g / denom, grads)
      loss = loss_sum / denom
      updates, opt_state = optimizer.update(grads, state.opt_state, params)
      new_params = optax.apply_updates(params, updates)
      rng, _ = jax.random.split(state.rng)
      new_state = TrainState(step=state.step + 1, params=new_params, opt_state=opt_state, rng=rng)
      metrics = {
          "loss": loss,
          "grad_norm": optax.global_norm(grads),
          "param_norm": optax.global_norm(new_params),
          "lr": jnp.asarray(schedule(state.step), F32),
          "tokens": count,
          "nonfinite_streak": nonfinite_streak(opt_state),
      }
      return new_state, metrics

  return jax.jit(step, in_shardings=(st_sh, b_sh), out_shardings=(st_sh, replicated),
                 donate_argnums=(0,))


def make_eval_step(cfg: Mamba2Config, mesh: Mesh, rules=sharding.DEFAULT_RULES,
                   use_seq_idx: bool = True) -> Callable:
  """`eval_step(params, batch) -> (loss_sum, token_count)`, jitted with the params' shardings."""
  p_sh = param_shardings(cfg, mesh, rules)
  b_sh = {k: batch_sharding(mesh) for k in BATCH_KEYS}

  def step(params, batch):
    with sharding.use_rules(mesh, rules):
      return loss_sums(params, batch, cfg, use_seq_idx)

  return jax.jit(step, in_shardings=(p_sh, b_sh), out_shardings=NamedSharding(mesh, P()))


def evaluate(eval_step: Callable, params, batches: Iterable[Mapping[str, jax.Array]]) -> dict[str, float]:
  """Mean loss over all unmasked tokens of `batches`, and its perplexity."""
  total, count = 0.0, 0.0
  for batch in batches:
    s, n = eval_step(params, batch)
    total, count = total + float(s), count + float(n)
  loss = total / max(count, 1.0)
  return {"eval_loss": loss, "eval_ppl": float(np.exp(min(loss, 80.0)))}


def to_global(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """This process's rows of the batch -> global arrays split over data x fsdp."""
  return data.to_global({k: np.asarray(batch[k]) for k in BATCH_KEYS}, mesh, batch_sharding(mesh).spec)


# ----------------------------------------------------------------------------
# Hooks: periodic work on the training loop.


@dataclasses.dataclass
class Hook:
  """`fn(step, state, metrics)` after every `every` steps (step counts from 1),
  and after the last step if `at_end`. `metrics` are the step's device arrays:
  a hook that reads them waits for the step to finish, so only hooks that need
  them should. `every <= 0` turns the hook off."""

  name: str
  every: int
  fn: Callable[[int, TrainState, dict], None]
  at_end: bool = True

  def due(self, step: int, last_step: int) -> bool:
    if self.every <= 0:
      return False
    return step % self.every == 0 or (self.at_end and step == last_step)


def run_hooks(hooks: Iterable[Hook], step: int, last_step: int, state: TrainState, metrics: dict) -> None:
  for hook in hooks:
    if hook.due(step, last_step):
      hook.fn(step, state, metrics)


class NonFiniteLossError(RuntimeError):
  pass


class Throughput:
  """Wall time and tokens between two log points: tokens/s and time per step."""

  def __init__(self):
    self.reset()

  def reset(self):
    self.t0, self.steps = time.perf_counter(), 0

  def tick(self):
    self.steps += 1

  def read(self, tokens_per_step: int) -> dict[str, float]:
    dt = time.perf_counter() - self.t0
    steps = max(self.steps, 1)
    out = {"step_time": dt / steps, "tokens_per_sec": tokens_per_step * steps / max(dt, 1e-9)}
    self.reset()
    return out


class NonFiniteGuard:
  """Hook body that stops the run after `max_steps` non-finite steps in a row.

  It reads the previous step's streak while the current step runs, so watching
  every step does not stall the device; the last step is checked at once.
  """

  def __init__(self, max_steps: int, last_step: int):
    self.max_steps, self.last_step = max_steps, last_step
    self._pending = None

  def __call__(self, step: int, state: TrainState, metrics: dict) -> None:
    if self._pending is not None:
      self._check(*self._pending)
    self._pending = (step, metrics["nonfinite_streak"])
    if step == self.last_step:
      self._check(*self._pending)

  def _check(self, step, streak) -> None:
    streak = int(streak)
    if self.max_steps > 0 and streak >= self.max_steps:
      raise NonFiniteLossError(
          f"the loss or gradient was non-finite for {streak} steps in a row (steps "
          f"{step - streak + 1}..{step}, optim.max_nonfinite_steps = {self.max_steps}). Those "
          f"updates were skipped, so the parameters are still those after step {step - streak}. "
          f"Lower optim.lr, check the data, or try compute_dtype float32.")


# ----------------------------------------------------------------------------
# Everything a run (or a benchmark) needs, built from the run config.


@dataclasses.dataclass
class Built:
  model_cfg: Mamba2Config
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  state: TrainState
  train_step: Callable  # jitted (state, batch) -> (state, metrics); state donated
  eval_step: Callable  # jitted (params, batch) -> (loss_sum, count)


def build(config, mesh: Mesh, *, params=None) -> Built:
  """Model config, optimizer, the initial sharded TrainState and the jitted steps.

  `config` is a validated run config (see run_config.validate). To time the
  step: `b = build(config, mesh)`, then `b.train_step.lower(b.state, batch).compile()`
  with a batch from `to_global`.
  """
  model_cfg = model_config(config)
  optimizer, schedule = make_optimizer(config.optim, config.steps)
  state = init_train_state(model_cfg, optimizer, mesh, config.seed, params=params)
  docs = bool(config.data.use_seq_idx)
  train_step = make_train_step(model_cfg, optimizer, schedule, mesh, grad_accum=config.optim.grad_accum,
                               use_seq_idx=docs)
  return Built(model_cfg, optimizer, schedule, state, train_step,
               make_eval_step(model_cfg, mesh, use_seq_idx=docs))
