"""Our model behind lm-evaluation-harness's model interface (`pip install -e ".[eval]"`).

`HarnessLM` is an `lm_eval.api.model.TemplateLM`: lm-eval's own code turns
(context, continuation) pairs into tokens (trailing spaces of the context move to
the continuation; the whole string is encoded and split; an empty context is
conditioned on EOS), exactly as its `hf` backend does, so scores compare with
published ones. Scoring is one jitted forward over right-padded rows (lengths and
batch rounded up so few programs serve a task); rolling loglikelihoods use lm-eval's
disjoint windows of `max_length`; `generate_until` runs `mamba_train.generate`
batched on the device, where a row stops at EOS or once its text holds one of its
stop sequences (matched on the device against the tokens' bytes), and the loop
when every row has stopped or max_gen_toks ran out; the text is then cut at the
first stop sequence, as the `hf` backend does after its stopping criteria.

batch_size is an int, "auto" or "auto:N", as lm-eval's `hf` backend reads it:
"auto" takes the largest of max_batch_size, max_batch_size/2, ... whose scoring
program fits the device's free memory (XLA's own memory analysis of the compiled
program, where the hf backend runs forwards until one does not fail), at the
longest request; "auto:N" detects again at N points as the requests shorten.
Generation detects at max_length, as the hf backend does; a scoring forward there
needs more memory than prefill and decoding. Devices that report no memory limit
(the CPU) take max_batch_size. The sizes found are in lm-eval's results, under
config.batch_sizes.

Several devices or processes (`mesh`: the training mesh in the in-training hook,
all devices in `scripts/eval.py`): every process builds the same requests in the
same order, as lm-eval does, and each scoring forward is one global batch whose
rows split over the mesh's data-parallel axes (data x fsdp), so each replica scores
its own share of the requests: batch_size is per replica, as lm-eval's is per
device in its data-parallel runs, and a forward scores batch_size x replicas
requests. Each device runs the program a single device would on its rows, so the
scores equal a single process's. They come back whole on every process
(`sharding.to_host`), and detected batch sizes are the least over processes so the
programs agree; process 0 writes. Generation (`generate_until`) is not split: every
process runs every batch.

lm_eval is imported when this module is, not by `import mamba_train`.
"""

from __future__ import annotations

import difflib
import functools
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

from mamba_train.data.tokenizer import TokenizerInfo, token_bytes  # noqa: E402
from mamba_train.generation import generate, round_up_pow2, token_byte_table  # noqa: E402
from mamba_train.model.lm import Mamba2LM  # noqa: E402
from mamba_train.parallel import sharding  # noqa: E402

log = logging.getLogger(__name__)
DEFAULT_MAX_LENGTH = 2048  # lm-eval's own default for models that state none
DEFAULT_MAX_BATCH_SIZE = 64  # lm-eval's hf backend's
MIN_WIDTH = 16  # rows are padded to a power of two at least this long


