"""The trainer's guards: settings that cannot train are refused, a run whose loss stays
non-finite stops without saving a non-finite state, and a loss spike rolls back to
the last checkpoint and skips the batches since."""

import json
import subprocess

import pytest

from helpers import ROOT, complete_steps, patched, record_scalars, run_train, tensorboard_scalars, train_command


def test_validate_refuses_settings_that_cannot_train():
  from configs import base
  from mamba_train.train import run_config
  for key, value in (("lr", 0.0), ("lr", -1e-3), ("lr", float("nan")), ("b2", 1.0), ("eps", 0.0),
                     ("max_nonfinite_steps", -2)):
    c = base.get_config()
    c.optim[key] = value
    with pytest.raises(run_config.ConfigError, match=f"optim.{key} must be"):
      run_config.validate(c, num_devices=1)
  run_config.validate(base.get_config(), num_devices=1)  # the defaults pass

def test_nonfinite_guard_adapts_to_short_runs_and_counts_skips():
  from mamba_train.train import hooks
  assert hooks.nonfinite_limit(-1, 12) == 3 and hooks.nonfinite_limit(-1, 10_000) == 20
  assert hooks.nonfinite_limit(-1, 2) == 1 and hooks.nonfinite_limit(7, 12) == 7
  # 10 of 12 steps skipped, never 3 in a row: the streak never trips, the count does.
  guard = hooks.NonFiniteGuard(-1, 12)
  streaks = [0, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1]
  for step, streak in enumerate(streaks, 1):
    guard(step, None, {"nonfinite_streak": streak})
  with pytest.raises(hooks.NonFiniteLossError, match="7 of the 12 steps"):
    guard.finish()
  ok = hooks.NonFiniteGuard(-1, 12)
  for step in range(1, 13):
    ok(step, None, {"nonfinite_streak": int(step == 5)})
  ok.finish()
  assert ok.summary() == "1 of 12 steps skipped (non-finite loss or gradient)"

def test_diverging_short_run_fails_and_saves_no_nonfinite_state(tmp_path):
  """The reported run: lr 1e6 for 12 steps ended rc 0 with 10 losses null."""
  work = tmp_path / "run"
  r = run_train(work, "--config.steps=12", "--config.optim.lr=1e6", "--config.checkpoint_every=1")
  assert r.returncode == 1, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: the loss or gradient was non-finite for 3 steps in a row"), last
  rows = [json.loads(l) for l in open(work / "metrics.jsonl")]
  streak = {row["step"]: row["nonfinite_streak"] for row in rows if "loss" in row}
  assert streak and all(streak[s] == 0 for s in complete_steps(work))  # saved only finite states
  assert max(streak.values()) == 3
  r = run_train(work, "--config.steps=12", "--config.optim.lr=-1")
  assert r.returncode == 2, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == ("error: Invalid run config: optim.lr must be a finite "
                                               "number > 0 (a zero or negative rate never learns), got -1.0")

POISON = 14

POISON_PATCH = f"""
from mamba_train.train import step as _step
_real, _calls = _step.to_global, [0]
def _poisoned(batch, mesh):
  _calls[0] += 1
  if _calls[0] == {POISON}:  # call n carries the batch of step n (the first is fetched before the loop)
    batch = dict(batch, targets=(batch["targets"] + 32) % 64)
  return _real(batch, mesh)
_step.to_global = _poisoned
"""

def test_loss_spike_rolls_back_and_skips_the_batches(tmp_path):
  work = tmp_path / "run"
  cmd, env = train_command(work, ["--config.steps=18", "--config.checkpoint_every=4", "--config.optim.lr=1e-2",
                             "--config.model.vocab_size=64", "--config.optim.spike_factor=1.5",
                             "--config.optim.spike_window=6"], 1)
  cmd = patched(cmd, POISON_PATCH)
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"loss spike at step {POISON}" in r.stderr and "rolled back to step 12 and skipped batches 13..14" in r.stderr
  rows = [json.loads(l) for l in open(work / "metrics.jsonl")]
  marker = next(row for row in rows if row.get("event") == "rolled_back")
  assert marker["step"] == 12 and marker["spike_step"] == POISON
  trained = [row["step"] for row in rows if "loss" in row]
  assert trained == list(range(1, 19))  # each step once: the spiking steps 13, 14 set aside
  aside = [json.loads(l) for l in open(work / "metrics.jsonl.after-12")]
  spiked = next(row["loss"] for row in aside if row["step"] == POISON)
  assert spiked > 1.5 * max(row["loss"] for row in rows if "loss" in row and row["step"] > 8)
  assert complete_steps(work)[-1] == 18
  # TensorBoard's events were rebuilt at the roll-back: the spiking steps' first values gone.
  assert tensorboard_scalars(work / "tensorboard") == record_scalars(rows)

