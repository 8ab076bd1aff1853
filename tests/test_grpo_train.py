"""The GRPO trainer (objective 'grpo'): a short run of configs/grpo.py on the synthetic task
(copy the last digit, scripts/grpo_task.py) raises the mean reward from near zero; a run
resumed from a checkpoint continues to the uninterrupted run's metrics, bit for bit (the
prompt iterator and the sampler's key are in the checkpoint); LoRA and QLoRA train the
adapters alone against the base as the reference; the prompt and after-EOS positions get
exactly zero gradient; a reward function that raises or returns the wrong number
of rewards, and a bad config, stop with one line (the wrong number's line is held in
test_grpo_inputs.py; here the run's own path, once, for a function that raises)."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import grpo as grpo_config
from mamba_train import rollout
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train import grpo_loop, grpo_step, run_config

from helpers import FAST_XLA, ROOT, patched, record_scalars, tensorboard_scalars

# Numbers of the run that are not timings.
TIMING = ("goodput", "rollout/", "train/", "event")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
  """The synthetic task's prompts file, as docs/finetuning.md makes it (scripts/grpo_task.py)."""
  path = tmp_path_factory.mktemp("task") / "task.jsonl"
  r = subprocess.run([sys.executable, str(ROOT / "scripts" / "grpo_task.py"), f"--out={path}", "--n=400"],
                     cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(path.read_text().splitlines()[0]).keys() == {"prompt", "answer"}
  return path


def _command(workdir, prompts, *extra, patch=""):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=FAST_XLA)
  cmd = [sys.executable, str(ROOT / "train.py"), "--workdir", str(workdir), "--config",
         str(ROOT / "configs" / "grpo.py"), f"--config.grpo.prompts={prompts}", "--config.wandb.mode=disabled",
         "--config.checkpoint_every=5", "--config.checkpoint_keep=0", "--config.eval_every=10", *extra]
  return (patched(cmd, patch) if patch else cmd), env


def _run(cmd, env, timeout=300):
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _rows(workdir):
  return [r for r in map(json.loads, open(workdir / "metrics.jsonl")) if "reward" in r]


@pytest.fixture(scope="module")
def task(tmp_path_factory, prompts):
  """(the prompts file, the workdir of an uninterrupted 20-step run)."""
  root = tmp_path_factory.mktemp("grpo")
  r = _run(*_command(root / "full", prompts, "--config.steps=20"))
  assert r.returncode == 0, r.stderr[-3000:]
  return prompts, root / "full"


def test_grpo_run_on_the_synthetic_task_raises_the_mean_reward(task):
  _, full = task
  rows = _rows(full)
  assert [r["step"] for r in rows] == list(range(1, 21))
  reward = [r["reward"] for r in rows]
  first, last = np.mean(reward[:5]), np.mean(reward[-5:])
  # From about 0.05 (a random byte is rarely near the digit) to about 0.6 by step 20.
  assert first < 0.2 and last > first + 0.3, reward
  r = rows[-1]
  for key in ("rewards/mamba_train.train.rewards:closeness/mean", "reward_std", "completions/mean_length",
              "completions/max_length", "clip_ratio/region_mean", "entropy", "zero_std_groups",
              "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
              "rollout/tokens_per_s", "train/tokens_per_s", "goodput/rollout_s", "goodput/reward_s",
              "goodput/step_s", "grad_norm", "lr"):
    assert key in r and np.isfinite(r[key]), key
  assert r["goodput/rollout_s"] > 0 and r["goodput/step_s"] > 0
  evals = [row for row in map(json.loads, open(full / "metrics.jsonl")) if "eval_reward" in row]
  assert [e["step"] for e in evals] == [10, 20] and all(0 <= e["eval_reward"] <= 1 for e in evals)
  # GRPO's figures in TensorBoard too, each at its step once.
  scalars = tensorboard_scalars(full / "tensorboard")
  assert scalars == record_scalars(map(json.loads, open(full / "metrics.jsonl"))) and "eval_reward" in scalars


def test_grpo_run_resumed_from_a_checkpoint_continues_to_the_uninterrupted_metrics(task, tmp_path):
  """The uninterrupted run's workdir cut back to its step-5 checkpoint (as if it had died
  there; test_checkpoint.py holds a SIGKILLed run's resume generically) resumes in a new
  process: steps 6-8 equal the uninterrupted run's bit for bit, the prompts and the
  sampler's key restored. (A constant rate: a run of 8 steps takes the 20-step run's first 8.)"""
  prompts, full = task
  cut = tmp_path / "cut"
  shutil.copytree(full, cut)
  for s in (10, 15, 20):
    shutil.rmtree(cut / "checkpoints" / str(s))
  (cut / "metrics.jsonl").unlink()
  r = _run(*_command(cut, prompts, "--config.steps=8"))
  assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
  state = json.loads((cut / "checkpoints" / "8" / "data").glob("*.json").__next__().read_text())
  assert state["prompts"]["position"] == 8 * 8 and len(state["sampler_key"]) == 2
  same = lambda row: {k: v for k, v in row.items() if not k.startswith(TIMING)}
  want = {row["step"]: same(row) for row in _rows(full)}
  got = {row["step"]: same(row) for row in _rows(cut)}
  assert sorted(got) == [6, 7, 8]
  for s in got:
    assert got[s] == want[s], s


