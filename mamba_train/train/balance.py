"""Load balancing of mixture-of-experts routers in training, as Megatron-Core
trains NemotronH (both switchable, config.moe):

- the auxiliary-loss-free update (DeepSeek-V3; Megatron's
  `moe_router_enable_expert_bias`): after each step every layer's
  e_score_correction_bias moves by bias_update_rate * sign(mean load - load), so
  an overloaded expert is chosen less often; it changes only which experts are
  chosen, never their weights, and no gradient or optimizer touches it;
- the auxiliary loss (Switch Transformer; `moe_aux_loss_coeff`): aux_loss_coef
  times the mean over 'E' layers of `moe.router_stats`' loss, added to the
  per-token loss.

The router statistics of a step go to metrics.jsonl (`metrics`): the tokens each
expert of each layer received, the most and least loaded expert against an even
load, the auxiliary loss, and the dropped assignments: (token, expert) pairs past their
expert's capacity (`moe.capacity_factor`; zero when dispatch is dropless, the default),
as a count and as a share of all assignments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mamba_train.model import moe as moe_lib
from mamba_train.model.config import MOE, Mamba2Config
from mamba_train.model.params import KIND_PARAMS

F32 = jnp.float32
# The scalar metrics of a step (besides moe_tokens_per_expert, a list per layer).
METRICS = ("moe_aux_loss", "moe_load_max", "moe_load_min", "moe_dropped_tokens", "moe_dropped_share")
TOKENS_PER_EXPERT = "moe_tokens_per_expert"


@dataclasses.dataclass(frozen=True)
class MoeSpec:
  aux_loss_coef: float = 0.0  # 0: no auxiliary loss
  bias_update_rate: float = 0.0  # 0: the correction bias stays as loaded


def spec_problems(moe_cfg) -> list[str]:
  out = []
  for key in ("aux_loss_coef", "bias_update_rate"):
    v = moe_cfg.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
      out.append(f"moe.{key} must be a number >= 0 (0 turns it off), got {v!r}")
  cf = moe_cfg.get("capacity_factor")
  if cf is not None and (not isinstance(cf, (int, float)) or isinstance(cf, bool) or cf < 0):
    out.append(f"moe.capacity_factor must be 0 or None (dropless) or a number > 0 such as 1.25, got {cf!r}")
  return out


def sum_shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
  """The router sums a step adds up over micro-batches (empty without 'E' layers):
  tokens per expert per layer, the auxiliary loss times the tokens, and the
  dropped assignments of every layer."""
  if not cfg.count(MOE):
    return {}
  return {"moe_load": (cfg.count(MOE), cfg.n_routed_experts), "moe_aux": (), "moe_dropped": ()}


def sums(states: dict, count, cfg: Mamba2Config) -> dict[str, jax.Array]:
  """The router sums of one forward pass from the states `Mamba2LM.backbone`
  returns (`moe.STATS`, stacked over 'E' layers); count: its loss tokens."""
  if not cfg.count(MOE):
    return {}
  return {"moe_load": states["moe_load"].astype(F32),
          "moe_aux": jnp.mean(states["moe_aux"]) * count,
          "moe_dropped": jnp.sum(states["moe_dropped"])}


def update_bias(params: dict, load, rate: float) -> dict:
  """params with each 'E' layer's correction bias moved by rate * sign(mean load -
  load) (load: (layers, experts) tokens of the step)."""
  if not rate or moe_lib.BIAS not in params.get(KIND_PARAMS[MOE], {}):
    return params
  moe = dict(params[KIND_PARAMS[MOE]])
  step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
  moe[moe_lib.BIAS] = moe[moe_lib.BIAS] + step.astype(moe[moe_lib.BIAS].dtype)
  return {**params, KIND_PARAMS[MOE]: moe}


def metrics(load, aux_mean, dropped=0.0) -> dict[str, jax.Array]:
  """A step's router metrics from its tokens per expert (layers, experts), mean
  auxiliary loss and dropped assignments (summed over layers). moe_dropped_share:
  the dropped fraction of the step's (token, expert) assignments, every layer's;
  the load counts each assignment the router made, kept or dropped, so it is the
  denominator (padding tokens are routed too, as the layer does not know them)."""
  even = jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)
  dropped = jnp.asarray(dropped, F32)
  return {"moe_aux_loss": aux_mean, "moe_load_max": jnp.max(load / even),
          "moe_load_min": jnp.min(load / even), "moe_dropped_tokens": dropped,
          "moe_dropped_share": dropped / jnp.maximum(jnp.sum(load), 1.0), TOKENS_PER_EXPERT: load}
