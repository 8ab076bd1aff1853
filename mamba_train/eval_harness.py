"""Our model behind lm-evaluation-harness's model interface (`pip install -e ".[eval]"`).

`HarnessLM` is an `lm_eval.api.model.TemplateLM`: lm-eval's own code turns
(context, continuation) pairs into tokens (trailing spaces of the context move to
the continuation; the whole string is encoded and split; an empty context is
conditioned on EOS), exactly as its `hf` backend does, so scores compare with
published ones. Scoring is one jitted forward over right-padded rows (lengths and
batch rounded up so few programs serve a task); rolling loglikelihoods use lm-eval's
disjoint windows of `max_length`; `generate_until` runs `mamba_train.generate`
batched on the device and cuts the text at the first stop sequence, as the `hf`
backend does after its stopping criteria.

lm_eval is imported when this module is, not by `import mamba_train`.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# lm_eval's __init__ sets HF_XET_HIGH_PERFORMANCE (a download hint for its own datasets);
# importing one of our modules must leave the caller's environment (and its children's) as it was.
_XET_BEFORE = os.environ.get("HF_XET_HIGH_PERFORMANCE")
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402

if _XET_BEFORE is None:
  os.environ.pop("HF_XET_HIGH_PERFORMANCE", None)

from mamba_train.data.tokenizer import TokenizerInfo
from mamba_train.generate import generate
from mamba_train.model.mamba2 import Mamba2LM

log = logging.getLogger(__name__)
DEFAULT_MAX_LENGTH = 2048  # lm-eval's own default for models that state none


@nnx.jit
def _log_probs(model: Mamba2LM, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(log p(ids[:, t+1] | ids[:, :t+1]), is that token the argmax), each (b, l-1)."""
  logits = model(ids[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  target = ids[:, 1:]
  picked = jnp.take_along_axis(logp, target[..., None], -1)[..., 0]
  return picked, jnp.argmax(logits, axis=-1) == target


def _bucket(n: int, least: int = 16) -> int:
  return max(least, 1 << (n - 1).bit_length())


class HarnessLM(TemplateLM):
  """lm-eval's view of a Mamba2LM and its tokenizer."""

  def __init__(self, model: Mamba2LM, tokenizer: TokenizerInfo, *, batch_size: int = 16,
               max_length: int = DEFAULT_MAX_LENGTH, max_gen_toks: int = 256):
    super().__init__()
    self.model, self.tok = model, tokenizer
    self.tok.tokenizer.encode_special_tokens = False  # special tokens in text are parsed, as in hf
    self.batch_size, self.max_length, self.max_gen_toks = int(batch_size), max_length, max_gen_toks

  # --- tokens, as lm-eval's hf backend makes them -------------------------------

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    return self.tok.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

  def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self.tok.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

  # --- scoring ------------------------------------------------------------------

  def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether it is all greedy) per pair.
    The input is the last max_length + 1 tokens of context + continuation."""
    out = [None] * len(pairs)
    # Longest first, as lm-eval's backends order them: similar lengths share a batch.
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    for start in range(0, len(order), self.batch_size):
      idx = order[start:start + self.batch_size]
      seqs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1):] for i in idx]
      width = _bucket(max(len(s) for s in seqs))
      ids = np.full((self.batch_size, width), self.eot_token_id, np.int32)
      for r, s in enumerate(seqs):
        ids[r, :len(s)] = s
      logp, greedy = (np.asarray(x) for x in _log_probs(self.model, jnp.asarray(ids)))
      for r, (i, s) in enumerate(zip(idx, seqs)):
        n = len(pairs[i][1])
        cols = slice(len(s) - 1 - n, len(s) - 1)  # positions that predict the continuation
        out[i] = (float(logp[r, cols].sum()), bool(greedy[r, cols].all()))
    return out

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    return self.score([(ctx, cont) for _, ctx, cont in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)):
        windows.append((ctx, cont))
        owner.append(i)
    totals = [0.0] * len(requests)
    for i, (lp, _) in zip(owner, self.score(windows)):
      totals[i] += lp
    return totals

  # --- generation ---------------------------------------------------------------

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    out = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for i, req in enumerate(requests):  # one generate call per batch of like settings
      kw = dict(req.args[1])
      groups.setdefault((kw.get("max_gen_toks", self.max_gen_toks),
                         float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0),
                        []).append(i)
    eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
    for (max_new, temperature), idx in groups.items():
      for start in range(0, len(idx), self.batch_size):
        batch = idx[start:start + self.batch_size]
        prompts = [np.asarray(self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):]
                              or [self.eot_token_id], np.int32) for i in batch]
        full = generate(self.model, prompts, max_new, temperature=temperature,
                        eos_id=self.eot_token_id, max_prompt_len=max(self.max_length, 1))
        for i, p, row in zip(batch, prompts, full):
          new = row[len(p):]
          cut = np.flatnonzero(new == self.eot_token_id)
          text = self.tok_decode(new[:cut[0]] if len(cut) else new)
          until = requests[i].args[1].get("until") or []
          for stop in [*([until] if isinstance(until, str) else until), eos_text]:
            if stop:
              text = text.split(stop)[0]
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out


# --- running tasks ----------------------------------------------------------------


def task_manager(include_path: str | None = None, tasks: Iterable[str] = ()):
  """lm-eval's TaskManager. Indexing lm-eval's own 14k task configs takes about 20 s
  on a small CPU, so when every requested task is in include_path only that is indexed."""
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  if include_path:
    local = TaskManager(include_path=include_path, include_defaults=False)
    if tasks and all(t.strip() in local.all_tasks for t in tasks):
      return local
  return TaskManager(include_path=include_path or None)


def check_tasks(tasks: Iterable[str], manager) -> list[str]:
  """The task names, or ValueError naming each unknown one with what was found."""
  tasks = [t.strip() for t in tasks if t.strip()]
  found = manager.all_tasks
  unknown = [t for t in tasks if t not in found]
  if unknown:
    near = {t: difflib.get_close_matches(t, found, n=5) for t in unknown}
    listing = (", ".join(sorted(found)) if len(found) <= 60 else
               f"{len(found)} tasks (list them with `lm_eval ls tasks`)")
    raise ValueError(f"unknown lm-eval task(s) {unknown}; closest: {near}. Found: {listing}.")
  if not tasks:
    raise ValueError("no task names given")
  return tasks


def run_tasks(lm: HarnessLM, tasks: list[str], *, manager=None, limit: float | None = None,
              num_fewshot: int | None = None, log_samples: bool = False, seed: int = 0,
              bootstrap_iters: int = 100_000) -> dict:
  """lm-eval's `simple_evaluate` on our model; returns its results dict.
  bootstrap_iters (lm-eval's default) only sizes the standard errors; 0 skips them."""
  import lm_eval  # pylint: disable=import-outside-toplevel
  manager = manager or task_manager(tasks=tasks)
  tasks = check_tasks(tasks, manager)
  return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                 num_fewshot=num_fewshot, log_samples=log_samples,
                                 random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                 fewshot_random_seed=seed, batch_size=lm.batch_size,
                                 bootstrap_iters=bootstrap_iters)


def flat_metrics(results: dict, prefix: str = "harness") -> dict[str, float]:
  """{"harness/<task>/<metric>": value} of the numeric results, for metrics.jsonl / W&B."""
  out = {}
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
          and key != "alias":
        out[f"{prefix}/{task}/{key.replace(',none', '')}"] = float(value)
  return out
