"""Train a Mamba-2 language model.

  python train.py                                     # the tiny default, a few minutes on a CPU
  python train.py --config configs/130m.py --workdir runs/130m --config.steps=1000
  python train.py --config configs/tiny.py --config.optim.lr=1e-3 --config.mesh.fsdp=-1 --config.mesh.data=1

Reads top to bottom: config, mesh, data, model and optimizer (sharded), step
function, checkpoint and resume, loop. Periodic work hangs on the loop as hooks.
"""

import datetime
import functools
import itertools
import json
import logging
import math
import os
import re
import sys

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend (see the module)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tqdm  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import base  # noqa: E402
from mamba_train import data, errors  # noqa: E402
from mamba_train import metrics as metrics_lib  # noqa: E402
from mamba_train.interop.load import load_model  # noqa: E402
from mamba_train.model.config import FINETUNE_MAY_CHANGE, NOT_IN_WEIGHTS  # noqa: E402
from mamba_train.parallel import distributed  # noqa: E402
from mamba_train.parallel.mesh import make_mesh  # noqa: E402
from mamba_train.train import hooks, run_config, step as steps  # noqa: E402
from mamba_train.train.state import with_shardings  # noqa: E402
from mamba_train.workdir import checkpoint, record, storage  # noqa: E402
from mamba_train.workdir.lock import lock_workdir  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
# A misspelt --config.key or a bad value: ml_collections raises it as one of these, with
# a traceback, and for the default --config already here, where the flag is defined.
FLAG_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError)


def bad_flag(e: Exception):
  """One line and exit 2 (the traceback with --debug)."""
  if "--debug" in sys.argv:
    raise e
  text = " ".join(str(e).replace("\\n", "\n").replace("\\'", "'").split())
  if len(text) > 1 and text[0] == text[-1] == "'":  # KeyError inside AttributeError: quoted
    text = text[1:-1]
  print(f"error: bad flag or --config override: {text} (flags: --help; config keys: "
        "configs/base.py)", file=sys.stderr)
  sys.exit(2)


try:
  _CONFIG = config_flags.DEFINE_config_file(
      "config", os.path.join(_HERE, "configs", "tiny.py"), "Run config file (configs/*.py).")
except FLAG_ERRORS as e:
  bad_flag(e)
_FORCE_RESUME = flags.DEFINE_bool(
    "force_resume", False, "Resume a workdir even if its checkpoints hold a different model config.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Output directory; default runs/<config name>-<time>.")
# Multi-process jobs (mamba_train/distributed.py). On a TPU pod, under SLURM or Open MPI
# these are detected; elsewhere give all three, the same address to every process.
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Processes in the job (0 = detect).")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "This process's rank (-1 = detect).")
_INIT_TIMEOUT = flags.DEFINE_integer("init_timeout", 300, "Seconds to wait for all processes to join.")
_DEBUG = flags.DEFINE_bool("debug", False, "Show the traceback of a configuration or data error.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", 100, "Seconds of silence after which a process counts as dead and the job stops.")


def data_sources(config):
  """(the prepared datasets a corpus run reads, its weight schedule)."""
  if config.data.mixture:
    sources = data.parse_mixture(config.data.mixture)
    return sources, data.parse_schedule(config.data.mixture_schedule, len(sources))
  dir_ = config.data.dir or data.ensure_default_corpus(os.path.join(_HERE, "data"))
  return [data.Source(dir_, 1.0)], []