def _plan(prompts, **grpo):
  c = grpo_config.get_config()
  c.grpo.update({"prompts": str(prompts), **grpo})
  return c


@pytest.mark.parametrize("base_dtype", ["", "int8"], ids=["lora", "qlora_int8"])
def test_lora_grpo_trains_the_adapters_alone_against_the_base(prompts, base_dtype):
  c = _plan(prompts, beta=0.1, num_generations=4, prompts_per_step=2, max_new_tokens=3)
  c.lora.update(rank=4, lr=0.05, base_dtype=base_dtype)
  c.model.n_layer = 1  # one adapted layer holds what two would
  plan = run_config.validate(c, num_devices=1, explicit=("lora.lr",))
  mesh = make_mesh(c.mesh, shape=plan.mesh_shape)
  built = grpo_step.build(plan, mesh)
  base = jax.device_get(built.state.frozen)
  adapters = jax.device_get(built.state.params)
  tok = grpo_loop.tokenizer_lib.load_tokenizer("byte")
  prompt_set = grpo_loop.prompts_lib.load_prompts(plan.grpo.prompts)
  batch = prompt_set.train[:2]
  ro, _ = grpo_loop.Rollouts(plan, tok, mesh).sample(built.state, batch, jax.random.PRNGKey(1))
  inputs, _ = grpo_loop.score(plan.grpo, tok, prompt_set.field_names, batch, ro)
  inputs["advantages"] = np.linspace(-1, 1, 8).astype(np.float32)  # a gradient whatever the rewards
  logps = built.logps(built.state.params, built.state.frozen, inputs)
  # The reference is the base with the adapters off: the policy itself at the start (B = 0).
  old = jax.jit(lambda params, frozen: rollout.sequence_logprobs(  # jitted: op by op takes seconds
      grpo_loop.model_of(params, frozen, plan.model, plan.runtime, plan.lora),
      inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], 1.0))(built.state.params,
                                                                                  built.state.frozen)
  np.testing.assert_allclose(np.asarray(logps["ref_logps"]), np.asarray(old), rtol=1e-6)
  state = built.state
  for _ in range(3):  # the schedule's first step is its warmup's (rate 0)
    state, metrics = built.train_step(state, {**inputs, **logps})
  assert float(metrics["kl"]) > 0  # the third step's policy has left the base
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.frozen), base)
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), jax.device_get(state.params), adapters)
  assert max(jax.tree.leaves(moved)) > 0
  assert set(jax.tree.leaves(jax.tree.map(lambda x: x.shape[-1] == 4 or x.shape[-2] == 4, adapters)))  == {True}


