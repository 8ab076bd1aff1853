"""The GRPO loop: a plan with objective 'grpo' in, a workdir of checkpoints and metrics out.

One GRPO step (`steps` counts them):
  1. rollout   the next prompts_per_step prompts (`PromptIterator`), G completions each,
               sampled on the device by the current policy (rollout.py), the sampler's
               log-probabilities kept;
  2. rewards   the completions decoded to text and scored on the host (rewards.py), the
               group-relative advantages computed (grpo.py);
  3. train     the rollout policy's and reference's log-probabilities by one forward pass
               when needed (num_iterations > 1, beta > 0), then num_iterations optimizer
               steps on the batch with the clipped objective (grpo_step.py).
The goodput splits the wall time into rollout, reward and step (train) phases.

The prompt iterator and the sampler's key travel together (`PromptStream`) as the data
iterator every checkpoint stores, so a resumed run draws the prompts and completions the
uninterrupted one drew; the train state's key draws LoRA's dropout as in step.py.
Checkpoints are numbered by GRPO step. The workdir's lock is loop.train's; the resume checks,
the guarded saves and the close are session.py's, as for loop.py.

Sections: config, mesh, prompts and rewards, model and optimizer, checkpoint and resume,
hooks, loop; the step's parts below (`Rollouts`, `score`, the log and eval hooks).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import tqdm

from mamba_train.data import prompts as prompts_lib, tokenizer as tokenizer_lib
from mamba_train.metrics import Timer
from mamba_train.parallel import sharding
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train import goodput as goodput_lib, grpo as grpo_lib, grpo_step, hooks, rewards, session
from mamba_train.train.run_config import ConfigError, GrpoPlan, Plan
from mamba_train.train.state import trainable
from mamba_train.train.step import model_of
from mamba_train.workdir import checkpoint, record


def run(plan: Plan, workdir: str, stamp: str, force_resume: bool, gp: goodput_lib.Goodput) -> None:
  """loop.train's body for objective 'grpo' (the workdir is locked)."""

  # ===== config =====
  config, g = plan.config, plan.grpo
  is_main = jax.process_index() == 0
  ckpt = checkpoint.Checkpointer(workdir, keep=config.checkpoint_keep, local_dir=config.checkpoint.local_dir)
  session.check_resumable(ckpt, plan, force=force_resume)

  # ===== mesh =====
  mesh = make_mesh(config.mesh, shape=plan.mesh_shape)
  logging.info("mesh %s over %d %s devices", dict(mesh.shape), mesh.size, plan.platform)

  # ===== prompts and rewards =====
  tok = tokenizer_lib.load_tokenizer(g.tokenizer)
  if tok.vocab_size > plan.model.vocab_size:
    raise ConfigError(f"grpo.tokenizer {g.tokenizer!r} has {tok.vocab_size} tokens, more than the model's "
                      f"vocab_size {plan.model.vocab_size}: use the tokenizer the model was trained with")
  prompt_set = prompts_lib.load_prompts(g.prompts, tokenizer=g.tokenizer, eval_fraction=g.eval_fraction,
                                        seed=config.seed)
  stream = PromptStream(prompts_lib.PromptIterator(prompt_set.train, g.prompts_per_step, config.seed),
                        config.seed)
  rollouts = Rollouts(plan, tok, mesh)

  # ===== model and optimizer, sharded =====
  built, run_record = session.build_state(plan, mesh, ckpt, workdir, force=force_resume, build=grpo_step.build)

  # ===== checkpoint and resume =====
  state, _, restored_step = session.resume(ckpt, built.state, stream, workdir, gp)
  start_step = restored_step or 0
  ckpt.preflight(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainable(state))))
  preemption = hooks.PreemptionWatcher()

  # ===== hooks =====
  writer = record.MetricsWriter(workdir, wandb_cfg={**config.wandb, "name": config.wandb.name
                                                    or f"{config.name}-{stamp}"},
                                run_config=plan.config_dict(), is_main=is_main, resumed_from=restored_step,
                                tensorboard=config.tensorboard)
  bar = tqdm.tqdm(total=config.steps, initial=start_step, disable=not is_main, dynamic_ncols=True)
  save = session.guarded_save(ckpt, stream, run_record, writer)
  guard = hooks.NonFiniteGuard(config.optim.max_nonfinite_steps, config.steps * g.num_iterations)
  periodic = [
      hooks.Hook("save_failed", 1, lambda *_: ckpt.check()),
      hooks.Hook("log", config.log_every, log_hook(writer, gp, bar)),
      hooks.Hook("checkpoint", config.checkpoint_every, gp.hook("checkpoint_save", save)),
      hooks.Hook("local_checkpoint", config.checkpoint.local_every,
                 gp.hook("checkpoint_save", session.guarded_save(ckpt, stream, run_record, writer, local=True)),
                 at_end=False),
      hooks.Hook("eval", config.eval_every if prompt_set.eval else 0,
                 gp.hook("eval", eval_hook(plan, rollouts, prompt_set, writer))),
  ]

  # ===== loop =====
  step, done, metrics = start_step, start_step, None
  gp.setup_done()
  try:
    while step < config.steps:
      step += 1
      batch = next(stream)
      with gp.phase("rollout"):
        ro, rollout_s = rollouts.sample(state, batch, stream.next_key())
      with gp.phase("reward"):
        inputs, host = score(g, tok, prompt_set.field_names, batch, ro)
      host |= {"rollout/tokens_per_s": host["completions/tokens"] / max(rollout_s, 1e-9),
               "rollout/seconds": rollout_s}
      with gp.phase("step"):
        state, metrics = train(built, state, inputs, mesh, g, guard, host)
      bar.update(1)
      hooks.run_hooks(periodic, step, config.steps, state, metrics)
      done = step
      if preemption.stop_requested():
        logging.warning("SIGTERM received: saving step %d and exiting", step)
        break
    guard.finish()
    if done != ckpt.last_saved and done not in ckpt.steps() and done > start_step:
      gp.hook("checkpoint_save", save)(done, state, metrics, force=True)
  finally:
    bar.close()
    session.close(ckpt, writer, gp, guard, done=done, steps=config.steps, workdir=workdir)