@functools.partial(jax.jit, static_argnums=0)
def _log_probs(graphdef, params, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(log p(ids[:, t+1] | ids[:, :t+1]), is that token the argmax), each (b, l-1)."""
  logits = nnx.merge(graphdef, params)(ids[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  target = ids[:, 1:]
  picked = jnp.take_along_axis(logp, target[..., None], -1)[..., 0]
  return picked, jnp.argmax(logits, axis=-1) == target


_SCORERS: dict = {}


def _scorer(graphdef, params, rows: int, width: int, ids_sharding=None):
  """The compiled scoring program for (rows, width) ids, shared by every HarnessLM
  of the same model shape (a task, the next hook call, batch size detection)."""
  key = (graphdef, rows, width, ids_sharding, tuple((a.shape, a.dtype, getattr(a, "sharding", None))
                                                    for a in jax.tree.leaves(params)))
  if key not in _SCORERS:
    ids = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=ids_sharding)
    _SCORERS[key] = _log_probs.lower(graphdef, params, ids).compile()
  return _SCORERS[key]


def _row_sharding(mesh) -> tuple[jax.sharding.NamedSharding | None, int]:
  """(the sharding of a scoring batch's rows over the mesh's data-parallel axes, how
  many replicas that makes); (None, 1) without a mesh."""
  if mesh is None:
    return None, 1
  axes = sharding.logical_to_spec(("batch",))[0]  # the batch's axes in the rules table
  return (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axes)),
          sharding.axes_size(mesh, axes))


def on_mesh(model: Mamba2LM, mesh) -> Mamba2LM:
  """`model` with its parameters replicated on every device of `mesh` (each process
  passes the same weights: every one loaded them from the same files)."""
  graphdef, params = nnx.split(model)
  everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def place(x):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, everywhere, lambda index: host[index])
  return nnx.merge(graphdef, jax.tree.map(place, params))


def _free_device_bytes() -> int | None:
  """Free memory of this process's first device; None where it reports no limit (CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def parse_batch_size(spec) -> tuple[int | str, float]:
  """lm-eval's batch_size: an int >= 1, "auto" or "auto:N" -> (int or "auto", N)."""
  text = str(spec).strip()
  if text.startswith("auto"):
    head, _, n = text.partition(":")
    try:
      schedule = float(n) if n else 1.0
    except ValueError:
      schedule = 0.0
    if head == "auto" and schedule >= 1:
      return "auto", schedule
  elif text.isdigit() and int(text) >= 1:
    return int(text), 1.0
  raise ValueError(f"batch_size {spec!r}: give an integer >= 1, 'auto' (the largest that fits "
                   "the device, up to max_batch_size) or 'auto:N' (detected again N times as "
                   "requests shorten), as lm-eval reads it")


class HarnessLM(TemplateLM):
  """lm-eval's view of a Mamba2LM and its tokenizer."""

  def __init__(self, model: Mamba2LM, tokenizer: TokenizerInfo, *, batch_size: int | str = 16,
               max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, max_length: int = DEFAULT_MAX_LENGTH,
               max_gen_toks: int = 256, mesh=None):
    """`mesh`: the devices the parameters are on; the scoring rows split over its
    data-parallel axes (batch_size rows a replica). None: one device."""
    super().__init__()
    self._ids_sharding, self.replicas = _row_sharding(mesh)
    self.batch_size, self.batch_schedule = parse_batch_size(batch_size)
    if int(max_batch_size) < 1:
      raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    self.batch_size_spec, self.max_batch_size = batch_size, int(max_batch_size)
    self.batch_sizes: dict[int, int] = {}  # detected, by schedule slot (lm-eval reports these)
    self.model, self.tok = model, tokenizer
    self._graphdef, self._params = nnx.split(model)
    self.tok.tokenizer.encode_special_tokens = False  # special tokens in text are parsed, as in hf
    self.max_length, self.max_gen_toks = max_length, max_gen_toks
    table = token_bytes(tokenizer.tokenizer, model.config.vocab_size)
    if table is None:
      log.warning("tokenizer %s has no ByteLevel decoder: generate_until stops rows at EOS and "
                  "max_gen_toks on the device and cuts stop sequences on the host", tokenizer.name)
    self._token_bytes = None if table is None else jnp.asarray(token_byte_table(table))

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
    self.batch_sizes = {}  # as the hf backend: detected afresh for each set of requests
    start = 0
    while start < len(order):
      longest = min(len(pairs[order[start]][0]) + len(pairs[order[start]][1]), self.max_length + 1)
      rows = self._rows(start, len(order), round_up_pow2(longest, MIN_WIDTH)) * self.replicas
      idx = order[start:start + rows]
      start += rows
      seqs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1):] for i in idx]
      width = round_up_pow2(max(len(s) for s in seqs), MIN_WIDTH)
      ids = np.full((rows, width), self.eot_token_id, np.int32)
      for r, s in enumerate(seqs):
        ids[r, :len(s)] = s
      program = _scorer(self._graphdef, self._params, rows, width, self._ids_sharding)
      logp, greedy = map(sharding.to_host, program(self._params, self._put(ids)))
      for r, (i, s) in enumerate(zip(idx, seqs)):
        n = len(pairs[i][1])
        cols = slice(len(s) - 1 - n, len(s) - 1)  # positions that predict the continuation
        out[i] = (float(logp[r, cols].sum()), bool(greedy[r, cols].all()))
    return out

  def _put(self, ids: np.ndarray) -> jax.Array:
    """The batch on the devices: each replica its rows (every process holds all of them)."""
    if self._ids_sharding is None:
      return jnp.asarray(ids)
    return jax.make_array_from_callback(ids.shape, self._ids_sharding, lambda index: ids[index])

  # --- batch size: fixed, or detected as lm-eval's hf backend does ----------------

  def _rows(self, pos: int, total: int, width: int) -> int:
    """Rows per batch at request `pos` of `total` (sorted longest first)."""
    if self.batch_size != "auto":
      return self.batch_size
    slot = pos // max(1, int(total / self.batch_schedule))
    if slot not in self.batch_sizes:
      self.batch_sizes[slot] = self.detect_batch_size(width)
      log.info("batch_size %s: %d rows for requests of up to %d tokens", self.batch_size_spec,
               self.batch_sizes[slot], width)
    return self.batch_sizes[slot]

  def detect_batch_size(self, width: int) -> int:
    """The largest of max_batch_size, max_batch_size/2, ..., 1 whose scoring program at
    `width` tokens fits the device's free memory (max_batch_size where the device
    reports no limit), the least over processes."""
    rows, free = self.max_batch_size, _free_device_bytes()
    while free is not None and rows > 1 and not self._fits(rows, width, free):
      rows //= 2
    if jax.process_count() > 1:  # every process must run the same programs
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      rows = int(np.min(multihost_utils.process_allgather(np.int32(rows))))
    return rows

  def _fits(self, rows: int, width: int, free: int) -> bool:
    try:
      m = _scorer(self._graphdef, self._params, rows * self.replicas, width,
                  self._ids_sharding).memory_analysis()
    except jax.errors.JaxRuntimeError as e:  # a TPU compile refuses what cannot fit
      if "RESOURCE_EXHAUSTED" in str(e):
        return False
      raise
    # The parameters are resident already; the program adds its temporaries, its
    # outputs and the ids.
    return m.temp_size_in_bytes + m.output_size_in_bytes + rows * width * 4 <= free

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

    def stops(req) -> list[str]:  # the hf backend's: the task's `until`, then the EOS text
      until = req.args[1].get("until") or []
      if not isinstance(until, (str, list, tuple)):
        raise ValueError(f"generation_kwargs until must be a string or a list, got {until!r}")
      return [s for s in [*([until] if isinstance(until, str) else until), eos_text] if s]

    rows = self.batch_size
    if rows == "auto":  # the hf backend detects once, at max_length
      rows = self.batch_sizes[0] = self.detect_batch_size(round_up_pow2(self.max_length, MIN_WIDTH))
    for (max_new, temperature), idx in groups.items():
      for start in range(0, len(idx), rows):
        batch = idx[start:start + rows]
        prompts = [np.asarray(self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):]
                              or [self.eot_token_id], np.int32) for i in batch]
        until = [stops(requests[i]) for i in batch]
        on_device = self._token_bytes is not None
        full = generate(self.model, prompts, max_new, temperature=temperature,
                        eos_id=self.eot_token_id, max_prompt_len=max(self.max_length, 1),
                        stop_strings=until if on_device else None,
                        token_bytes=self._token_bytes if on_device else None)
        for i, p, row, row_stops in zip(batch, prompts, full, until):
          new = row[len(p):]
          cut = np.flatnonzero(new == self.eot_token_id)  # EOS, or the padding after a stop
          text = self.tok_decode(new[:cut[0]] if len(cut) else new)
          for stop in row_stops:
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
              bootstrap_iters: int = 100_000, env_info: bool = True) -> dict:
  """lm-eval's `simple_evaluate` on our model; returns its results dict.
  bootstrap_iters (lm-eval's default) only sizes the standard errors; 0 skips them.
  env_info=False leaves out lm-eval's report of the environment (torch's collect_env,
  which runs pip and nvidia-smi, about 1.5 s), which only its results files show."""
  import lm_eval  # pylint: disable=import-outside-toplevel
  from lm_eval import evaluator  # pylint: disable=import-outside-toplevel
  manager = manager or task_manager(tasks=tasks)
  tasks = check_tasks(tasks, manager)
  report = evaluator.add_env_info
  if not env_info:
    evaluator.add_env_info = lambda results: None
  try:
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=log_samples,
                                   # No torch seed: our model draws nothing from torch, and
                                   # seeding it would import torch (3 s of CPU).
                                   random_seed=seed, numpy_random_seed=seed, torch_random_seed=None,
                                   fewshot_random_seed=seed, batch_size=lm.batch_size_spec,
                                   max_batch_size=lm.max_batch_size,
                                   bootstrap_iters=bootstrap_iters)
  finally:
    evaluator.add_env_info = report


def flat_metrics(results: dict, prefix: str = "harness") -> dict[str, float]:
  """{"harness/<task>/<metric>": value} of the numeric results, for metrics.jsonl / W&B."""
  out = {}
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
          and key != "alias":
        out[f"{prefix}/{task}/{key.replace(',none', '')}"] = float(value)
  return out