def make_loaders(config, model_cfg, workdir=None):
  """(train iterator, {source name: factory of eval-batch iterators}), both yielding
  this process's rows. One unnamed ('') eval source unless config.data.mixture is set."""
  kw = dict(seq_len=config.seq_len, global_batch_size=config.batch_size,
            process_index=jax.process_index(), process_count=jax.process_count())
  if config.data.source == "synthetic":
    train = data.SyntheticLoader(vocab_size=model_cfg.vocab_size, seed=config.seed, **kw)
    held_out = lambda: itertools.islice(
        data.SyntheticLoader(vocab_size=model_cfg.vocab_size, seed=config.seed + 7919, **kw),
        config.eval_batches)
    return train, {"": held_out}
  sources, schedule = data_sources(config)
  try:  # a missing source, another tokenizer or vocabulary: refused before compiling
    metas = [data.read_metadata(s.dir) for s in sources]
    for m in metas:
      data.validate_for_model(m, model_cfg.vocab_size)
    data.check_sources(sources, metas, config.seq_len)
    no_val = [s.dir for s, m in zip(sources, metas) if "validation" not in m["splits"]]
    if config.eval_every > 0 and no_val:
      raise ValueError(f"{no_val} hold no validation split; prepare them with a nonzero "
                       "val_fraction, or set eval_every=0")
  except (OSError, ValueError) as e:
    raise run_config.ConfigError(str(e)) from None
  # Every split the run will read, now: a damaged validation shard must not wait for the first eval.
  for s in sources:
    data.check_splits(s.dir, ["train"] + (["validation"] if config.eval_every > 0 else []),
                      config.seq_len)
  tokenizer = os.path.join(sources[0].dir, "tokenizer.json")
  if workdir and jax.process_index() == 0 and os.path.exists(tokenizer):
    with open(tokenizer) as f:  # exports ship it
      storage.write_text(storage.path(workdir) / "tokenizer.json", f.read())
  train = data.make_mixture_loader(sources, seed=config.seed, schedule=schedule, **kw)
  named = len(sources) > 1
  held_out = {s.name if named else "": functools.partial(
      data.make_eval_loader, s.dir, num_batches=config.eval_batches, **kw) for s in sources}
  return train, held_out


def make_harness(config, model_cfg, tokenizer_path):
  """`fn(step, params, writer, throughput)` running config.harness.tasks with
  lm-evaluation-harness and logging harness/<task>/<metric>; None when off.

  In a multi-process job every process calls it: the parameters are sharded over
  the processes, so no process can run the model's forward alone, and lm-eval builds
  the same requests in the same order everywhere, so all run the same programs (see
  mamba_train/eval_harness.py). Only process 0's writer writes."""
  h = config.harness
  if not (h.tasks and h.every > 0):
    return None
  try:
    from mamba_train import eval_harness
  except ImportError as e:
    raise run_config.ConfigError(f"config.harness.tasks needs lm-eval ({e}): "
                                 "pip install -e '.[eval]'") from None
  from mamba_train import Mamba2LM
  from mamba_train.data.tokenizer import load_tokenizer
  tasks = h.tasks.split(",")
  try:
    eval_harness.parse_batch_size(h.batch_size)
    manager = eval_harness.task_manager(h.include_path, tasks)
    tasks = eval_harness.check_tasks(tasks, manager)
  except ValueError as e:
    raise run_config.ConfigError(f"config.harness: {e}") from None
  tokenizer = load_tokenizer(tokenizer_path)
  runtime = run_config.runtime(config).resolve(jax.devices()[0].platform)
  if jax.process_index() != 0:  # the same tables and progress bars as process 0's
    logging.getLogger("lm_eval").setLevel(logging.WARNING)

  def run(step, params, writer, throughput):
    lm = eval_harness.HarnessLM(Mamba2LM.from_params(model_cfg, params, runtime), tokenizer,
                                batch_size=h.batch_size, max_batch_size=h.max_batch_size)
    results = eval_harness.run_tasks(lm, tasks, manager=manager, limit=h.limit or None,
                                     num_fewshot=None if h.num_fewshot < 0 else h.num_fewshot,
                                     bootstrap_iters=0, env_info=False)
    writer.write(step, eval_harness.flat_metrics(results))
    throughput.reset()  # evaluation time is not training time
  return run


def load_init_params(path, model_cfg):
  """Parameters of a transformers or mamba_ssm checkpoint directory, checked against config.model."""
  model = load_model(path)
  ignored = ("dt_min", "dt_max", "dt_init_floor", "A_init_range") + NOT_IN_WEIGHTS + FINETUNE_MAY_CHANGE
  theirs, ours = model.config.to_dict(), model_cfg.to_dict()
  differ = {k: (ours[k], theirs[k]) for k in ours if k not in ignored and ours[k] != theirs[k]}
  if differ:
    raise run_config.ConfigError(f"init_from {path!r} does not match config.model in "
                                 f"(config, checkpoint) = {differ}")
  return model.params()