# ----------------------------------------------------------------------------
# A step's parts: the prompt stream, the rollout, the scoring, the optimizer steps.


class PromptStream:
  """The prompt iterator and the sampler's key, saved together as the run's data iterator
  (a JSON dict through the Checkpointer): a resumed run samples what the uninterrupted one did."""

  def __init__(self, prompts: prompts_lib.PromptIterator, seed: int):
    self.prompts = prompts
    self.key = np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), 0x5A3), np.uint32)

  def __next__(self) -> list[prompts_lib.Prompt]:
    return next(self.prompts)

  def next_key(self) -> jax.Array:
    """A fresh key for one rollout; the stream's key moves on."""
    key, sub = jax.random.split(jax.numpy.asarray(self.key))
    self.key = np.asarray(key, np.uint32)
    return sub

  def get_state(self) -> dict:
    return {"prompts": self.prompts.get_state(), "sampler_key": [int(x) for x in self.key]}

  def set_state(self, state: dict) -> None:
    self.prompts.set_state(state["prompts"])
    self.key = np.asarray(state["sampler_key"], np.uint32)


class Rollouts:
  """Samples a batch of prompts' completions from a state's policy (its adapters merged), the
  rows split over the mesh's data-parallel devices (rollout.py's sharding); the completions
  come back whole to every process, which scores them all."""

  def __init__(self, plan: Plan, tok: tokenizer_lib.TokenizerInfo, mesh):
    self.plan, self.tok, self.mesh = plan, tok, mesh
    self.token_bytes = (tokenizer_lib.token_bytes(tok.tokenizer, plan.model.vocab_size)
                        if plan.grpo.stop else None)

  def sample(self, state, batch, key, *, group_size: int | None = None, temperature: float | None = None):
    """-> (the rollout.Rollout of `batch`'s prompts, its seconds)."""
    from mamba_train import rollout  # the on-device sampler (rollout.py)
    g, plan = self.plan.grpo, self.plan
    model = model_of(state.params, state.frozen, plan.model, plan.runtime, plan.lora).merged()
    with Timer() as t, sharding.use_rules(self.mesh):
      ro = rollout.rollout(model, [np.asarray(p.ids, np.int32) for p in batch],
                           g.num_generations if group_size is None else group_size, g.max_new_tokens, key=key,
                           temperature=g.temperature if temperature is None else temperature, top_k=g.top_k,
                           top_p=g.top_p, eos_id=self.tok.eos_id, pad_id=0, stop_strings=g.stop,
                           token_bytes=self.token_bytes)
    return ro, t.seconds


def decode(tok: tokenizer_lib.TokenizerInfo, ro) -> tuple[list[str], list[list[int]]]:
  """A rollout's completions as text (EOS dropped) and as token ids (up to and including EOS)."""
  ids = [row[m].tolist() for row, m in zip(np.asarray(ro.completion_ids), np.asarray(ro.completion_mask, bool))]
  eos = tok.eos_id
  return tok.tokenizer.decode_batch([i[:-1] if i and i[-1] == eos else i for i in ids],
                                    skip_special_tokens=True), ids


