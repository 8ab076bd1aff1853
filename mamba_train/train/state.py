"""The train state: one pytree, `TrainState(step, params, opt_state, rng, frozen)`,
with `params` what trains: the plain nested dict of `Mamba2LM.params()`, or with
LoRA (`lora` a `model.lora.LoraSpec`) the adapters alone, and `frozen` the base they
adapt (`lora.frozen_base`: quantized for QLoRA, the weights only compute-dtype matmuls
read in the compute dtype), or without LoRA a frozen copy of the initial weights
(`frozen_copy`: DPO's reference), else None. Checkpoints hold the state without
`frozen` (`trainable`): the run config names it (init_from), and a resume rebuilds it.

The shardings come from the parameters' logical axes and the rules table in
parallel/sharding.py; the optimizer state mirrors the parameters' shardings, so
FSDP shards both. A fresh state is created directly in its shardings (no full copy
on one device); an abstract one (shapes and shardings only) is what restore fills
in and what an ahead-of-time compile takes.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mamba_train.model import lora as lora_lib
from mamba_train.model.config import Mamba2Config
from mamba_train.model.lm import Mamba2LM
from mamba_train.parallel import sharding
from mamba_train.train.optim import guard

LoraSpec = lora_lib.LoraSpec


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: train steps taken (skipped non-finite steps included)
  params: Any  # Mamba2LM.params(): {"embedding", "norm_f", "layers": {...}[, "lm_head"]}
  opt_state: Any
  rng: jax.Array  # uint32[2], split once per step, for anything stochastic
  frozen: Any = None  # with LoRA: the base params (Mamba2LM.params(), maybe quantized)


@flax.struct.dataclass
class SavedState:
  """What a checkpoint holds: a TrainState but its `frozen` part, in the layout checkpoints
  have always had (so that those saved before `frozen` existed restore)."""
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def trainable(state: TrainState) -> SavedState:
  """The part of a state a checkpoint holds: all of it but the frozen base."""
  return SavedState(step=state.step, params=state.params, opt_state=state.opt_state, rng=state.rng)


def with_frozen(saved: SavedState, frozen) -> TrainState:
  """A restored `SavedState` made whole again with the run's frozen part."""
  return TrainState(step=saved.step, params=saved.params, opt_state=saved.opt_state, rng=saved.rng,
                    frozen=frozen)


def _abstract_model(cfg: Mamba2Config) -> Mamba2LM:
  return nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))


def param_logical_axes(cfg: Mamba2Config) -> dict[str, Any]:
  """The logical axes of every parameter, as a tree shaped like `Mamba2LM.params()`."""
  model = _abstract_model(cfg)
  by_path = {tuple(str(k) for k in path): var.logical_axes
             for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}
  return jax.tree_util.tree_map_with_path(
      lambda path, _: by_path[tuple(str(getattr(k, "key", k)) for k in path)], jax.eval_shape(model.params))


def param_shapes(cfg: Mamba2Config):
  """ShapeDtypeStructs of `Mamba2LM.params()`, without creating any array."""
  return jax.eval_shape(_abstract_model(cfg).params)


def param_shardings(cfg: Mamba2Config, mesh: Mesh, rules=sharding.DEFAULT_RULES):
  """NamedShardings for `Mamba2LM.params()`, from the logical axes by `rules`."""
  return sharding.tree_shardings(param_shapes(cfg), param_logical_axes(cfg), mesh, rules)


def _frozen_shardings(cfg: Mamba2Config, lora: LoraSpec, mesh: Mesh, rules):
  """The frozen base's shardings: each weight's, and a quantized weight's values and
  scales split by the same logical axes (a scale's size-1 axes left whole)."""
  abstract = jax.eval_shape(lambda p: lora_lib.frozen_base(p, lora), param_shapes(cfg))
  fit = lambda axes, s: NamedSharding(mesh, sharding.fit_spec(sharding.logical_to_spec(axes, rules),
                                                               s.shape, mesh))
  return jax.tree.map(lambda axes, sub: jax.tree.map(lambda s: fit(axes, s), sub),
                      param_logical_axes(cfg), abstract, is_leaf=lambda x: isinstance(x, tuple))


def _trainable_shapes(cfg: Mamba2Config, lora: LoraSpec | None):
  shapes = param_shapes(cfg)
  return shapes if lora is None else lora_lib.adapter_shapes(shapes, lora)


