"""The parts of a run every loop shares (the language-model loop, loop.py, and GRPO's,
grpo_loop.py): the state built from init_from or a fresh init, the resume from the newest
checkpoint and the checks before it, the guarded save, and the close. Each loop is its own
module over these; neither imports the other's body.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math

import jax

from mamba_train import metrics as metrics_lib
from mamba_train.interop.load import load_model
from mamba_train.model import lora as lora_lib
from mamba_train.model.config import Mamba2Config
from mamba_train.model.params import weight_names
from mamba_train.train import goodput as goodput_lib, hooks, step as steps
from mamba_train.train.run_config import ConfigError, Plan
from mamba_train.train.state import trainable, with_frozen, with_shardings
from mamba_train.workdir import checkpoint, storage


def build_state(plan: Plan, mesh, ckpt: checkpoint.Checkpointer, workdir: str, *, force: bool,
                build=steps.build):
  """-> (the built train state and steps (`build`: step.build, or GRPO's), the run record checkpoints
  keep): the weights of config.init_from or a fresh init, a LoRA run's base checked
  against the workdir's adapters, config.json written, the sizes logged."""
  config, model_cfg = plan.config, plan.model
  params = load_init_params(config.init_from, model_cfg) if config.init_from else None
  run_record = plan.config_dict()
  if plan.lora is not None:
    # The adapters are saved alone, so the record names the base they adapt.
    # A random base is named by its seed (a recomputed init can differ in the last bit
    # under other compiler flags); loaded weights by their values.
    run_record["lora_base"] = {"init_from": config.init_from, "seed": config.seed,
                               "fingerprint": lora_lib.fingerprint(params) if params else "random init"}
    check_base(ckpt, run_record["lora_base"], force=force)  # before building the state
  if jax.process_index() == 0:
    storage.makedirs(workdir)
    storage.write_text(storage.path(workdir) / "config.json", json.dumps(plan.config_dict(), indent=2))
  built = build(plan, mesh, params=params)
  state = built.state
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  if plan.lora is not None:
    logging.info("LoRA: %.3fM adapter parameters train at a peak rate of %.3g%s; the %.2fM of the base are "
                 "frozen%s", n_params / 1e6, plan.lr,
                 " (lora.lr; optim.lr is the full finetune's)" if plan.lr != config.optim.lr else "",
                 sum(x.size for x in jax.tree.leaves(state.frozen)) / 1e6,
                 f" in {plan.lora.base_dtype}" if plan.lora.base_dtype else "")
  logging.info("%.2fM parameters (%.2fM active per token), %.3g train FLOPs/token, %d tokens/step",
               n_params / 1e6, (n_params - (0 if plan.lora else metrics_lib.inactive_params(model_cfg))) / 1e6,
               metrics_lib.train_flops_per_token(model_cfg, plan.runtime, config.seq_len),
               config.batch_size * config.seq_len)
  return built, run_record


def resume(ckpt: checkpoint.Checkpointer, state, train_loader, workdir: str, gp: goodput_lib.Goodput):
  """-> (the state, the restore target (the trainable state's shapes and
  shardings), the step restored or None): the newest complete checkpoint restored
  into `state`'s shardings with the data iterator, the LoRA base kept."""
  target = with_shardings(trainable(state), jax.tree.map(lambda x: x.sharding, trainable(state)))
  with gp.phase("checkpoint_restore"):
    restored_step, restored = ckpt.restore(target, train_loader)
  if restored_step is not None:
    state = with_frozen(restored, state.frozen)
    logging.info("resumed from %s at step %d", ckpt.directory, restored_step)
    if jax.process_index() == 0:  # the stopped runs' record, before the writer sets its later rows aside
      log_resumed_goodput(gp, storage.path(workdir) / "metrics.jsonl", restored_step)
  return state, target, restored_step


def guarded_save(ckpt: checkpoint.Checkpointer, train_loader, run_config: dict, writer, *,
                 local: bool = False):
  """`save(step, state, metrics, force=False)`, the checkpoint hook: saves the state
  with the data iterator and the run config, then syncs the record (`local`: to the
  local tier, config.checkpoint.local_dir)."""

  def save(step, state, metrics, force=False):
    # Never from a state inside a streak of skipped steps (a non-finite loss or gradient, a
    # weight jump): its last update was skipped, the weights may be the blown-up ones, and
    # the streak may end the run; the previous save is the one to resume from.
    if metrics is not None:
      m = jax.device_get({k: metrics[k] for k in ("loss", "nonfinite_streak")})
      if int(m["nonfinite_streak"]) > 0 or not math.isfinite(float(m["loss"])):
        logging.warning("not saving step %d: its update was skipped (a non-finite loss or gradient, "
                        "or a weight jump; streak %d)",
                        step, int(m["nonfinite_streak"]))
        return
    if local:
      ckpt.save_local(step, trainable(state), train_loader, run_config)
      return
    ckpt.save(step, trainable(state), train_loader, run_config, force=force)
    writer.sync()  # on a bucket: the record reaches every saved step

  return save


def close(ckpt: checkpoint.Checkpointer, writer, gp: goodput_lib.Goodput, guard: hooks.NonFiniteGuard, *,
          done: int, steps: int, workdir: str) -> None:
  """The run's end, however it came: the saves in flight finished, the goodput row
  written at the last step `done`, the record closed."""
  try:
    with gp.phase("checkpoint_save"):
      ckpt.close()  # waits for saves in flight
  finally:
    # The whole run's goodput, at its end. On a full disk the record cannot take it
    # either: a warning, so that the error that stopped the run stays the one reported.
    try:
      writer.write(done, {"event": "goodput", **gp.row()})
    except OSError as e:
      logging.warning("the run's closing goodput row was not written: %s", e)
    finally:
      with contextlib.suppress(OSError):  # the file is closed even when its flush fails
        writer.close()
    logging.info("stopped at step %d of %d in %s; %s", done, steps, workdir, guard.summary())
    logging.info("%s", gp.summary())


def check_resumable(ckpt: checkpoint.Checkpointer, plan: Plan, *, force: bool) -> None:
  """Refuse to resume a workdir whose checkpoints hold another model (unless forced)."""
  saved_steps = ckpt.steps()
  if not saved_steps:
    return
  try:
    saved = ckpt.saved_config(saved_steps[-1])
  except Exception:  # a damaged newest step: the restore falls back and checks shapes
    return
  differ = checkpoint.saved_configs(saved)[0].weight_differences(plan.model)
  saved_lora = lora_lib.spec_from_config(saved.get("lora", {}), weight_names(plan.model))
  if _trains(saved_lora) != _trains(plan.lora):  # the same model, another set of trained weights
    raise ConfigError(f"{ckpt.directory} holds checkpoints of {_trains(saved_lora)}, but this run "
                      f"trains {_trains(plan.lora)}; use another --workdir, or the lora settings it was run with")
  if differ and not force:
    raise ConfigError(
        f"{ckpt.directory} holds checkpoints of another model; (saved, requested) = {differ}. "
        f"Use another --workdir, or pass --force_resume to restore them anyway.")


def _trains(spec) -> str:
  """What a run trains, as the resume check compares it."""
  if spec is None:
    return "the whole model"
  return f"LoRA adapters (rank {spec.rank}, alpha {spec.alpha:g}, targets {','.join(spec.targets)})"


def check_base(ckpt: checkpoint.Checkpointer, base: dict, *, force: bool) -> None:
  """Refuse to resume adapters trained on another base (unless forced)."""
  saved_steps = ckpt.steps()
  if not saved_steps:
    return
  try:
    saved = ckpt.saved_config(saved_steps[-1]).get("lora_base")
  except Exception:  # a damaged newest step: the restore falls back
    return
  if saved and saved["fingerprint"] != base["fingerprint"] and not force:
    raise ConfigError(
        f"{ckpt.directory} holds adapters of another base (saved init_from {saved['init_from']!r}, "
        f"fingerprint {saved['fingerprint']}; this run's {base['init_from']!r}, {base['fingerprint']}). "
        "Use another --workdir or the base they were trained on, or pass --force_resume.")


def load_init_params(path: str, model_cfg: Mamba2Config):
  """Parameters of a workdir, a transformers or mamba_ssm directory (a LoRA run's: its adapters
  merged into its base), checked against config.model (which `run_config.validate` took from
  its config: only a directory that changed since can differ)."""
  model = load_model(path).merged()
  differ = model_cfg.weight_differences(model.config, init=False)
  if differ:
    raise ConfigError(f"init_from {path!r} does not match config.model in "
                      f"(config, checkpoint) = {differ}")
  return model.params()


def log_resumed_goodput(gp: goodput_lib.Goodput, metrics_path, restored_step: int) -> None:
  """After a resume: the stopped run's goodput, and the step time it spent on the steps this
  run trains again (`gp.lost_to_restart`, in this run's goodput rows)."""
  lost, last, final = goodput_lib.lost_to_restart(metrics_path, restored_step)
  gp.lost_to_restart = lost
  if final is not None:
    logging.info("the stopped run's %s", goodput_lib.summary(final))
  if last is not None and last > restored_step:
    logging.info("goodput: steps %d..%d are trained again: %.1f s of step time lost to the restart",
                 restored_step + 1, last, lost)