def test_prompt_and_after_eos_positions_get_exactly_zero_gradient(prompts):
  """The trainer's path (grpo_step: sequence_logprobs, then grpo_loss): the gradient of the loss
  with respect to the hidden state at each position, where the LM head reads it, is exactly
  zero where that position predicts a prompt token or a token after the completion's end,
  and not zero where it predicts a scored token. And the jitted step itself: garbage in the
  prompts' padding and after each completion's end (ids and sampler log-probabilities)
  leaves its loss, gradient norm and new weights bit for bit the same."""
  c = _plan(prompts, num_generations=4, prompts_per_step=2, max_new_tokens=4)
  c.model.n_layer = 1
  plan = run_config.validate(c, num_devices=1)
  g = plan.grpo
  built = grpo_step.build(plan, make_mesh(c.mesh, shape=plan.mesh_shape))
  rng = np.random.default_rng(0)
  n, lp, t = 8, 8, 4
  prompt_len = np.array([3, 3, 3, 3, 8, 8, 8, 8])
  prompt_mask = np.arange(lp)[None] >= lp - prompt_len[:, None]  # left-padded
  lengths = np.array([0, 1, 2, 4, 3, 4, 1, 2])  # 4: no EOS within max_new_tokens
  completion_mask = np.arange(t)[None] < lengths[:, None]
  clean = {"prompt_ids": np.where(prompt_mask, rng.integers(1, 256, (n, lp)), 0).astype(np.int32),
           "prompt_mask": prompt_mask,
           "completion_ids": np.where(completion_mask, rng.integers(1, 256, (n, t)), 0).astype(np.int32),
           "completion_mask": completion_mask,
           "sampler_logps": np.where(completion_mask, -rng.uniform(1, 8, (n, t)), 0).astype(np.float32),
           "advantages": np.linspace(-1, 1, n).astype(np.float32)}

  state = built.state
  model = grpo_loop.model_of(state.params, state.frozen, plan.model, plan.runtime, plan.lora)

  def loss_at(probe):
    def backbone(ids, mask):
      h, cache = model.backbone(ids, mask=mask)
      return h + probe, cache
    probed = type("Probed", (), {"backbone": staticmethod(backbone), "logits": staticmethod(model.logits)})
    logps = grpo_step._logprobs(probed, clean, g.temperature)
    return grpo_step.grpo_lib.grpo_loss(logps, clean["advantages"], completion_mask.astype(np.float32), g.spec,
                                        sampler_logps=clean["sampler_logps"])[0]

  grad = np.asarray(jax.jit(jax.grad(loss_at))(np.zeros((n, lp + t, plan.model.d_model), np.float32)))
  # Position i predicts token i + 1: prompt tokens from positions < lp - 1, completion token j from lp - 1 + j.
  scored = np.zeros((n, lp + t), bool)
  scored[:, lp - 1:lp - 1 + t] = completion_mask
  per_position = np.abs(grad).max(-1)
  assert (per_position[~scored] == 0).all(), per_position
  assert (per_position[scored] > 0).all(), per_position

  garbage = dict(clean)
  garbage["prompt_ids"] = np.where(prompt_mask, clean["prompt_ids"], rng.integers(1, 256, (n, lp))).astype(np.int32)
  garbage["completion_ids"] = np.where(completion_mask, clean["completion_ids"],
                                       rng.integers(1, 256, (n, t))).astype(np.int32)
  garbage["sampler_logps"] = np.where(completion_mask, clean["sampler_logps"], 1e3).astype(np.float32)
  runs = []
  for batch in (clean, garbage):
    new, m = built.train_step(jax.tree.map(jax.numpy.copy, state), batch)  # the step donates its state
    runs.append((jax.device_get(new.params), float(m["loss"]), float(m["grad_norm"])))
  assert runs[0][1:] == runs[1][1:] and runs[0][2] > 0
  jax.tree.map(np.testing.assert_array_equal, runs[0][0], runs[1][0])


def raises(prompts, completions, **_):
  raise KeyError("score")


def test_a_failing_reward_function_stops_the_run_with_one_line(tmp_path, prompts):
  says = "reward function test_grpo_train:raises raised KeyError: 'score' on prompt"
  cmd, env = _command(tmp_path / "w", prompts, "--config.steps=2", "--config.grpo.reward_funcs=test_grpo_train:raises",
                      "--config.grpo.prompts_per_step=2", "--config.grpo.max_new_tokens=2")
  env["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__))  # where the reward function is
  r = _run(cmd, env)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and lines[-1].startswith(f"error: {says}"), r.stderr[-3000:]
  assert "Traceback" not in r.stderr


def test_bad_grpo_configs_are_one_line_errors_before_anything_compiles(tmp_path, prompts):
  c = _plan(prompts, num_generations=1)
  with pytest.raises(run_config.ConfigError, match=r"^Invalid run config: grpo.num_generations must be an integer "
                     r">= 2 \(a group needs at least two completions to compare\), got 1$"):
    run_config.validate(c, num_devices=1)
  c = _plan(tmp_path / "missing.jsonl")
  with pytest.raises(run_config.ConfigError, match=r"missing.jsonl: cannot be read"):
    run_config.validate(c, num_devices=1)
  c = _plan(tmp_path / "no_answer.jsonl", reward_funcs="mamba_train.train.rewards:exact_answer")
  (tmp_path / "no_answer.jsonl").write_text('{"prompt": "1:"}\n')
  with pytest.raises(run_config.ConfigError, match=r"needs field 'answer'"):
    run_config.validate(c, num_devices=1)
  c = _plan(prompts, prompts_per_step=3, num_generations=3)
  c.mesh.update(data=2)
  with pytest.raises(run_config.ConfigError, match=r"grpo.prompts_per_step x num_generations 9 does not divide"):
    run_config.validate(c, num_devices=2)
  # The command line: one line, exit 2, nothing compiled.
  cmd, env = _command(tmp_path / "w", prompts, "--config.grpo.num_generations=1")
  r = _run(cmd, env)
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      "error: Invalid run config: grpo.num_generations must be an integer >= 2 (a group needs at least two "
      "completions to compare), got 1"], r.stderr[-3000:]