BOMB = 7

# At the BOMB-th train step (a host-side count, read through io_callback), one parameter's
# update (the embedding's) is multiplied by 1e6 inside the guarded optimizer: a finite
# step that blows the weights up, as a bad batch or kernel would. The guard runs its
# inner transformation twice a step (once for its checks, once for the step applied:
# optim.guard), so the step is the count of calls halved.
BOMB_PATCH = f"""
import jax, jax.numpy as jnp, numpy as np, optax
from jax.experimental import io_callback
from mamba_train.train import optim as _optim
_calls = [0]
def _factor():
  _calls[0] += 1
  return np.float32(1e6 if (_calls[0] + 1) // 2 == {BOMB} else 1.0)
def _update(u, s, p=None):
  f = io_callback(_factor, jax.ShapeDtypeStruct((), jnp.float32))
  return dict(u, embedding=u["embedding"] * f), s
_bomb = optax.GradientTransformation(lambda p: optax.EmptyState(), _update)
_guard = _optim.guard
_optim.guard = lambda inner, **kw: (inner if isinstance(inner, _optim.GuardedTransformation)
                                    else _guard(optax.chain(inner, _bomb), **kw))
"""


def test_weight_guard_refuses_a_blown_up_parameter_before_it_is_saved(tmp_path):
  """The weight guard is on by default. Without the spike guard the blown-up step is skipped
  (its update refused, not saved) and the run goes on; with it the run rolls back to the
  step before and skips that batch. The two runs then train on the same batches from the
  same state, so the skipping run's steps after BOMB equal the rolled-back run's steps after
  BOMB - 1, bit for bit (the roll-back restores from disk: an independent path)."""
  common = ["--config.steps=10", "--config.checkpoint_every=1", "--config.optim.weight_guard_window=4"]
  procs = {}
  for name, extra in (("skip", []), ("roll", ["--config.optim.spike_factor=3"])):
    cmd, env = train_command(tmp_path / name, common + extra, 1)
    procs[name] = subprocess.Popen(patched(cmd, BOMB_PATCH), cwd=ROOT, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  out = {name: p.communicate(timeout=300) for name, p in procs.items()}
  for name, p in procs.items():
    assert p.returncode == 0, out[name][1][-3000:]
  rows = {name: [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")] for name in procs}
  skip = {r["step"]: r for r in rows["skip"] if "loss" in r}
  assert sorted(skip) == list(range(1, 11))
  assert [s for s, r in skip.items() if r["weight_jump"]] == [BOMB] and skip[BOMB]["nonfinite_streak"] == 1
  assert skip[BOMB]["update_norm"] > 1e3 * skip[BOMB - 1]["update_norm"]  # what was refused
  assert skip[BOMB]["param_norm"] == skip[BOMB - 1]["param_norm"]  # the weights as they were
  assert f"not saving step {BOMB}: its update was skipped" in out["skip"][1]
  assert "1 of 10 steps skipped (non-finite loss or gradient, or 1 for a weight jump)" in out["skip"][1]
  assert BOMB not in complete_steps(tmp_path / "skip")
  assert f"weight jump at step {BOMB}" in out["roll"][1] and f"rolled back to step {BOMB - 1}" in out["roll"][1]
  roll = {r["step"]: r for r in rows["roll"] if "loss" in r}
  assert sorted(roll) == list(range(1, 11)) and not any(r["weight_jump"] for r in roll.values())
  for s in range(BOMB + 1, 11):
    assert skip[s]["loss"] == roll[s - 1]["loss"], (s, skip[s]["loss"], roll[s - 1]["loss"])
    assert skip[s]["param_norm"] == roll[s - 1]["param_norm"]
