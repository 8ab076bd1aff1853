"""The optimizer of a run: AdamW with global-norm clipping, a weight-decay mask,
a learning-rate schedule, and skipping of non-finite steps, all in optax.

Built from `config.optim` (see configs/base.py for the keys). Gradient
accumulation is not here: the train step scans over micro-batches itself (see
train/step.py), so the optimizer always sees the gradient of the whole batch.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

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
                     "shared_up", "shared_down",
                     # Mamba-3 layers' other in_proj pieces (model/mamba3.py)
                     "in_proj_heads", "in_proj_angles"})
NOT_DECAYED = frozenset({"norm", "gate_norm", "norm_f", "conv_x_bias", "conv_bc_bias",
                         "dt_bias", "A_log", "D",
                         # Mamba-3's B/C biases and norm scales, and its MIMO projections:
                         # per-channel gains around their init (1, 1/R), not matrices
                         "B_bias", "C_bias", "B_norm", "C_norm", "mimo_x", "mimo_z", "mimo_o",
                         # moved by the load, never by gradients (train/balance.py)
                         "e_score_correction_bias"})

SCHEDULES = ("cosine", "wsd", "constant")
STATE_DTYPES = ("float32", "bfloat16")

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
  """AdamW (decoupled decay, masked), clipping first, non-finite steps and weight jumps
  skipped (`guard`).

  Returns the transformation and its schedule (for logging the learning rate).
  The state of a skipped step is kept as it was: `guard` returns zero updates and
  the inner state unchanged, and counts the streak in `opt_state.notfinite_count`,
  which the training loop watches.

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
  tx = guard(optax.chain(*parts), factor=float(optim_cfg.get("weight_guard_factor", WEIGHT_GUARD_FACTOR)),
             window=int(optim_cfg.get("weight_guard_window", WEIGHT_GUARD_WINDOW)))
  return tx, schedule


# ----------------------------------------------------------------------------
# The step guard: non-finite steps and weight jumps skipped.
#
# optax.apply_if_finite skips non-finite steps but knows nothing of a finite step that
# blows the weights up (a norm of 1e9), and optax has no transformation that does; this
# one does both, in the same way: zero updates and the inner state kept as it was.

WEIGHT_GUARD_FACTOR = 10.0
WEIGHT_GUARD_WINDOW = 20


class GuardState(NamedTuple):
  inner_state: Any
  notfinite_count: jax.Array  # int32: steps in a row skipped, for either reason (0 after a good one)
  total_skipped: jax.Array  # int32: steps skipped in all
  weight_jump: jax.Array  # int32: 1 if the last step was skipped for a norm jump
  update_norm: jax.Array  # float32: the last step's proposed update's global norm
  param_norms: jax.Array  # float32[window]: the parameter norms after the newest accepted steps
  update_norms: jax.Array  # float32[window]: their update norms
  accepted: jax.Array  # int32: steps accepted so far (how full the window is)


class GuardedTransformation(optax.GradientTransformation):
  """An optax transformation wrapped by `guard` (a distinct type, so a second wrap is a no-op).

  Beside optax's `update`, `update_with_squares(grads, state, params)` returns
  (updates, state, squares): `squares` a tree like `params` of float32 scalars, each leaf's
  sum of squares as the step leaves it (after the update if taken, as it was if skipped),
  from the same pass as the guard's checks, so a caller reports the parameter norm
  without reading the new parameters again (train/step.py)."""