def weight_shardings(cfg: Mamba2Config, mesh: Mesh, rules=sharding.DEFAULT_RULES,
                     lora: LoraSpec | None = None, frozen_copy: bool = False):
  """(params, frozen) shardings: the model's parameters and None (or theirs again with
  `frozen_copy`), or with LoRA the adapters' (replicated but for their layers axis)
  and the base's."""
  if lora is None:
    p_sh = param_shardings(cfg, mesh, rules)
    return p_sh, (p_sh if frozen_copy else None)
  shapes = _trainable_shapes(cfg, lora)
  return (sharding.tree_shardings(shapes, lora_lib.adapter_logical_axes(shapes), mesh, rules),
          _frozen_shardings(cfg, lora, mesh, rules))


def state_shardings(cfg: Mamba2Config, optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules=sharding.DEFAULT_RULES, lora: LoraSpec | None = None,
                    frozen_copy: bool = False) -> TrainState:
  """Shardings of the whole TrainState: the optimizer's per-parameter state
  follows the parameters; its counters and the rest are replicated.

  `optimizer`, here and wherever a state is made, is any optax transformation: the
  state holds it wrapped by `optim.guard` (as the train step runs it), unless it is already."""
  optimizer = guard(optimizer)
  replicated = NamedSharding(mesh, P())
  p_sh, frozen = weight_shardings(cfg, mesh, rules, lora, frozen_copy)
  abstract_opt = jax.eval_shape(optimizer.init, _trainable_shapes(cfg, lora))
  opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, p_sh,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))
  return TrainState(step=replicated, params=p_sh, opt_state=opt_sh, rng=replicated, frozen=frozen)


def _make_state(cfg, optimizer, key, params=None, lora: LoraSpec | None = None,
                frozen_copy: bool = False) -> TrainState:
  optimizer = guard(optimizer)
  init_key, rng = jax.random.split(key)
  if params is None:
    params = Mamba2LM(cfg, rngs=nnx.Rngs(params=init_key)).params()
  frozen = jax.tree.map(jnp.copy, params) if frozen_copy and lora is None else None
  if lora is not None:  # the adapters train; the base is held as `lora.frozen_base` says
    frozen = lora_lib.frozen_base(params, lora)
    params = lora_lib.init_adapters(params, lora, jax.random.fold_in(init_key, 1))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params), rng=rng, frozen=frozen)


def with_shardings(tree, shardings):
  """ShapeDtypeStructs of `tree`'s leaves carrying `shardings` (what restore fills in)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_train_state(cfg: Mamba2Config, optimizer: optax.GradientTransformation, mesh: Mesh,
                         rules=sharding.DEFAULT_RULES, lora: LoraSpec | None = None,
                         frozen_copy: bool = False) -> TrainState:
  """The TrainState's shapes and dtypes with its shardings, allocating nothing."""
  shapes = jax.eval_shape(lambda key: _make_state(cfg, optimizer, key, lora=lora, frozen_copy=frozen_copy),
                          jax.random.PRNGKey(0))
  return with_shardings(shapes, state_shardings(cfg, optimizer, mesh, rules, lora=lora,
                                                frozen_copy=frozen_copy))


def init_train_state(cfg: Mamba2Config, optimizer: optax.GradientTransformation, mesh: Mesh,
                     seed: int, params=None, lora: LoraSpec | None = None,
                     frozen_copy: bool = False, rules=sharding.DEFAULT_RULES) -> TrainState:
  """A fresh TrainState, created directly in its shardings (no full copy on one device).

  `params`, if given (e.g. loaded for finetuning), replace the random init; with
  `lora` they (or the random init) become the frozen base of fresh adapters;
  `frozen_copy` keeps a frozen copy of them besides (DPO's reference, without LoRA).
  """
  shardings = state_shardings(cfg, optimizer, mesh, rules, lora=lora, frozen_copy=frozen_copy)
  if params is not None:
    params = jax.device_put(params, param_shardings(cfg, mesh, rules))
  make = lambda key, params: _make_state(cfg, optimizer, key, params, lora, frozen_copy)
  with sharding.use_rules(mesh, rules):
    return jax.jit(make, out_shardings=shardings)(jax.random.PRNGKey(seed), params)
