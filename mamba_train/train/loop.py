"""The training loop: a run's plan (`run_config.validate`) in, a workdir of
checkpoints and metrics out.

`train` reads top to bottom in sections: config (the workdir, its lock and the
resume check), mesh, data, model and optimizer (sharded), checkpoint and resume,
step function, hooks, loop; the longer parts of a section are the functions below
it (`log_hook`, `eval_hook`) and the parts every loop shares (train/session.py: the
state built, the resume, the guarded save, the close). Periodic work hangs on the loop
as hooks (train/hooks.py); what the loop does about a loss spike (`RollBack`) is its
policy, below it. GRPO's loop (train/grpo_loop.py) is its own, over the same parts.
"""

from __future__ import annotations

import datetime
import logging
import math
import os

import jax
import numpy as np
import tqdm

from mamba_train import data, metrics as metrics_lib
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train import goodput as goodput_lib, hooks, inputs, run_config, session, step as steps
from mamba_train.train.run_config import ConfigError, Plan
from mamba_train.train.state import trainable, with_frozen
from mamba_train.workdir import checkpoint, record, storage
from mamba_train.workdir.lock import lock_workdir

MAX_ROLLBACKS = 3  # loss spikes a run may roll back from before it stops


def train(plan: Plan, workdir: str = "", *, force_resume: bool = False) -> None:
  """Train `plan` in `workdir` (default runs/<config name>-<time>), resuming from its
  newest complete checkpoint. `force_resume`: resume even if the checkpoints hold a
  different model config. Every process of a job calls it with the same arguments."""
  gp = goodput_lib.Goodput()  # the wall time from here on, by phase
  config = plan.config
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  if not workdir and jax.process_count() > 1:
    # Each process would stamp its own time: they must share one directory.
    raise ConfigError("--workdir is required when the job spans several processes "
                      "(a directory every process can reach, e.g. gs://BUCKET/runs/NAME)")
  workdir = workdir or os.path.join("runs", f"{config.name}-{stamp}")
  storage.check_workdir(workdir)  # a bucket that is not there, no gcs extra: said now
  lock = lock_workdir(workdir)  # before anything is read or written there
  try:
    if plan.grpo is not None:  # rollouts and rewards: a loop of its own (train/grpo_loop.py)
      from mamba_train.train import grpo_loop
      grpo_loop.run(plan, workdir, stamp, force_resume, gp)
    else:
      _run(plan, workdir, stamp, force_resume, gp)
  finally:
    lock.release()