def guard(inner: optax.GradientTransformation, *, factor: float = WEIGHT_GUARD_FACTOR,
          window: int = WEIGHT_GUARD_WINDOW) -> GuardedTransformation:
  """`inner`, with each step skipped (zero updates, `inner`'s state kept) when its gradient
  or update is non-finite, or, once `window` steps have been accepted, when the parameter
  norm after it or its update norm exceeds `factor` times the largest of the newest
  `window` accepted steps' (`factor` 0: no norm check). Skipped steps count in
  `notfinite_count` (the streak the training loop stops on) and `weight_jump` says which
  kind the last one was. Any optax transformation works as `inner`; a guarded one is
  returned as it is. `inner` runs twice a step on the same inputs (once for the checks,
  once for the step applied: see `update`), so it must be a function of them (a host
  callback in it is called twice).

  Why a factor of 10 against the window's largest norm cannot trip a healthy run: the
  parameter norm grows by at most the update norm in a step, which was 5e-4..6e-2 of it
  in the runs measured (docs/bench/weight_guard.md: ratios to the window's largest of
  1.02 at most for the parameter norm, 1.05 for the update norm), so it would need an
  update nine times the weights; AdamW's update per coordinate, |m_hat / sqrt(v_hat)|, is bounded by
  (1 - b1) / sqrt(1 - b2) (0.45 at b2 = 0.95, 3.2 at 0.999) against about 0.2 in a
  noise-dominated step, so even a gradient spike on every coordinate at once moves
  the update norm by 2x (b2 = 0.95) to 14x (b2 = 0.999, with clipping off), and the
  learning rate ramps by at most (window + 1) / window a step once the window is full.
  A schedule that jumps up (warm restarts) can trip it: raise the factor or set it to 0.
  """
  if isinstance(inner, GuardedTransformation):
    return inner
  window = max(int(window), 1)
  f32 = jnp.float32

  def init(params):
    return GuardState(inner_state=inner.init(params), notfinite_count=jnp.zeros((), jnp.int32),
                      total_skipped=jnp.zeros((), jnp.int32), weight_jump=jnp.zeros((), jnp.int32),
                      update_norm=jnp.zeros((), f32), param_norms=jnp.zeros((window,), f32),
                      update_norms=jnp.zeros((window,), f32), accepted=jnp.zeros((), jnp.int32))

  def update_with_squares(grads, state: GuardState, params=None, **extra):
    # The inner step runs twice on the same inputs: once for the checks below, once for
    # the step applied, its state behind an optimization barrier so XLA keeps the two
    # apart. Run once, its updates were written out in full and read back by the checks
    # and by the parameters' update; run twice, the checks are one reduction that
    # reads the gradient, the state and the parameters, and the update one pass that
    # writes the parameters and state: 42 bytes a float32 parameter with a bfloat16
    # gradient on h100-8, against 58 (docs/bench/moe.md, "One MoE layer's bytes").
    checked, _ = inner.update(grads, state.inner_state, params, **extra)
    sums = _squares(checked, params)
    u_sq, p_sq = sum(u for u, _, _ in sums), sum(a for _, a, _ in sums)
    u_norm, p_norm = jnp.sqrt(u_sq), jnp.sqrt(p_sq)
    # A non-finite update shows in its squares' sum (as does one whose norm passes
    # float32's range, 1.8e19), so only the gradient is checked element by element.
    finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(grads)])) & jnp.isfinite(u_sq)
    before = jax.lax.optimization_barrier(state.inner_state)
    updates, inner_state = inner.update(grads, before, params, **extra)
    full = state.accepted >= window
    jump = full & (factor > 0) & ((p_norm > factor * jnp.max(state.param_norms))
                                  | (u_norm > factor * jnp.max(state.update_norms)))
    ok = finite & ~jump
    keep = lambda new, old: jnp.where(ok, new, old)
    slot = state.accepted % window
    new_state = GuardState(
        inner_state=jax.tree.map(keep, inner_state, before),
        notfinite_count=jnp.where(ok, 0, state.notfinite_count + 1).astype(jnp.int32),
        total_skipped=state.total_skipped + (~ok).astype(jnp.int32),
        weight_jump=(finite & jump).astype(jnp.int32), update_norm=u_norm,
        param_norms=keep(state.param_norms.at[slot].set(p_norm), state.param_norms),
        update_norms=keep(state.update_norms.at[slot].set(u_norm), state.update_norms),
        accepted=state.accepted + ok.astype(jnp.int32))
    kept = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
    treedef = jax.tree.structure(updates)
    squares = treedef.unflatten([jnp.where(ok, after, before) for _, after, before in sums])
    return kept, new_state, squares

  def update(grads, state: GuardState, params=None, **extra):
    return update_with_squares(grads, state, params, **extra)[:2]

  tx = GuardedTransformation(init, update)
  tx.update_with_squares = update_with_squares
  return tx


def _squares(updates, params) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
  """Each leaf's (sum of the update's squares, sum of the squares of the parameter after
  it, the parameter's as it was), float32. The first two are one reduction (the real and
  imaginary parts of one complex sum), which XLA:GPU fuses with the update's computation,
  where two sums of the same update (two, or a variadic reduce) have it written out and
  read back (docs/bench/moe.md, "One MoE layer's bytes"); the third reads only the
  parameter, which the pass reads anyway, and fuses beside them (stacking all three on a
  last axis of 3 moved more: docs/bench/moe.md, "The parameter norm from the guard's
  pass"). An inf or NaN anywhere makes the sums non-finite. params None: all three are
  the update's."""
  out = []
  for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params) if params is not None else
                  [None] * len(jax.tree.leaves(updates))):
    u = u.astype(jnp.float32)
    before = u if p is None else p.astype(jnp.float32)
    after = u if p is None else (p + u).astype(p.dtype).astype(jnp.float32)
    z = jnp.sum(jax.lax.complex(u * u, after * after))
    out.append((jnp.real(z), jnp.imag(z), jnp.sum(before * before)))
  return out


def param_norm(new_params, guarded, squares) -> jax.Array:
  """The global norm of `new_params`: each leaf's sum of squares from the guard's pass
  (`squares` of `update_with_squares`, for the leaves of `guarded`, the parameters its
  step returned), computed here only for a leaf changed after it (the router's
  correction biases, moved by the load: train/step.py). A pass of its own reading every
  new weight would cost 4 bytes a parameter more (docs/bench/moe.md, "The parameter norm
  from the guard's pass")."""
  sq = [s if new is old else jnp.sum(jnp.square(new.astype(jnp.float32)))
        for new, old, s in zip(jax.tree.leaves(new_params), jax.tree.leaves(guarded), jax.tree.leaves(squares))]
  return jnp.sqrt(sum(sq[1:], sq[0]))


def nonfinite_streak(opt_state: GuardState) -> jax.Array:
  """Steps in a row skipped for a non-finite loss or gradient or a weight jump (0 after a good step)."""
  return opt_state.notfinite_count


def guard_metrics(opt_state: GuardState) -> dict[str, jax.Array]:
  """The guard's per-step metrics: the skip streak, whether the step was skipped for a
  weight jump, the proposed update's norm."""
  return {"nonfinite_streak": opt_state.notfinite_count,
          "weight_jump": opt_state.weight_jump.astype(jnp.float32),
          "update_norm": opt_state.update_norm}
