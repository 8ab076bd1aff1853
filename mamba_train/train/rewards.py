"""GRPO's reward functions, on the host: loaded by import path, called with TRL's
signature, combined by weight.

  --config.grpo.reward_funcs='package.module:function*2,mamba_train.train.rewards:think_format'

Each entry is `module:attribute`, optionally `*WEIGHT` (default 1; quote the value in a
shell, where `*` globs). The attribute is any callable, called as TRL's GRPOTrainer calls
a reward function:

  fn(prompts=[...], completions=[...], completion_ids=[...], max_completion_length=L, **fields)
    -> list[float | None]

one entry per completion: `prompts` as the prompts file holds them (a string, or a list of
messages), a group's completions together; `completions` the generated text, or for a
conversation prompt [{"role": "assistant", "content": text}] (TRL's conversational form);
`completion_ids` their tokens; `fields` every other field of the prompts file
(mamba_train/data/prompts.py), one value per completion. None (or NaN) means "not
applicable to this completion".

Combining (TRL's `sum_then_normalize`): reward = nansum over functions of weight * value;
a completion that every function called not applicable is unscorable: its reward is NaN,
it is left out of its group's baseline and gets advantage 0 (mamba_train/train/grpo.py).

A function that raises stops the run with one line naming it and the prompt it failed on
(the batch is retried one completion at a time to find it); one that returns the wrong
number of rewards, or a value that is not a finite number or None, with one line naming it.

Built in (each also a factory for other settings; a run names its own with an import path):
  exact_answer   1 if the text after the last "####" equals the row's `answer` field
                 (numbers compared as numbers), else 0; None for a row without an answer
  think_format   1 if the completion is one <think>...</think> then an answer, else 0
  closeness      1 if the completion's first character is the row's one-character `answer`,
                 falling with the code-point distance to 0 at 10 (the synthetic task's)
  length_penalty DAPO's soft overlong punishment: 0 up to 80% of max_completion_length
                 tokens, falling linearly to -1 at the limit
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mamba_train.data import prompts as prompts_lib
from mamba_train.errors import UserError


class RewardError(UserError, RuntimeError):
  """A reward function could not be loaded, or failed or misbehaved in a call."""


@dataclasses.dataclass(frozen=True)
class RewardFunc:
  name: str  # as the config names it: "package.module:function"
  fn: Callable
  weight: float = 1.0


def _load_one(entry: str) -> RewardFunc:
  path, star, weight = entry.partition("*")
  module, colon, attr = path.strip().partition(":")
  if not colon or not module or not attr:
    raise RewardError(f"reward function {entry!r}: expected 'package.module:function' (optionally "
                      f"'*WEIGHT'), e.g. 'mamba_train.train.rewards:exact_answer*2'.")
  name = f"{module}:{attr}"
  try:
    w = float(weight) if star else 1.0
  except ValueError:
    raise RewardError(f"reward function {entry!r}: weight {weight!r} is not a number.") from None
  if not math.isfinite(w):
    raise RewardError(f"reward function {entry!r}: weight {weight!r} is not finite.")
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    raise RewardError(f"reward function {name}: cannot import {module!r} ({e}); is it installed or "
                      f"on PYTHONPATH?") from None
  fn = mod
  for part in attr.split("."):
    if not hasattr(fn, part):
      raise RewardError(f"reward function {name}: {module!r} has no attribute {attr!r}.")
    fn = getattr(fn, part)
  if not callable(fn):
    raise RewardError(f"reward function {name}: {attr!r} is a {type(fn).__name__}, not a function.")
  return RewardFunc(name, fn, w)


def load_reward_funcs(spec: str | Sequence[str], weights: Sequence[float] | None = None) -> list[RewardFunc]:
  """The functions of a comma-separated spec (or a list of entries). `weights`, one per
  function (TRL's reward_weights), replaces the weights written in the spec."""
  entries = [e.strip() for e in (spec.split(",") if isinstance(spec, str) else spec) if e.strip()]
  if not entries:
    raise RewardError("no reward functions: set --config.grpo.reward_funcs='package.module:function,...'.")
  funcs = [_load_one(e) for e in entries]
  if weights is not None:
    weights = list(weights)
    if len(weights) != len(funcs):
      raise RewardError(f"{len(weights)} reward weights for {len(funcs)} reward functions; give one per function.")
    funcs = [dataclasses.replace(f, weight=float(w)) for f, w in zip(funcs, weights)]
  return funcs


# What every reward function is called with besides the fields.
_PASSED = prompts_lib.RESERVED_FIELDS


def check_fields(funcs: Sequence[RewardFunc], field_names: Sequence[str]) -> None:
  """Before any rollout: each function takes TRL's keywords, and every field it requires
  by name is in the prompts file."""
  have = set(_PASSED) | set(field_names)
  for f in funcs:
    try:
      params = inspect.signature(f.fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension without a signature: trust it
      continue
    names = {p.name for p in params}
    if not any(p.kind == p.VAR_KEYWORD for p in params):
      unaccepted = sorted(have - names)
      if unaccepted:
        raise RewardError(f"reward function {f.name} takes no {unaccepted[0]!r} keyword; a reward function "
                          f"is fn(prompts, completions, **kwargs) -> list[float | None], and every field "
                          f"and {', '.join(_PASSED[2:])} come as keywords.")
    needed = [p.name for p in params if p.default is p.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
              and p.name not in have]
    if needed:
      raise RewardError(f"reward function {f.name} needs field {needed[0]!r}, which no row of the prompts file "
                        f"has (it has {sorted(field_names)}).")


def _short(prompt) -> str:
  text = prompt if isinstance(prompt, str) else " | ".join(f"{m['role']}: {m['content']}" for m in prompt)
  text = " ".join(text.split())
  return repr(text if len(text) <= 80 else text[:77] + "...")


def _one_line(e: BaseException) -> str:
  msg = " ".join(str(e).split())
  return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _call(f: RewardFunc, prompts, completions, completion_ids, max_completion_length, fields, rows):
  """f on the completions `rows`, or RewardError naming it and the first prompt it fails on."""
  def run(idx):
    return f.fn(prompts=[prompts[i] for i in idx], completions=[completions[i] for i in idx],
                completion_ids=[completion_ids[i] for i in idx] if completion_ids is not None else None,
                max_completion_length=max_completion_length,
                **{k: [v[i] for i in idx] for k, v in fields.items()})

  try:
    return run(rows)
  except Exception as batch_error:  # any error of user code: named, never a traceback
    culprit, error = rows[0], batch_error
    if len(rows) > 1:  # find the completion it fails on
      for i in rows:
        try:
          run([i])
        except Exception as e:  # pylint: disable=broad-except
          culprit, error = i, e
          break
    raise RewardError(f"reward function {f.name} raised {_one_line(error)} on prompt {_short(prompts[culprit])} "
                      f"(completion {culprit}); fix it, or return None where it does not apply.") from error


def score(funcs: Sequence[RewardFunc], prompts: Sequence, completions: Sequence[str],
          fields: dict[str, Sequence[Any]] | None = None, *, completion_ids: Sequence[Sequence[int]] | None = None,
          max_completion_length: int | None = None) -> np.ndarray:
  """(n, functions) float32 rewards of n completions, NaN where a function returned None.

  completions are text; for a conversation prompt each function receives TRL's
  [{"role": "assistant", "content": text}] instead.
  """
  n = len(completions)
  fields = dict(fields or {})
  if len(prompts) != n or any(len(v) != n for v in fields.values()):
    raise ValueError(f"{len(prompts)} prompts and fields of lengths {[len(v) for v in fields.values()]} "
                     f"for {n} completions")
  given = [c if isinstance(p, str) else [{"role": "assistant", "content": c}]
           for p, c in zip(prompts, completions)]
  out = np.full((n, len(funcs)), np.nan, np.float32)
  for j, f in enumerate(funcs):
    values = _call(f, prompts, given, completion_ids, max_completion_length, fields, list(range(n)))
    try:
      values = list(values)
    except TypeError:
      raise RewardError(f"reward function {f.name} returned a {type(values).__name__}, not a list of "
                        f"{n} rewards (one per completion, None where it does not apply).") from None
    if len(values) != n:
      raise RewardError(f"reward function {f.name} returned {len(values)} rewards for {n} completions; it must "
                        f"return one per completion (None where it does not apply).")
    for i, v in enumerate(values):
      if v is None:
        continue
      try:
        x = float(v)
      except (TypeError, ValueError):
        x = None
      if x is None or isinstance(v, (str, bytes)) or math.isinf(x):
        raise RewardError(f"reward function {f.name} returned {v!r} for completion {i} (prompt "
                          f"{_short(prompts[i])}); a reward is a finite number, or None where it does not apply.")
      out[i, j] = x
  return out


def combine(per_func: np.ndarray, weights: Sequence[float]) -> np.ndarray:
  """(n,) float32: the weighted sum over functions, None (NaN) counting as nothing, as
  TRL's nansum; NaN where every function returned None (an unscorable completion)."""
  w = np.asarray(weights, np.float32)
  total = np.nansum(per_func * w[None, :], axis=1, dtype=np.float32)
  return np.where(np.isnan(per_func).all(axis=1), np.float32(np.nan), total).astype(np.float32)


def _nanstd(x: np.ndarray) -> float:
  """TRL's nanstd: Bessel-corrected over the values present; NaN with fewer than two."""
  x = x[~np.isnan(x)]
  return float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")


def reward_metrics(funcs: Sequence[RewardFunc], per_func: np.ndarray) -> dict[str, float]:
  """TRL's reward log: per function the mean and std over the completions it applied to,
  and of the combined reward over the scorable ones."""
  out = {}
  for j, f in enumerate(funcs):
    col = per_func[:, j]
    out[f"rewards/{f.name}/mean"] = float(np.nanmean(col)) if not np.isnan(col).all() else float("nan")
    out[f"rewards/{f.name}/std"] = _nanstd(col)
  total = combine(per_func, [f.weight for f in funcs])
  out["reward"] = float(np.nanmean(total)) if not np.isnan(total).all() else float("nan")
  out["reward_std"] = _nanstd(total)
  return out


# ---------------------------------------------------------------------------
# Built-in reward functions.


def _text(completion) -> str:
  return completion if isinstance(completion, str) else completion[-1]["content"]


def _normalise(answer: str) -> str | float:
  s = answer.strip().rstrip(".").strip()
  try:
    return float(s.replace(",", "").replace("$", ""))
  except ValueError:
    return " ".join(s.split())


def exact_answer_after(marker: str) -> Callable:
  """A reward: 1.0 if the completion's text after the last `marker` equals the row's
  `answer` field (numbers compared as numbers: "1,000." equals "1000"), else 0.0 (also
  without the marker); None for a row whose answer is None."""
  def reward(prompts, completions, answer, **_):
    out = []
    for c, a in zip(completions, answer):
      if a is None:
        out.append(None)
        continue
      text = _text(c)
      found = text.rfind(marker)
      got = text[found + len(marker):] if found >= 0 else None
      out.append(float(got is not None and _normalise(got) == _normalise(str(a))))
    return out
  reward.__name__ = f"exact_answer_after({marker!r})"
  return reward


def regex_format(pattern: str) -> Callable:
  """A reward: 1.0 if the whole completion matches `pattern` (re.DOTALL), else 0.0."""
  compiled = re.compile(pattern, re.DOTALL)

  def reward(prompts, completions, **_):
    return [float(compiled.fullmatch(_text(c)) is not None) for c in completions]
  reward.__name__ = f"regex_format({pattern!r})"
  return reward


def soft_overlong(cache_fraction: float = 0.2) -> Callable:
  """A reward (DAPO's soft overlong punishment, Eq. 13; TRL's get_soft_overlong_punishment):
  with L = max_completion_length and a cache of cache_fraction * L tokens, 0 up to L - cache
  tokens, then falling linearly to -1 at L, and -1 beyond."""
  def reward(prompts, completions, completion_ids, max_completion_length, **_):
    if completion_ids is None or max_completion_length is None:
      raise ValueError("needs completion_ids and max_completion_length, which the trainer passes")
    cache = cache_fraction * max_completion_length
    start = max_completion_length - cache
    return [0.0 if len(ids) <= start else -1.0 if len(ids) > max_completion_length
            else (start - len(ids)) / cache for ids in completion_ids]
  reward.__name__ = f"soft_overlong({cache_fraction})"
  return reward


def first_char_closeness(scale: float = 10.0) -> Callable:
  """A reward for one-character answers (the synthetic task of scripts/grpo_task.py): 1 if the
  completion's first character (after whitespace) is the row's `answer`, falling linearly with
  the distance between their code points to 0 at `scale` (a digit's neighbours score most);
  0 for an empty completion; None for a row without an answer. Dense: a policy that has
  never hit the answer still learns which way it lies."""
  def reward(prompts, completions, answer, **_):
    out = []
    for c, a in zip(completions, answer):
      text, a = _text(c).lstrip(), None if a is None else str(a)
      out.append(None if not a else 0.0 if not text else max(0.0, 1.0 - abs(ord(text[0]) - ord(a[0])) / scale))
    return out
  reward.__name__ = f"first_char_closeness({scale:g})"
  return reward


exact_answer = exact_answer_after("####")  # GSM8K's marker before the final answer
# One reasoning block, then the answer (TRL's think_format_reward, anchored at both ends).
think_format = regex_format(r"<think>(?:(?!<think>).)*?</think>.*")
length_penalty = soft_overlong(0.2)
closeness = first_char_closeness(10.0)