def _run(plan: Plan, workdir: str, stamp: str, force_resume: bool, gp: goodput_lib.Goodput) -> None:

  # ===== config =====
  config = plan.config
  is_main = jax.process_index() == 0
  # A workdir that holds checkpoints of another model is refused before anything is written
  # (a LoRA run's base is checked once it is loaded, below, before config.json is written).
  ckpt = checkpoint.Checkpointer(workdir, keep=config.checkpoint_keep,
                                 local_dir=config.checkpoint.local_dir)
  session.check_resumable(ckpt, plan, force=force_resume)
  if plan.model_from_init:  # the recipe's model fields are a default; the weights say what they are
    logging.info("config.model from init_from %r: %s", config.init_from, ", ".join(
        f"{k}={theirs!r} (recipe: {ours!r})" for k, (ours, theirs) in plan.model_from_init.items()))

  # ===== mesh =====
  mesh = make_mesh(config.mesh, shape=plan.mesh_shape)
  logging.info("mesh %s over %d %s devices", dict(mesh.shape), mesh.size, plan.platform)

  # ===== data =====
  sources = inputs.data_sources(plan)
  train_loader, held_out = inputs.make_loaders(plan, sources, workdir)
  harness = make_harness(plan, inputs.tokenizer_path(sources), mesh)  # task names checked before compiling

  # ===== model and optimizer, sharded =====
  built, run_record = session.build_state(plan, mesh, ckpt, workdir, force=force_resume)

  # ===== checkpoint and resume =====
  # The newest complete checkpoint in the workdir, restored into this run's
  # shardings (which may differ from the saving run's), with the data iterator.
  state, target, restored_step = session.resume(ckpt, built.state, train_loader, workdir, gp)
  start_step = int(state.step)
  ckpt.preflight(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainable(state))))  # disk space
  preemption = hooks.PreemptionWatcher()

  # ===== step function =====
  with gp.phase("data"):
    first_host_batch = next(train_loader)
    first_batch = steps.to_global(first_host_batch, mesh)
  with gp.phase("compile"), metrics_lib.Timer() as compile_time:
    train_step = built.train_step.lower(state, first_batch).compile()
  logging.info("train step compiled in %.1f s", compile_time.seconds)
  log_memory_estimate(train_step)

  # ===== hooks =====
  writer = record.MetricsWriter(workdir, wandb_cfg={**config.wandb, "name": config.wandb.name
                                                    or f"{config.name}-{stamp}"},
                                run_config=plan.config_dict(), is_main=is_main,
                                resumed_from=restored_step, tensorboard=config.tensorboard)
  trace = hooks.StepTrace.from_config(config.profile, workdir, start_step, jax.process_index(),
                                      run_config.profile_processes(config.profile.processes, jax.process_count()))
  throughput = hooks.Throughput()
  share = data.SourceShare(list(held_out), config.seq_len)  # realised token share per source
  bar = tqdm.tqdm(total=config.steps, initial=start_step, disable=not is_main, dynamic_ncols=True)
  save = session.guarded_save(ckpt, train_loader, run_record, writer)
  guard = hooks.NonFiniteGuard(config.optim.max_nonfinite_steps, config.steps)
  spikes = hooks.SpikeGuard(config.optim.spike_factor, config.optim.spike_window)
  roll_back = RollBack(ckpt, target, train_loader, writer, spikes, bar)
  periodic = [
      hooks.Hook("nonfinite", 1, guard),
      hooks.Hook("save_failed", 1, lambda *_: ckpt.check()),  # a failed async save stops the run
      hooks.Hook("log", config.log_every, log_hook(plan, mesh, writer, throughput, share, gp, bar)),
      hooks.Hook("spike", 1 if config.optim.spike_factor > 0 else 0, spikes),  # before the save
      # Before eval: a failing evaluation cannot cost the step's checkpoint.
      # Asynchronous: returns once the state is copied to host memory.
      hooks.Hook("checkpoint", config.checkpoint_every, gp.hook("checkpoint_save", save)),
      hooks.Hook("local_checkpoint", config.checkpoint.local_every,
                 gp.hook("checkpoint_save", session.guarded_save(ckpt, train_loader, run_record, writer, local=True)),
                 at_end=False),
      hooks.Hook("eval", config.eval_every, gp.hook("eval", eval_hook(built, held_out, mesh, writer, throughput))),
      hooks.Hook("harness", config.harness.every if harness else 0, gp.hook(
          "eval", lambda step, state, _: harness(step, state.params, writer, throughput, state.frozen))),
  ]

  # ===== loop =====
  batch, step_metrics, done, step = first_batch, None, start_step, start_step
  share.add(first_host_batch)
  gp.setup_done()
  try:
    throughput.reset()
    while step < config.steps:
      with gp.phase("step"):  # the step and its hooks; their saves and evaluations apart
        step += 1
        if trace:
          trace.before(step)
        state, step_metrics = train_step(state, batch)
        if trace:
          trace.after(step, step_metrics)
        done = step
        throughput.tick()
        bar.update(1)
        try:
          hooks.run_hooks(periodic, step, config.steps, state, step_metrics)
        except hooks.LossSpike as spike:
          with gp.phase("checkpoint_restore"):
            state, step = roll_back(spike, state.frozen)
          step_metrics, done = None, step
      if preemption.stop_requested():  # SIGTERM: all processes agree, save, exit cleanly
        logging.warning("SIGTERM received: saving step %d and exiting", step)
        break
      if step < config.steps:
        with gp.phase("data"):
          host_batch = next(train_loader)
          share.add(host_batch)
          batch = steps.to_global(host_batch, mesh)
    guard.finish()
    final = int(state.step)
    if final != ckpt.last_saved and final not in ckpt.steps():  # at the end and on preemption
      gp.hook("checkpoint_save", save)(final, state, step_metrics, force=True)
  finally:
    if trace:
      trace.stop(done)
    bar.close()
    session.close(ckpt, writer, gp, guard, done=done, steps=config.steps, workdir=workdir)