def _quiet_library_info(record: logging.LogRecord) -> bool:
  # Orbax logs every save step at INFO; keep its warnings and errors only.
  return record.levelno >= logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.INFO)
  logging.getLogger("absl").addFilter(_quiet_library_info)
  for chatty in ("gcsfs", "fsspec", "google"):  # the bucket clients log every file they open
    logging.getLogger(chatty).setLevel(logging.WARNING)
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           init_timeout=_INIT_TIMEOUT.value, heartbeat_timeout=_HEARTBEAT_TIMEOUT.value)
  except distributed.DistributedInitError as e:
    sys.exit(f"error: {e}")
  try:
    train(_CONFIG.value, _WORKDIR.value)
  except USER_ERRORS as e:  # the fix is in the message: no traceback unless asked
    if _DEBUG.value:
      raise
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except RUN_FAILURES as e:
    if _DEBUG.value:
      raise
    print(f"error: {e}", file=sys.stderr)
    if isinstance(e, checkpoint.CheckpointWriteError):
      # Orbax's writer threads of the failed save would print pages of tracebacks at
      # interpreter shutdown.
      _leave(1)
    sys.exit(1)
  except Exception as e:  # noqa: BLE001 - a collective whose peer is gone, or a bug
    if _DEBUG.value or jax.process_count() == 1 or not LOST_PEER.search(str(e)):
      raise
    step = checkpoint.find_step_dir(_WORKDIR.value)
    print(f"error: process {jax.process_index()} lost contact with another process of the job "
          f"({str(e).splitlines()[0][:160]}); the last complete checkpoint is "
          f"{step or 'none'}; restart every process to resume", file=sys.stderr)
    _leave(1)  # the runtime's threads would abort at interpreter shutdown


def _leave(code: int) -> None:
  """Exit now, without interpreter shutdown (train's finally blocks have closed the files and
  released the lock already)."""
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


# What a collective raises when a peer process died (gloo on CPU; the coordination service).
LOST_PEER = re.compile(r"[Gg]loo|Connection (refused|reset|closed)|task died|heartbeat|UNAVAILABLE")
MAX_ROLLBACKS = 3  # loss spikes a run may roll back from before it stops

# Mistakes in what was asked for (config, data, paths): one line with the fix, exit 2.
USER_ERRORS = errors.UserError
# A run that started and cannot go on: one line saying why, exit 1.
RUN_FAILURES = errors.RunFailure


def train(config, workdir):

  # ===== config =====
  resolved = run_config.validate(config, num_devices=jax.device_count(),
                                 process_count=jax.process_count(), reference=base.get_config())
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  if not workdir and jax.process_count() > 1:
    # Each process would stamp its own time: they must share one directory.
    raise run_config.ConfigError("--workdir is required when the job spans several processes "
                                 "(a directory every process can reach, e.g. gs://BUCKET/runs/NAME)")
  workdir = workdir or os.path.join("runs", f"{config.name}-{stamp}")
  storage.check_workdir(workdir)  # a bucket that is not there, no gcs extra: said now
  lock = lock_workdir(workdir)  # before anything is read or written there
  try:
    run(config, workdir, resolved, stamp)
  finally:
    lock.release()


