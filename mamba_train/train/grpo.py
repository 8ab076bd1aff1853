"""Group relative policy optimisation (GRPO; Shao et al. 2024, DeepSeekMath): the
advantages and the loss as TRL's GRPOTrainer defines them, in plain JAX, float32.

A rollout batch holds n = prompts * G completions, a group's G completions together;
its per-token arrays are (n, t) over the completion positions, `mask` 1 on the tokens
generated up to and including the first EOS (`completion_mask`) and 0 after it.

  advantage   A = r - mean_group(r), divided by (std + 1e-4) with the group's std, the
              batch's, or not at all (scale "group" / "batch" / "none"; TRL's scale_rewards)
  ratio       rho = exp(logp - logp_old): logp_old the rollout policy's log-probabilities,
              recomputed by the trainer; with one optimizer step per rollout batch
              (num_iterations = 1) it is logp itself, detached, and rho = 1 with gradient
  per token   l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) * w + beta * KL
              KL = exp(ref - logp) - (ref - logp) - 1, the k3 estimator of KL(pi || ref)
              w  = the truncated importance weight against the sampler (below), or 1
  loss        grpo     mean over completions of (sum_t l m / sum_t m)
              bnpo     sum l m / sum m                     over this batch's tokens
              dr_grpo  sum l m / (n * max_completion_length)
              dapo     sum l m / num_tokens                num_tokens: the completion tokens of
                                                           the whole optimizer step (TRL's
                                                           num_items_in_batch), default this batch's

bnpo and dapo differ only when an optimizer step is split into microbatches: bnpo
normalises each by its own tokens, dapo all by the step's total, so a long completion
weighs the same wherever it falls.

The sampler (the on-device rollout) and the trainer compute a token's log-probability
with different programs, so the two differ slightly, and the rollout is then slightly
off-policy. TRL's vllm_importance_sampling_correction weighs each token's loss by
exp(logp_old - logp_sampler), taken per token or summed per completion, and then either
truncated to [is_min, is_max] or set to 0 outside it (modes token_truncate, token_mask,
sequence_truncate, sequence_mask; "off" leaves w = 1). A sampler log-probability that is
NaN (unknown) counts as no difference.

Groups whose scorable rewards are all equal have zero advantage, exactly, so they carry
no gradient; `advantages` counts them. Completions that no reward function scored (reward
NaN) are left out of their group's mean and std and get advantage 0.

Masked positions (after EOS, padding) are replaced by zeros before any arithmetic, so
whatever the arrays hold there (garbage, -inf) gives a finite loss and exactly zero
gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

F32 = jnp.float32
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
SAMPLER_IS = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# TRL's: added to the std so that a group whose rewards barely differ is not blown up.
STD_EPS = 1e-4


@dataclasses.dataclass(frozen=True)
class GrpoSpec:
  loss_type: str = "dapo"           # TRL's default
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2         # DAPO recommends 0.28 (clip-higher)
  beta: float = 0.0                 # KL to the reference; 0 needs no reference pass
  scale_rewards: str = "group"
  sampler_is: str = "token_truncate"
  is_min: float | None = None       # TRL's vllm_importance_sampling_clip_min / _max
  is_max: float | None = 3.0
  max_completion_length: int | None = None  # dr_grpo's constant; default the arrays' t

  def __post_init__(self):
    for name, value, allowed in (("loss_type", self.loss_type, LOSS_TYPES),
                                 ("scale_rewards", self.scale_rewards, SCALES),
                                 ("sampler_is", self.sampler_is, SAMPLER_IS)):
      if value not in allowed:
        raise ValueError(f"grpo.{name} must be one of {allowed}, got {value!r}")
    if self.epsilon_low < 0 or self.epsilon_high < 0:
      raise ValueError(f"grpo.epsilon_low and epsilon_high must be >= 0, got {self.epsilon_low}, "
                       f"{self.epsilon_high}")
    if self.is_min is not None and self.is_max is not None and self.is_min > self.is_max:
      raise ValueError(f"grpo.is_min {self.is_min} exceeds is_max {self.is_max}")


def completion_mask(ids: jax.Array, eos_id: int) -> tuple[jax.Array, jax.Array]:
  """(mask (n, t) float32, truncated (n,) bool): 1 up to and including each row's first
  EOS; a row without EOS (cut at the length limit) is all 1 and truncated."""
  is_eos = ids == eos_id
  before = jnp.cumsum(is_eos, axis=1) - is_eos  # EOS tokens strictly before each position
  return (before == 0).astype(F32), ~jnp.any(is_eos, axis=1)


def advantages(rewards: jax.Array, group_size: int, scale: str = "group") -> tuple[jax.Array, dict]:
  """(n,) float32 advantages of (n,) rewards (NaN: unscorable), and their statistics:
  `zero_std_groups` (groups whose scorable rewards are all equal: no gradient),
  `frac_reward_zero_std`, `unscorable`."""
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
  r = rewards.astype(F32)
  if r.ndim != 1 or r.shape[0] % group_size:
    raise ValueError(f"rewards {r.shape} are not groups of {group_size}")
  g = r.reshape(-1, group_size)
  valid = ~jnp.isnan(g)
  zero = jnp.where(valid, g, 0.0)

  def nan_mean_std(x, ok, axis):  # TRL's nanmean and Bessel-corrected nanstd (NaN under 2 values)
    count = jnp.sum(ok, axis=axis, keepdims=True)
    mean = jnp.sum(x, axis=axis, keepdims=True) / jnp.maximum(count, 1)
    var = jnp.sum(jnp.where(ok, (x - mean) ** 2, 0.0), axis=axis, keepdims=True) / jnp.maximum(count - 1, 1)
    return mean, jnp.where(count > 1, jnp.sqrt(var), jnp.nan)

  mean, group_std = nan_mean_std(zero, valid, 1)
  adv = g - mean
  if scale == "group":
    adv = adv / (group_std + STD_EPS)
  elif scale == "batch":
    _, batch_std = nan_mean_std(zero, valid, None)
    adv = adv / (batch_std + STD_EPS)
  lo = jnp.min(jnp.where(valid, g, jnp.inf), axis=1, keepdims=True)
  hi = jnp.max(jnp.where(valid, g, -jnp.inf), axis=1, keepdims=True)
  flat = hi <= lo  # all scorable rewards equal, or none scorable
  # Exactly zero: a mean of equal float32 values can miss them by an ulp, which the
  # division by (0 + 1e-4) would turn into a spurious signal.
  adv = jnp.where(valid & ~flat, adv, 0.0)
  adv = jnp.nan_to_num(adv, nan=0.0)  # the one scorable completion of a group: no std
  n_flat = jnp.sum(flat).astype(F32)
  return adv.reshape(-1), {"zero_std_groups": n_flat, "frac_reward_zero_std": n_flat / g.shape[0],
                           "unscorable": jnp.sum(~valid).astype(F32)}


def _masked_mean(x, m):
  return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def sampler_weights(old: jax.Array, sampler: jax.Array, mask: jax.Array,
                    spec: GrpoSpec) -> tuple[jax.Array, dict]:
  """The importance weights (n, t) or (n, 1) of the trainer's rollout-policy log-probabilities
  `old` against the sampler's, with their statistics (TRL's names). No gradient."""
  old, sampler = jax.lax.stop_gradient(old.astype(F32)), jax.lax.stop_gradient(sampler.astype(F32))
  live = (mask > 0) & ~jnp.isnan(sampler)
  diff = jnp.where(live, old - jnp.where(live, sampler, 0.0), 0.0)
  gap = jnp.abs(diff)
  count = jnp.sum(live)
  stats = {"sampling/sampling_logp_difference/mean": jnp.sum(gap) / jnp.maximum(count, 1),
           "sampling/sampling_logp_difference/max": jnp.max(gap)}
  per_sequence = spec.sampler_is.startswith("sequence")
  log_w = jnp.sum(diff, axis=1, keepdims=True) if per_sequence else diff
  w = jnp.exp(log_w)
  lo = -jnp.inf if spec.is_min is None else spec.is_min
  hi = jnp.inf if spec.is_max is None else spec.is_max
  if spec.sampler_is.endswith("truncate"):
    w = jnp.clip(w, lo, hi)
  else:
    w = jnp.where((w < lo) | (w > hi), 0.0, w)
  sel = jnp.ones_like(w, bool) if per_sequence else mask > 0
  n_sel = jnp.sum(sel)
  stats |= {"sampling/importance_sampling_ratio/min": jnp.where(n_sel > 0, jnp.min(jnp.where(sel, w, jnp.inf)), 0.0),
            "sampling/importance_sampling_ratio/mean": jnp.sum(jnp.where(sel, w, 0.0)) / jnp.maximum(n_sel, 1),
            "sampling/importance_sampling_ratio/max": jnp.where(n_sel > 0, jnp.max(jnp.where(sel, w, -jnp.inf)), 0.0)}
  return w, stats


def grpo_loss(logps: jax.Array, advantages: jax.Array, mask: jax.Array, spec: GrpoSpec, *,
              old_logps: jax.Array | None = None, sampler_logps: jax.Array | None = None,
              ref_logps: jax.Array | None = None, num_tokens: jax.Array | None = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss (a float32 scalar) and its metrics, from the policy's per-token
  log-probabilities `logps` (n, t) (the only input that carries gradient), the
  advantages (n,) and the completion mask (n, t).

  old_logps: the rollout policy's, recomputed by the trainer (num_iterations > 1); None
  means logps detached. sampler_logps: the sampler's, for the importance weights
  (ignored when spec.sampler_is is "off"). ref_logps: the reference's, for the KL term
  (needed when beta > 0; logged as `kl` whenever given). num_tokens: dapo's normaliser.
  """
  m = mask.astype(F32)
  live = m > 0
  safe = lambda x: jnp.where(live, x.astype(F32), 0.0)  # see the module doc: masked positions
  logp = safe(logps)
  old = jax.lax.stop_gradient(logp if old_logps is None else safe(old_logps))
  a = advantages.astype(F32)[:, None]
  ratio = jnp.exp(logp - old)
  clipped = jnp.clip(ratio, 1.0 - spec.epsilon_low, 1.0 + spec.epsilon_high)
  per_token = -jnp.minimum(ratio * a, clipped * a)
  metrics = {}
  if spec.sampler_is != "off":
    if sampler_logps is None:
      raise ValueError(f"sampler_is={spec.sampler_is!r} needs the sampler's log-probabilities")
    w, stats = sampler_weights(old, safe(sampler_logps), m, spec)
    per_token = per_token * w
    metrics |= stats
  if ref_logps is not None:
    d = safe(ref_logps) - logp
    kl = jnp.exp(d) - d - 1.0
    metrics["kl"] = _masked_mean(jax.lax.stop_gradient(kl), m)
    if spec.beta:
      per_token = per_token + spec.beta * kl
  elif spec.beta:
    raise ValueError("beta > 0 needs the reference's log-probabilities (ref_logps)")

  total = per_token * m
  if spec.loss_type == "grpo":
    loss = jnp.mean(jnp.sum(total, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0))
  elif spec.loss_type == "bnpo":
    loss = jnp.sum(total) / jnp.maximum(jnp.sum(m), 1.0)
  elif spec.loss_type == "dr_grpo":
    length = spec.max_completion_length or logps.shape[1]
    loss = jnp.sum(total) / (logps.shape[0] * length)
  else:  # dapo
    tokens = jnp.sum(m) if num_tokens is None else jnp.asarray(num_tokens, F32)
    loss = jnp.sum(total) / jnp.maximum(tokens, 1.0)

  low = ((ratio < 1.0 - spec.epsilon_low) & (a < 0)).astype(F32)
  high = ((ratio > 1.0 + spec.epsilon_high) & (a > 0)).astype(F32)
  metrics |= {"clip_ratio/low_mean": _masked_mean(low, m), "clip_ratio/high_mean": _masked_mean(high, m),
              "clip_ratio/region_mean": _masked_mean(jnp.maximum(low, high), m)}
  return loss, jax.lax.stop_gradient(metrics)