# ----------------------------------------------------------------------------
# The sections' parts (the state built, the resume, the saves and the close: session.py).


def log_memory_estimate(compiled) -> None:
  """XLA's estimate of a compiled step's memory a device, in one line, where the backend
  gives one: what the step will need before it runs (per logged row, the record has what
  the device reports in use and at peak, `metrics.memory_stats`)."""
  mem = metrics_lib.compiled_memory(compiled)
  if mem:
    gib = {k: v / 2**30 for k, v in mem.items()}
    logging.info("XLA's memory estimate of the train step: %.3f GiB a device at peak (arguments %.3f, "
                 "outputs %.3f, temporaries %.3f, donated %.3f GiB)", gib["peak_bytes"], gib["argument_bytes"],
                 gib["output_bytes"], gib["temp_bytes"], gib["alias_bytes"])


def log_hook(plan: Plan, mesh, writer, throughput: hooks.Throughput, share, gp: goodput_lib.Goodput, bar):
  """`log(step, state, metrics)`: the step's metrics, speed, MFU, memory, the data
  sources' share and the goodput, one row of the record; the loss on the bar."""
  config = plan.config
  flops_per_token = metrics_lib.train_flops_per_token(plan.model, plan.runtime, config.seq_len)
  peak = metrics_lib.peak_flops_per_device(jax.devices()[0], config.peak_flops)
  tokens_per_step = config.batch_size * config.seq_len

  def log(step, state, metrics):
    m = {k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()  # (per-expert tokens: lists)
         for k, v in jax.device_get(metrics).items()}
    speed = throughput.read(tokens_per_step)
    row = {"loss": m["loss"], "ppl": math.exp(min(m["loss"], 80.0)), "grad_norm": m["grad_norm"],
           "param_norm": m["param_norm"], "update_norm": m["update_norm"], "lr": m["lr"], **speed,
           "mfu": metrics_lib.mfu(speed["tokens_per_sec"], flops_per_token, peak, mesh.size),
           "nonfinite_streak": m["nonfinite_streak"], "weight_jump": m["weight_jump"],
           **metrics_lib.memory_stats(jax.local_devices()[0]),
           **share.read(), **{k: m[k] for k in steps.DPO_METRICS + steps.ROUTER_METRICS if k in m}, **gp.row()}
    writer.write(step, row)
    bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{speed['tokens_per_sec']:.0f}")

  return log


def eval_hook(built, held_out: dict, mesh, writer, throughput: hooks.Throughput):
  """`evaluate(step, state, metrics)`: the loss on every held-out source, pooled and
  per source, one row of the record."""

  def evaluate(step, state, metrics):
    rows = {name: steps.evaluate(built.eval_step, state.params,
                                 (steps.to_global(b, mesh) for b in batches()), frozen=state.frozen)
            for name, batches in held_out.items()}
    row = steps.pool_eval(rows.values())  # over all sources' tokens
    for name, r in rows.items():
      if name:
        row.update({f"{k}/{name}": v for k, v in r.items()})
    writer.write(step, row)
    logging.info("step %d: eval loss %.4f", step, row["eval_loss"])
    throughput.reset()  # evaluation time is not training time

  return evaluate


# ----------------------------------------------------------------------------
# The roll-back after a loss spike.