def run(config, workdir, resolved, stamp):
  model_cfg = resolved["model"]
  is_main = jax.process_index() == 0
  # A workdir that holds checkpoints of another model is refused before anything is written.
  ckpt = checkpoint.Checkpointer(workdir, keep=config.checkpoint_keep)
  check_resumable(ckpt, config, force=_FORCE_RESUME.value)
  if is_main:
    storage.makedirs(workdir)
    storage.write_text(storage.path(workdir) / "config.json", json.dumps(config.to_dict(), indent=2))

  # ===== mesh =====
  mesh = make_mesh(config.mesh)
  logging.info("mesh %s over %d %s devices", dict(mesh.shape), mesh.size, jax.devices()[0].platform)

  # ===== data =====
  train_loader, held_out = make_loaders(config, model_cfg, workdir)

  # Task names checked before compiling; the tokenizer of the (first) data source.
  harness = make_harness(config, model_cfg,
                         os.path.join(data_sources(config)[0][0].dir, "tokenizer.json")
                         if config.data.source == "corpus" else "byte")

  # ===== model and optimizer, sharded =====
  params = load_init_params(config.init_from, model_cfg) if config.init_from else None
  built = steps.build(config, mesh, params=params)
  state = built.state
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  flops_per_token = metrics_lib.train_flops_per_token(model_cfg, built.runtime, config.seq_len)
  peak = metrics_lib.peak_flops_per_device(jax.devices()[0], config.peak_flops)
  tokens_per_step = config.batch_size * config.seq_len
  logging.info("%.2fM parameters, %.3g train FLOPs/token, %d tokens/step",
               n_params / 1e6, flops_per_token, tokens_per_step)

  # ===== checkpoint and resume =====
  # The newest complete checkpoint in the workdir, restored into this run's
  # shardings (which may differ from the saving run's), with the data iterator.
  target = with_shardings(state, jax.tree.map(lambda x: x.sharding, state))
  restored_step, restored = ckpt.restore(target, train_loader)
  if restored_step is not None:
    state = restored
    logging.info("resumed from %s at step %d", ckpt.directory, restored_step)
  start_step = int(state.step)
  ckpt.preflight(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)))  # disk space
  preemption = hooks.PreemptionWatcher()

  # ===== step function =====
  first_host_batch = next(train_loader)
  first_batch = steps.to_global(first_host_batch, mesh)
  with metrics_lib.Timer() as compile_time:
    train_step = built.train_step.lower(state, first_batch).compile()
  logging.info("train step compiled in %.1f s", compile_time.seconds)

  # ===== hooks and loop =====
  writer = record.MetricsWriter(workdir, wandb_cfg={**config.wandb, "name": config.wandb.name
                                                    or f"{config.name}-{stamp}"},
                                     run_config=config.to_dict(), is_main=is_main,
                                     resumed_from=restored_step)
  throughput = hooks.Throughput()
  share = data.SourceShare(list(held_out), config.seq_len)  # realised token share per source
  bar = tqdm.tqdm(total=config.steps, initial=start_step, disable=not is_main, dynamic_ncols=True)

  def log(step, state, metrics):
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    speed = throughput.read(tokens_per_step)
    row = {"loss": m["loss"], "ppl": math.exp(min(m["loss"], 80.0)), "grad_norm": m["grad_norm"],
           "param_norm": m["param_norm"], "lr": m["lr"], **speed,
           "mfu": metrics_lib.mfu(speed["tokens_per_sec"], flops_per_token, peak, mesh.size),
           "nonfinite_streak": m["nonfinite_streak"], **metrics_lib.memory_stats(jax.devices()[0]),
           **share.read()}
    writer.write(step, row)
    bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{speed['tokens_per_sec']:.0f}")

  def evaluate(step, state, metrics):
    rows = {name: steps.evaluate(built.eval_step, state.params,
                                 (steps.to_global(b, mesh) for b in batches()))
            for name, batches in held_out.items()}
    row = steps.pool_eval(rows.values())  # over all sources' tokens
    for name, r in rows.items():
      if name:
        row.update({f"{k}/{name}": v for k, v in r.items()})
    writer.write(step, row)
    logging.info("step %d: eval loss %.4f", step, row["eval_loss"])
    throughput.reset()  # evaluation time is not training time

  def save(step, state, metrics, force=False):
    # Never from a state inside a non-finite streak: its last update was skipped, and the
    # streak may end the run; the previous save is the one to resume from.
    if metrics is not None:
      m = jax.device_get({k: metrics[k] for k in ("loss", "nonfinite_streak")})
      if int(m["nonfinite_streak"]) > 0 or not math.isfinite(float(m["loss"])):
        logging.warning("not saving step %d: its loss or gradient is non-finite (streak %d)",
                        step, int(m["nonfinite_streak"]))
        return
    ckpt.save(step, state, train_loader, config.to_dict(), force=force)
    writer.sync()  # on a bucket: the record reaches every saved step

  guard = hooks.NonFiniteGuard(config.optim.max_nonfinite_steps, config.steps)
  spikes = hooks.SpikeGuard(config.optim.spike_factor, config.optim.spike_window)
  periodic = [
      hooks.Hook("nonfinite", 1, guard),
      hooks.Hook("save_failed", 1, lambda *_: ckpt.check()),  # a failed async save stops the run
      hooks.Hook("log", config.log_every, log),
      hooks.Hook("spike", 1 if config.optim.spike_factor > 0 else 0, spikes),  # before the save
      # Before eval: a failing evaluation cannot cost the step's checkpoint.
      # Asynchronous: returns once the state is copied to host memory.
      hooks.Hook("checkpoint", config.checkpoint_every, save),
      hooks.Hook("eval", config.eval_every, evaluate),
      hooks.Hook("harness", config.harness.every if harness else 0,
                 lambda step, state, _: harness(step, state.params, writer, throughput)),
  ]

  def roll_back(spike: hooks.LossSpike):
    """To the newest checkpoint (before the spike: the spiking step is never saved), then
    past the batches since it, which the next steps would otherwise see again."""
    ckpt.manager.wait_until_finished()
    back, restored = ckpt.restore(target, train_loader)
    if back is None or len(rollbacks) >= MAX_ROLLBACKS:
      raise hooks.NonFiniteLossError(f"{spike}; " + (
          "no checkpoint to roll back to" if back is None else
          f"already rolled back {len(rollbacks)} times ({rollbacks})") + ". Lower optim.lr or check the data.")
    for _ in range(spike.step - back):
      next(train_loader)
    rollbacks.append(spike.step)
    logging.warning("%s: rolled back to step %d and skipped batches %d..%d", spike, back, back + 1,
                    spike.step)
    writer.rewind(back, {"event": "rolled_back", "spike_step": spike.step, "spike_loss": spike.loss,
                         "skipped_batches": [back + 1, spike.step]})
    spikes.reset()
    bar.n = back
    return restored, back

  batch, step_metrics, done, step, rollbacks = first_batch, None, start_step, start_step, []
  share.add(first_host_batch)
  try:
    throughput.reset()
    while step < config.steps:
      step += 1
      state, step_metrics = train_step(state, batch)
      done = step
      throughput.tick()
      bar.update(1)
      try:
        hooks.run_hooks(periodic, step, config.steps, state, step_metrics)
      except hooks.LossSpike as spike:
        state, step = roll_back(spike)
        step_metrics, done = None, step
      if preemption.stop_requested():  # SIGTERM: all processes agree, save, exit cleanly
        logging.warning("SIGTERM received: saving step %d and exiting", step)
        break
      if step < config.steps:
        host_batch = next(train_loader)
        share.add(host_batch)
        batch = steps.to_global(host_batch, mesh)
    guard.finish()
    final = int(state.step)
    if final != ckpt.last_saved and final not in ckpt.steps():  # at the end and on preemption
      save(final, state, step_metrics, force=True)
  finally:
    bar.close()
    writer.close()
    ckpt.close()  # waits for saves in flight
    logging.info("stopped at step %d of %d in %s; %s", done, config.steps, workdir, guard.summary())


def check_resumable(ckpt, config, *, force: bool) -> None:
  """Refuse to resume a workdir whose checkpoints hold another model (unless forced)."""
  saved_steps = ckpt.steps()
  if not saved_steps:
    return
  try:
    saved = ckpt.saved_config(saved_steps[-1])
  except Exception:  # a damaged newest step: the restore falls back and checks shapes
    return
  ours = run_config.model_config(config).to_dict()
  theirs = checkpoint.saved_configs(saved)[0].to_dict()
  differ = {k: (theirs[k], ours[k]) for k in ours if k not in NOT_IN_WEIGHTS and ours[k] != theirs[k]}
  if differ and not force:
    raise run_config.ConfigError(
        f"{ckpt.directory} holds checkpoints of another model; (saved, requested) = {differ}. "
        f"Use another --workdir, or pass --force_resume to restore them anyway.")


def parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except FLAG_ERRORS as e:
    bad_flag(e)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