def score(g: GrpoPlan, tok, field_names, batch, ro):
  """-> (the train step's host inputs with the advantages, the host metrics): the rewards of
  each function, combined, and the group advantages; the completions' lengths."""
  group_size, eos = g.num_generations, tok.eos_id
  texts, ids = decode(tok, ro)
  prompts, fields = prompts_lib.reward_inputs(batch, field_names, group_size)
  per_func = rewards.score(g.reward_funcs, prompts, texts, fields, completion_ids=ids,
                           max_completion_length=g.max_new_tokens)
  total = rewards.combine(per_func, [f.weight for f in g.reward_funcs])
  adv, stats = grpo_lib.advantages(jax.numpy.asarray(total), group_size, g.spec.scale_rewards)
  lengths = np.asarray(ro.completion_mask, bool).sum(1)
  ended = np.array([bool(i) and i[-1] == eos for i in ids])
  mask = np.asarray(ro.completion_mask, bool)
  sampler = np.where(mask, np.asarray(ro.logprobs, np.float32), 0.0)
  host = {**rewards.reward_metrics(g.reward_funcs, per_func), **{k: float(v) for k, v in stats.items()},
          "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
          "completions/min_length": float(lengths.min()),
          "completions/clipped_ratio": float(np.mean(lengths >= g.max_new_tokens) if len(lengths) else 0.0),
          "completions/ended_ratio": float(ended.mean()), "completions/tokens": float(mask.sum()),
          # The sampled tokens' mean surprisal: a Monte Carlo estimate of the policy's entropy per token.
          "entropy": float(-sampler.sum() / max(mask.sum(), 1))}
  inputs = {"prompt_ids": np.asarray(ro.prompt_ids, np.int32), "prompt_mask": np.asarray(ro.prompt_mask, bool),
            "completion_ids": np.asarray(ro.completion_ids, np.int32), "completion_mask": mask,
            "sampler_logps": sampler.astype(np.float32), "advantages": np.asarray(adv, np.float32)}
  return inputs, host


def train(built: grpo_step.Built, state, inputs: dict, mesh, g: GrpoPlan, guard: hooks.NonFiniteGuard,
          host: dict):
  """num_iterations optimizer steps on one rollout batch -> (state, the step's metrics: the
  device metrics averaged over the iterations (the guard's of the last), and `host`'s)."""
  b_sh = grpo_step.batch_shardings(mesh, inputs)
  # Every process holds the whole rollout batch (the rollout gathers it for the rewards).
  batch = {k: sharding.from_host(v, b_sh[k]) for k, v in inputs.items()}
  with Timer() as t:
    if built.needs_logps:
      batch |= built.logps(state.params, state.frozen, batch)
    per_iteration = []
    for _ in range(g.num_iterations):
      state, m = built.train_step(state, batch)
      guard(int(state.step), state, m)
      per_iteration.append(m)
    per_iteration = jax.device_get(per_iteration)
  last = per_iteration[-1]
  metrics = {k: float(np.mean([m[k] for m in per_iteration])) for k in last}
  metrics |= {k: float(last[k]) for k in ("nonfinite_streak", "weight_jump", "param_norm", "lr")}
  positions = inputs["prompt_ids"].size + inputs["completion_ids"].size
  metrics |= host | {"train/tokens_per_s": positions * g.num_iterations / max(t.seconds, 1e-9),
                     "train/seconds": t.seconds}
  return state, metrics


# ----------------------------------------------------------------------------
# The log and eval hooks.


def log_hook(writer, gp: goodput_lib.Goodput, bar):
  """`log(step, state, metrics)`: the step's metrics and the goodput, one row of the record."""

  def log(step, state, metrics):
    writer.write(step, {**metrics, **gp.row()})
    bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.3f}")

  return log


def eval_hook(plan: Plan, rollouts: Rollouts, prompt_set: prompts_lib.PromptSet, writer):
  """`evaluate(step, state, metrics)`: the mean reward over the held-out prompts, one completion
  each at grpo.eval_temperature (0: greedy), per function and combined (eval_reward)."""
  g, seed = plan.grpo, plan.config.seed

  def evaluate(step, state, metrics):
    per_func = []
    for i, batch in enumerate(prompts_lib.eval_batches(prompt_set.eval, g.completions)):
      key = jax.random.fold_in(jax.random.PRNGKey(seed), i)  # the same draws at every evaluation
      # A short last batch is padded with its last prompt to the full batch (the rollouts'
      # n rows, which split over the devices: its decode program is theirs); the padding's
      # scores are dropped.
      n = len(batch)
      batch = batch + batch[-1:] * (g.completions - n)
      ro, _ = rollouts.sample(state, batch, key, group_size=1, temperature=g.eval_temperature)
      texts, ids = decode(rollouts.tok, ro)
      prompts, fields = prompts_lib.reward_inputs(batch, prompt_set.field_names)
      per_func.append(rewards.score(g.reward_funcs, prompts, texts, fields, completion_ids=ids,
                                    max_completion_length=g.max_new_tokens)[:n])
    row = {f"eval_{k}": v for k, v in rewards.reward_metrics(g.reward_funcs, np.concatenate(per_func)).items()}
    writer.write(step, row)
    logging.info("step %d: eval reward %.4f over %d prompts", step, row["eval_reward"], len(prompt_set.eval))

  return evaluate