class RollBack:
  """After a loss spike: back to the newest checkpoint (before the spike: the spiking
  step is never saved), then past the batches since it, which the next steps would
  otherwise see again. At most MAX_ROLLBACKS times a run."""

  def __init__(self, ckpt: checkpoint.Checkpointer, target, train_loader, writer,
               spikes: hooks.SpikeGuard, bar):
    self.ckpt, self.target, self.train_loader = ckpt, target, train_loader
    self.writer, self.spikes, self.bar = writer, spikes, bar
    self.rollbacks: list[int] = []  # the steps that spiked

  def __call__(self, spike: hooks.LossSpike, frozen=None):
    """-> (the restored state, its step). `frozen`: the LoRA base, which checkpoints do not hold."""
    self.ckpt.manager.wait_until_finished()
    back, restored = self.ckpt.restore(self.target, self.train_loader)
    rollbacks = self.rollbacks
    if back is None or len(rollbacks) >= MAX_ROLLBACKS:
      raise hooks.NonFiniteLossError(f"{spike}; " + (
          "no checkpoint to roll back to" if back is None else
          f"already rolled back {len(rollbacks)} times ({rollbacks})") + ". Lower optim.lr or check the data.")
    for _ in range(spike.step - back):
      next(self.train_loader)
    rollbacks.append(spike.step)
    logging.warning("%s: rolled back to step %d and skipped batches %d..%d", spike, back, back + 1,
                    spike.step)
    self.writer.rewind(back, {"event": "rolled_back", "spike_step": spike.step, "spike_loss": spike.loss,
                              "skipped_batches": [back + 1, spike.step]})
    self.spikes.reset()
    self.bar.n = back
    return with_frozen(restored, frozen), back


# ----------------------------------------------------------------------------
# The harness hook.


def make_harness(plan: Plan, tokenizer_path: str, mesh=None):
  """`fn(step, params, writer, throughput, frozen=None)` running config.harness.tasks with
  lm-evaluation-harness and logging harness/<task>/<metric>; None when off.

  In a multi-process job every process calls it: the parameters are sharded over
  the processes, so no process can run the model's forward alone, and lm-eval builds
  the same requests in the same order everywhere, so all run the same programs (see
  mamba_train/interop/eval_harness.py), each data-parallel replica of `mesh` (the run's)
  scoring its share of the rows. Only process 0's writer writes."""
  h = plan.config.harness
  if not (h.tasks and h.every > 0):
    return None
  try:
    from mamba_train.interop import eval_harness
  except ImportError as e:
    raise ConfigError(f"config.harness.tasks needs lm-eval ({e}): "
                      "pip install -e '.[eval]'") from None
  from mamba_train.data.tokenizer import load_tokenizer
  tasks = h.tasks.split(",")
  try:
    eval_harness.parse_batch_size(h.batch_size)
    manager = eval_harness.task_manager(h.include_path, tasks)
    tasks = eval_harness.check_tasks(tasks, manager)
  except ValueError as e:
    raise ConfigError(f"config.harness: {e}") from None
  tokenizer = load_tokenizer(tokenizer_path)
  if jax.process_index() != 0:  # the same tables and progress bars as process 0's
    logging.getLogger("lm_eval").setLevel(logging.WARNING)

  def run(step, params, writer, throughput, frozen=None):
    model = steps.model_of(params, frozen, plan.model, plan.runtime, plan.lora).merged()
    lm = eval_harness.HarnessLM(model, tokenizer, batch_size=h.batch_size,
                                max_batch_size=h.max_batch_size, mesh=mesh)
    results = eval_harness.run_tasks(lm, tasks, manager=manager, limit=h.limit or None,
                                     num_fewshot=None if h.num_fewshot < 0 else h.num_fewshot,
                                     bootstrap_iters=0, env_info=False)
    writer.write(step, eval_harness.flat_metrics(results))
    throughput.reset()  # evaluation time is not training time
  return run
