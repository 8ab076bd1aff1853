"""GRPO's objective (mamba_train/train/grpo.py) against a float64 numpy re-implementation of
TRL's GRPOTrainer formulas written here: the advantages of each scale (with an unscorable
completion, a group of one scorable reward and a zero-std group), the loss of each
normalisation with clipping active and inactive, the sampler's importance weights in each
mode and off, the KL term; the gradient against finite differences of the reference;
exactly zero gradient at masked positions whatever they hold; the completion mask."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.train import grpo

G = 4  # completions per prompt
N, T = 12, 7  # completions (three groups), completion positions


# ---------------------------------------------------------------------------
# The reference: TRL's definitions, in float64 numpy.


def ref_nanstd(x, axis=None):
  count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
  mean = np.nanmean(x, axis=axis, keepdims=True)
  var = np.nansum((x - mean) ** 2, axis=axis, keepdims=True) / np.where(count > 1, count - 1, 1)
  return np.where(count > 1, np.sqrt(var), np.nan)


def ref_advantages(rewards, scale):
  r = rewards.astype(np.float64).reshape(-1, G)
  with warnings.catch_warnings():  # nanmean of a group with nothing scorable
    warnings.simplefilter("ignore", RuntimeWarning)
    mean = np.nanmean(r, axis=1, keepdims=True)
    adv = r - mean
    if scale == "group":
      adv = adv / (ref_nanstd(r, axis=1) + 1e-4)
    elif scale == "batch":
      adv = adv / (ref_nanstd(r) + 1e-4)
  return np.nan_to_num(adv, nan=0.0).reshape(-1)


def ref_loss(logp, adv, mask, *, loss_type, eps_low=0.2, eps_high=0.28, beta=0.0, old=None,
             sampler=None, ref=None, is_mode="off", is_min=None, is_max=3.0, max_len=None, num_tokens=None):
  logp, mask, adv = (np.asarray(x, np.float64) for x in (logp, mask, adv))
  old = logp if old is None else np.asarray(old, np.float64)
  coef_1 = np.exp(logp - old)
  coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
  a = adv[:, None]
  per_token = -np.minimum(coef_1 * a, coef_2 * a)
  metrics = {}
  if is_mode != "off":
    diff = np.nan_to_num((old - np.asarray(sampler, np.float64)) * mask, nan=0.0)
    if is_mode.startswith("sequence"):
      diff = diff.sum(-1, keepdims=True)
    w = np.exp(diff)
    lo = -np.inf if is_min is None else is_min
    hi = np.inf if is_max is None else is_max
    w = np.clip(w, lo, hi) if is_mode.endswith("truncate") else np.where((w < lo) | (w > hi), 0.0, w)
    per_token = per_token * w
    delta = np.abs(old - np.asarray(sampler, np.float64))[(mask > 0) & ~np.isnan(sampler)]
    metrics["sampling/sampling_logp_difference/mean"] = delta.mean()
    metrics["sampling/sampling_logp_difference/max"] = delta.max()
    flat = w.reshape(-1) if is_mode.startswith("sequence") else w[mask > 0]
    metrics["sampling/importance_sampling_ratio/min"] = flat.min()
    metrics["sampling/importance_sampling_ratio/mean"] = flat.mean()
    metrics["sampling/importance_sampling_ratio/max"] = flat.max()
  if ref is not None:
    ref = np.asarray(ref, np.float64)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    metrics["kl"] = (kl * mask).sum() / mask.sum()
    if beta:
      per_token = per_token + beta * kl
  if loss_type == "grpo":
    loss = ((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean()
  elif loss_type == "bnpo":
    loss = (per_token * mask).sum() / max(mask.sum(), 1)
  elif loss_type == "dr_grpo":
    loss = (per_token * mask).sum() / (per_token.shape[0] * (max_len or mask.shape[1]))
  else:
    loss = (per_token * mask).sum() / max(mask.sum() if num_tokens is None else num_tokens, 1)
  low = (coef_1 < 1 - eps_low) & (a < 0)
  high = (coef_1 > 1 + eps_high) & (a > 0)
  for name, x in (("low", low), ("high", high), ("region", low | high)):
    metrics[f"clip_ratio/{name}_mean"] = (x * mask).sum() / mask.sum()
  return loss, metrics


# ---------------------------------------------------------------------------
# Inputs.

# Group 0 varies, group 1 is all equal (zero std), group 2 has an unscorable completion.
REWARDS = np.array([1.0, 0.0, 0.5, 2.0,  0.25, 0.25, 0.25, 0.25,  1.0, np.nan, 0.0, 0.0], np.float32)


def _inputs(spread, seed=0):
  """Per-token log-probabilities; `spread` how far the old policy is from the current one."""
  rng = np.random.default_rng(seed)
  logp = np.log(rng.uniform(0.05, 0.95, (N, T))).astype(np.float32)
  old = (logp + rng.normal(0, spread, (N, T))).astype(np.float32)
  sampler = (old + rng.normal(0, 0.3, (N, T))).astype(np.float32)
  ref = (logp + rng.normal(0, 0.2, (N, T))).astype(np.float32)
  lengths = np.array([7, 3, 5, 1, 6, 7, 2, 4, 7, 5, 0, 3])  # one completion with no token at all
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  return logp, old, sampler, ref, mask


def _close(got, want, what):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6, err_msg=what)


@pytest.mark.parametrize("scale", grpo.SCALES)
def test_advantages_match_trl_and_zero_std_groups_are_exactly_zero(scale):
  adv, stats = grpo.advantages(jnp.asarray(REWARDS), G, scale)
  _close(adv, ref_advantages(REWARDS, scale), scale)
  assert np.all(np.asarray(adv)[4:8] == 0.0) and float(adv[9]) == 0.0  # flat group; unscorable
  assert float(stats["zero_std_groups"]) == 1 and float(stats["unscorable"]) == 1
  np.testing.assert_allclose(float(stats["frac_reward_zero_std"]), 1 / 3)


def test_a_group_with_one_scorable_reward_has_no_advantage():
  r = np.array([3.0, np.nan, np.nan, np.nan, 1.0, 2.0, 3.0, 4.0], np.float32)
  for scale in grpo.SCALES:
    adv, stats = grpo.advantages(jnp.asarray(r), G, scale)
    _close(adv, ref_advantages(r, scale), scale)
    assert np.all(np.asarray(adv)[:4] == 0.0) and float(stats["zero_std_groups"]) == 1


@pytest.mark.parametrize("clipping", ["active", "inactive"])
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_loss_and_metrics_match_trl(loss_type, clipping):
  logp, old, sampler, ref, mask = _inputs(0.4 if clipping == "active" else 0.01)
  adv = ref_advantages(REWARDS, "group").astype(np.float32)
  spec = grpo.GrpoSpec(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=0.04,
                       sampler_is="token_truncate", is_max=1.5, max_completion_length=10)
  loss, metrics = grpo.grpo_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), spec,
                                 old_logps=jnp.asarray(old), sampler_logps=jnp.asarray(sampler),
                                 ref_logps=jnp.asarray(ref))
  want, want_metrics = ref_loss(logp, adv, mask, loss_type=loss_type, beta=0.04, old=old, sampler=sampler,
                                ref=ref, is_mode="token_truncate", is_max=1.5, max_len=10)
  assert loss.dtype == jnp.float32
  _close(loss, want, loss_type)
  assert set(metrics) == set(want_metrics)
  for k, v in want_metrics.items():
    _close(metrics[k], v, k)
  region = float(metrics["clip_ratio/region_mean"])
  assert (region > 0.1) if clipping == "active" else region == 0.0
  assert float(metrics["sampling/importance_sampling_ratio/max"]) == np.float32(1.5)  # truncation acts


@pytest.mark.parametrize("mode", grpo.SAMPLER_IS)
def test_sampler_importance_weights_in_each_mode_and_off(mode):
  logp, old, sampler, _, mask = _inputs(0.1, seed=1)
  sampler[2, 1] = np.nan  # a token the sampler could not score: no correction
  adv = ref_advantages(REWARDS, "group").astype(np.float32)
  spec = grpo.GrpoSpec(loss_type="bnpo", sampler_is=mode, is_min=0.5, is_max=1.5)
  loss, metrics = grpo.grpo_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), spec,
                                 old_logps=jnp.asarray(old), sampler_logps=jnp.asarray(sampler))
  want, want_metrics = ref_loss(logp, adv, mask, loss_type="bnpo", eps_high=0.2, old=old, sampler=sampler,
                                is_mode=mode, is_min=0.5, is_max=1.5)
  _close(loss, want, mode)
  for k, v in want_metrics.items():
    _close(metrics[k], v, k)
  unweighted, _ = ref_loss(logp, adv, mask, loss_type="bnpo", eps_high=0.2, old=old)
  assert (abs(want - unweighted) > 1e-3) == (mode != "off")


def test_one_iteration_is_the_detached_policy_and_dapo_takes_the_steps_token_count():
  logp, _, _, _, mask = _inputs(0.0)
  adv = jnp.asarray(ref_advantages(REWARDS, "none").astype(np.float32))
  spec = grpo.GrpoSpec(loss_type="dapo", sampler_is="off")
  alone, _ = grpo.grpo_loss(jnp.asarray(logp), adv, jnp.asarray(mask), spec)
  given, _ = grpo.grpo_loss(jnp.asarray(logp), adv, jnp.asarray(mask), spec, old_logps=jnp.asarray(logp))
  _close(alone, float(given), "old_logps=None")
  _close(alone, ref_loss(logp, np.asarray(adv), mask, loss_type="dapo")[0], "dapo")
  half, _ = grpo.grpo_loss(jnp.asarray(logp), adv, jnp.asarray(mask), spec, num_tokens=2 * mask.sum())
  _close(half, float(alone) / 2, "num_tokens")


def test_gradient_matches_finite_differences_of_the_reference():
  logp, old, sampler, ref, mask = _inputs(0.1, seed=2)
  adv = ref_advantages(REWARDS, "group").astype(np.float32)
  spec = grpo.GrpoSpec(loss_type="grpo", beta=0.1, sampler_is="token_truncate", is_max=1.5)
  grad = jax.grad(lambda lp: grpo.grpo_loss(lp, jnp.asarray(adv), jnp.asarray(mask), spec, old_logps=old,
                                            sampler_logps=sampler, ref_logps=ref)[0])(jnp.asarray(logp))
  f = lambda lp: ref_loss(lp, adv, mask, loss_type="grpo", eps_high=0.2, beta=0.1, old=old, sampler=sampler,
                          ref=ref, is_mode="token_truncate", is_max=1.5)[0]
  h, fd = 1e-6, np.zeros((N, T))
  base = logp.astype(np.float64)
  for i, j in zip(*np.nonzero(mask)):
    e = np.zeros((N, T))
    e[i, j] = h
    fd[i, j] = (f(base + e) - f(base - e)) / (2 * h)
  np.testing.assert_allclose(np.asarray(grad, np.float64), fd, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_masked_positions_get_exactly_zero_gradient_whatever_they_hold(loss_type):
  logp, old, sampler, ref, mask = _inputs(0.3, seed=3)
  for a in (logp, old, sampler, ref):  # after EOS the arrays hold anything
    a[mask == 0] = np.float32(1e30)
  logp[3, -1] = -np.inf
  old[1, -1] = np.nan
  adv = jnp.asarray(ref_advantages(REWARDS, "group").astype(np.float32))
  spec = grpo.GrpoSpec(loss_type=loss_type, beta=0.04, sampler_is="sequence_truncate")
  loss_fn = lambda lp: grpo.grpo_loss(lp, adv, jnp.asarray(mask), spec, old_logps=old, sampler_logps=sampler,
                                      ref_logps=ref)
  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(logp))
  grad = np.asarray(grad)
  assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in metrics.values())
  assert np.all(grad[mask == 0] == 0.0) and np.all(np.isfinite(grad))
  assert np.any(grad[mask > 0] != 0.0)
  # Without the KL term the zero-std group (rows 4 to 7) has no gradient at all.
  no_kl = dataclasses.replace(spec, beta=0.0)
  grad = jax.grad(lambda lp: grpo.grpo_loss(lp, adv, jnp.asarray(mask), no_kl, old_logps=old,
                                            sampler_logps=sampler)[0])(jnp.asarray(logp))
  assert np.all(np.asarray(grad)[4:8] == 0.0) and np.all(np.asarray(grad)[mask == 0] == 0.0)


def test_completion_mask_ends_at_the_first_eos():
  eos = 9
  ids = np.array([[1, 2, 9, 3, 9], [9, 1, 1, 1, 1], [1, 2, 3, 4, 5]])
  mask, truncated = grpo.completion_mask(jnp.asarray(ids), eos)
  want = np.zeros(ids.shape)
  for r, row in enumerate(ids):
    for t, tok in enumerate(row):
      want[r, t] = 1
      if tok == eos:
        break
  np.testing.assert_array_equal(np.asarray(mask), want)
  np.testing.assert_array_equal(np.asarray(truncated), [False, False, True])


def test_spec_refuses_unknown_names():
  with pytest.raises(ValueError, match="loss_type"):
    grpo.GrpoSpec(loss_type="ppo")
  with pytest.raises(ValueError, match="sampler_is"):
    grpo.GrpoSpec(sampler_is="truncate")
