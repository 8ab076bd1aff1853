"""Periodic work on the training loop: hooks with a period, the guard that stops
a run whose loss stays non-finite, the loss-spike guard, the throughput meter, the
profiler trace of chosen steps, and the SIGTERM watcher that stops the loop at a step
boundary."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import signal
from typing import Any, Callable, Iterable

import jax
import numpy as np

from mamba_train.errors import RunFailure
from mamba_train.metrics import Timer


@dataclasses.dataclass
class Hook:
  """`fn(step, state, metrics)` after every `every` steps (step counts from 1),
  and after the last step if `at_end`. `metrics` are the step's device arrays:
  a hook that reads them waits for the step to finish, so only hooks that need
  them should. `every <= 0` turns the hook off."""

  name: str
  every: int
  fn: Callable[[int, Any, dict], None]
  at_end: bool = True

  def due(self, step: int, last_step: int) -> bool:
    if self.every <= 0:
      return False
    return step % self.every == 0 or (self.at_end and step == last_step)


def run_hooks(hooks: Iterable[Hook], step: int, last_step: int, state, metrics: dict) -> None:
  for hook in hooks:
    if hook.due(step, last_step):
      hook.fn(step, state, metrics)


class NonFiniteLossError(RunFailure, RuntimeError):
  pass


def nonfinite_limit(max_steps: int, total_steps: int) -> int:
  """The streak that stops a run: `max_steps`, or for -1 (auto) min(20, total_steps // 4),
  at least 1, so that a short run whose steps are all skipped cannot end well."""
  return max(1, min(20, total_steps // 4)) if max_steps < 0 else max_steps


class NonFiniteGuard:
  """Hook body that stops the run after `max_steps` skipped steps in a row (-1:
  `nonfinite_limit`'s automatic choice; 0: never), and counts skipped steps. A step is
  skipped (train/optim.py `guard`) for a non-finite loss or gradient, or for a jump of
  the parameter or update norm (the metric `weight_jump`).

  It reads the previous step's streak while the current step runs, so watching
  every step does not stall the device; the last step is checked at once.
  `finish()`, after the loop, checks what is left and fails a run that skipped
  more than half of its steps.
  """

  def __init__(self, max_steps: int, last_step: int):
    self.max_steps, self.last_step = nonfinite_limit(max_steps, last_step), last_step
    self._pending = None
    self.checked = self.skipped = self.jumps = 0
    self._streak_jumps = 0  # of the current streak, steps skipped for a weight jump

  def __call__(self, step: int, state, metrics: dict) -> None:
    if self._pending is not None:
      self._check(*self._pending)
    self._pending = (step, metrics["nonfinite_streak"], metrics.get("weight_jump", 0))
    if step == self.last_step:
      self._check(*self._pending)

  def finish(self) -> None:
    if self._pending is not None:
      self._check(*self._pending)
    if self.max_steps > 0 and 2 * self.skipped > self.checked:
      raise NonFiniteLossError(
          f"{self.skipped} of the {self.checked} steps of this run were skipped for a non-finite "
          f"loss or gradient{self._jumps_said(self.jumps)}. Lower optim.lr, check the data, or "
          "try runtime.compute_dtype float32.")

  def summary(self) -> str:
    return f"{self.skipped} of {self.checked} steps skipped (non-finite loss or gradient{self._jumps_said(self.jumps)})"

  @staticmethod
  def _jumps_said(jumps: int) -> str:
    return f", or {jumps} for a weight jump" if jumps else ""

  def _check(self, step, streak, jump=0) -> None:
    if self._pending is not None and step == self._pending[0]:
      self._pending = None
    streak, jump = int(streak), int(jump)
    self.checked += 1
    self.skipped += streak > 0
    self.jumps += jump
    self._streak_jumps = self._streak_jumps + jump if streak > 0 else 0
    if self.max_steps > 0 and streak >= self.max_steps:
      first, last = step - streak + 1, step
      if self._streak_jumps == 0:
        what = f"the loss or gradient was non-finite for {streak} steps in a row (steps {first}..{last}"
      else:
        what = (f"{streak} steps in a row were skipped (steps {first}..{last}; {self._streak_jumps} for "
                "a parameter or update norm above optim.weight_guard_factor x its recent largest, "
                "the others for a non-finite loss or gradient")
      raise NonFiniteLossError(
          f"{what}, optim.max_nonfinite_steps = {self.max_steps}). Those "
          f"updates were skipped, so the parameters are still those after step {step - streak}. "
          f"Lower optim.lr, check the data, or try runtime.compute_dtype float32.")


class LossSpike(Exception):
  """Raised by SpikeGuard; the loop rolls back to the last checkpoint and skips batches."""

  def __init__(self, step: int, loss: float, mean: float):
    super().__init__(f"loss spike at step {step}: {loss:.4g}, above {mean:.4g} (the recent mean)")
    self.step, self.loss, self.mean = step, loss, mean


class WeightJump(LossSpike):
  """A step the weight guard skipped, seen by SpikeGuard: the loop rolls back as for a spike."""

  def __init__(self, step: int, loss: float):
    Exception.__init__(self, f"weight jump at step {step}: its update was skipped (the parameter or "
                       "update norm above optim.weight_guard_factor x its recent largest)")
    self.step, self.loss, self.mean = step, loss, float("nan")


class SpikeGuard:
  """Hook body: raises LossSpike when a step's loss is more than `factor` times the
  mean of the previous `window` finite losses (once there are `window` of them), and
  WeightJump when the weight guard skipped the step (the weights were about to blow
  up, or already had). Reading the loss at every step waits for the step, so the guard
  is off unless asked for (optim.spike_factor). PaLM and OLMo met such spikes by
  restarting from a checkpoint before them and skipping the batches in between; the
  loop does that."""

  def __init__(self, factor: float, window: int):
    self.factor, self.recent = factor, collections.deque(maxlen=window)

  def __call__(self, step: int, state, metrics: dict) -> None:
    loss = float(metrics["loss"])
    if float(metrics.get("weight_jump", 0)) > 0:
      raise WeightJump(step, loss)
    if not math.isfinite(loss):
      return  # the non-finite guard's business
    if len(self.recent) == self.recent.maxlen:
      mean = sum(self.recent) / len(self.recent)
      if loss > self.factor * mean:
        raise LossSpike(step, loss, mean)
    self.recent.append(loss)

  def reset(self) -> None:
    self.recent.clear()


class Throughput:
  """Wall time and tokens between two log points: tokens/s and time per step."""

  def __init__(self):
    self.reset()

  def reset(self):
    self.timer, self.steps = Timer(), 0

  def tick(self):
    self.steps += 1

  def read(self, tokens_per_step: int) -> dict[str, float]:
    dt = self.timer.elapsed
    steps = max(self.steps, 1)
    out = {"step_time": dt / steps, "tokens_per_sec": tokens_per_step * steps / max(dt, 1e-9)}
    self.reset()
    return out


class PreemptionWatcher:
  """SIGTERM (what a TPU VM gets before preemption) sets a flag; `stop_requested`,
  called at every step boundary, says whether to save and stop. With several
  processes they agree (any process signalled stops all at the same step)."""

  def __init__(self):
    self._flag = False
    signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    self._flag = True

  def stop_requested(self) -> bool:
    if jax.process_count() == 1:
      return self._flag
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.array(self._flag))
    return bool(np.any(flags))


class StepTrace:
  """A `jax.profiler` trace of steps `first`..`last` into `log_dir` (TensorBoard's
  profile plugin and XProf read `log_dir/plugins/profile/<run>/*.xplane.pb`; Perfetto,
  at ui.perfetto.dev, opens the `*.trace.json.gz` beside it), each step marked by a
  `StepTraceAnnotation` so the tools split the trace by step. `before(step)` before the
  step is dispatched, `after(step, outputs)` once it has been: the trace stops when the
  last step's outputs are ready, so it holds the device's work, not only its dispatch.
  A loop with no trace to take makes none of these (`from_config` returns None): it
  does nothing more a step than test `if trace`."""

  def __init__(self, log_dir: str, first: int, last: int, python: bool = False):
    self.log_dir, self.first, self.last = log_dir, first, last
    # The host's and the devices' activity; Python's calls only when asked (each call is an
    # event: the trace grows a hundredfold and the steps slow while it runs).
    self.options = jax.profiler.ProfileOptions()
    self.options.python_tracer_level = 1 if python else 0
    self._annotation = None
    self.active = False

  @classmethod
  def from_config(cls, profile, workdir: str, start_step: int, process_index: int, processes):
    """The trace `profile` (config.profile) asks of this process, or None: off, another
    process's, or steps this run (resumed at `start_step`) has already passed."""
    first, last = profile.start_step + 1, profile.start_step + profile.num_steps
    if profile.num_steps <= 0 or process_index not in processes or first <= start_step:
      if profile.num_steps > 0 and first <= start_step and process_index in processes:
        logging.warning("profile: steps %d..%d are before this run's start (step %d): no trace; "
                        "set profile.start_step >= %d", first, last, start_step, start_step)
      return None
    return cls(os.path.join(os.fspath(workdir), "profile"), first, last, python=profile.python)

  def before(self, step: int) -> None:
    if step == self.first:
      jax.profiler.start_trace(self.log_dir, profiler_options=self.options)
      self.active = True
    if self.active:
      self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
      self._annotation.__enter__()

  def after(self, step: int, outputs) -> None:
    if not self.active:
      return
    if step == self.last:
      jax.block_until_ready(outputs)
    self._annotation.__exit__(None, None, None)
    self._annotation = None
    if step == self.last:
      self.stop(step)

  def stop(self, step: int) -> None:
    """End the trace (after its last step, or where the run stopped before it)."""
    if not self.active:
      return
    if self._annotation is not None:
      self._annotation.__exit__(None, None, None)
      self._annotation = None
    jax.profiler.stop_trace()
    self.active = False
    logging.info("profile of steps %d..%d in %s (tensorboard --logdir %s, or xprof; Perfetto: the "
                 "*.trace.json.gz)", self.first, step, os.path.join(self.log_dir, "plugins", "profile"),
                 self.log_dir)
