"""The optimizer of a run: AdamW with global-norm clipping, a weight-decay mask,
a learning-rate schedule, and skipping of non-finite steps, all in optax.

Built from `config.optim` (see configs/base.py for the keys). Gradient
accumulation is not here: the train step scans over micro-batches itself (see
train/step.py), so the optimizer always sees the gradient of the whole batch.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

# Parameters (by their name in `Mamba2LM.params()`) that take weight decay, and
# those that do not: biases, norm scales, and the SSM's A_log, D and dt_bias,
# as mamba_ssm excludes them (`_no_weight_decay`). Every parameter must be in
# exactly one set, so a new parameter cannot silently pick a side.
DECAYED = frozenset({"embedding", "lm_head", "in_proj_zx", "in_proj_bc", "in_proj_dt",
                     "conv_x", "conv_bc", "out_proj",
                     # hybrids' attention and MLP layers (their norms are "norm")
                     "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj",
                     # LoRA adapters' two factors (model/lora.py), decayed as peft's AdamW does
                     "a", "b",
                     # mixture-of-experts layers (model/moe.py)
                     "router", "experts_up", "experts_down", "latent_down", "latent_up",
                     "shared_up", "shared_down"})
NOT_DECAYED = frozenset({"norm", "gate_norm", "norm_f", "conv_x_bias", "conv_bc_bias",
                         "dt_bias", "A_log", "D",
                         # moved by the load, never by gradients (train/balance.py)
                         "e_score_correction_bias"})

SCHEDULES = ("cosine", "wsd", "constant")
STATE_DTYPES = ("float32", "bfloat16")
# Steps in a row with a non-finite loss or gradient that apply_if_finite may skip
# before it lets an update through; the training loop stops long before that.
_NEVER_APPLY = 2**30


def weight_decay_mask(params) -> Any:
  """A tree of bools over `params`: True where weight decay applies."""

  def decide(path, _):
    name = str(getattr(path[-1], "key", path[-1]))
    if name in DECAYED:
      return True
    if name in NOT_DECAYED:
      return False
    raise ValueError(f"parameter {name!r} is in neither optim.DECAYED nor optim.NOT_DECAYED")

  return jax.tree_util.tree_map_with_path(decide, params)


def make_schedule(optim_cfg: Mapping[str, Any], steps: int) -> optax.Schedule:
  """Learning rate by optimizer step.

  cosine: linear warmup to `lr`, then cosine to `lr * final_lr_frac` at `steps`.
  wsd: warmup-stable-decay: linear warmup, constant `lr`, then a linear decay to
    `lr * final_lr_frac` over the last `decay_frac` of the steps.
  constant: linear warmup, then constant `lr`.
  Warmup lasts `warmup_frac` of the steps (at least one step).
  """
  lr = float(optim_cfg["lr"])
  end = lr * float(optim_cfg["final_lr_frac"])
  warmup = max(1, int(round(float(optim_cfg["warmup_frac"]) * steps)))
  kind = optim_cfg["schedule"]
  if kind == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end)
  ramp = optax.linear_schedule(0.0, lr, warmup)
  if kind == "constant":
    return optax.join_schedules([ramp, optax.constant_schedule(lr)], [warmup])
  if kind == "wsd":
    decay = max(1, int(round(float(optim_cfg["decay_frac"]) * steps)))
    stable_end = max(warmup, steps - decay)
    return optax.join_schedules(
        [ramp, optax.constant_schedule(lr), optax.linear_schedule(lr, end, decay)],
        [warmup, stable_end])
  raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {kind!r}")


def make_optimizer(optim_cfg: Mapping[str, Any], steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (decoupled decay, masked), clipping first, non-finite steps skipped.

  Returns the transformation and its schedule (for logging the learning rate).
  The state of a skipped step is kept as it was: `apply_if_finite` returns zero
  updates and the inner state unchanged, and counts the streak in
  `opt_state.notfinite_count`, which the training loop watches.

  `state_dtype='bfloat16'` stores Adam's first moment in bfloat16 (optax's
  `mu_dtype`); the second moment stays float32.
  """
  schedule = make_schedule(optim_cfg, steps)
  if optim_cfg["state_dtype"] not in STATE_DTYPES:
    raise ValueError(f"optim.state_dtype must be one of {STATE_DTYPES}, got {optim_cfg['state_dtype']!r}")
  mu_dtype = jnp.dtype(optim_cfg["state_dtype"])
  parts = []
  if optim_cfg["clip_norm"] and optim_cfg["clip_norm"] > 0:
    parts.append(optax.clip_by_global_norm(float(optim_cfg["clip_norm"])))
  parts += [
      optax.scale_by_adam(b1=float(optim_cfg["b1"]), b2=float(optim_cfg["b2"]),
                          eps=float(optim_cfg["eps"]), mu_dtype=mu_dtype),
      optax.add_decayed_weights(float(optim_cfg["weight_decay"]), mask=weight_decay_mask),
      optax.scale_by_learning_rate(schedule),
  ]
  tx = optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=_NEVER_APPLY)
  return tx, schedule


def nonfinite_streak(opt_state) -> jax.Array:
  """Steps in a row skipped for a non-finite loss or gradient (0 after a good step)."""
  return opt_state.notfinite_count
