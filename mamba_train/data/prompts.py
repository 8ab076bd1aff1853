"""Prompts for GRPO: a jsonl file -> checked rows -> rendered text and token ids -> a
train / eval split, and a resumable iterator over the train prompts.

Input, one JSON object a line, in the layout TRL's GRPOTrainer reads:
  {"prompt": "Q: 2 + 2 = ?\\nA:", "answer": "4"}                      a string, used as it is
  {"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4"}   a conversation
A conversation (messages {"role", "content"} as in chat.py, ending with a user or system
turn) is rendered with the chat template and its generation prompt, as SFT renders the
text before an assistant turn (chat.render_prompt). Every other field is handed to the
reward functions by name (mamba_train/train/rewards.py), one value per completion; a row
without a field that other rows have gives None there, as a `datasets` table holds it.

Every row is read and checked, and every prompt rendered and tokenized, when the file is
loaded: a bad row stops the run with one line naming the file, the line and the fix
before anything compiles.

The split is `chat.split_order`'s (seeded, file order within each split), so the eval
prompts are the same on every run with the same file, fraction and seed.

The iterator yields the global batch of prompts (the same list on every process: each
takes its own rows) in one seeded shuffle per epoch; a batch that crosses the end of an
epoch takes the rest from the next one. Its state is a small JSON dict (epoch, position,
seed, and the number and fingerprint of the prompts it walks), which the Checkpointer
stores as it stores the synthetic stream's (`get_state`/`set_state`); restoring it yields
exactly the batches that would have come next, on any process count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mamba_train.data import chat, tokenizer as tokenizer_lib
from mamba_train.errors import UserError

log = logging.getLogger(__name__)

# The keywords a reward function is called with besides the fields (TRL's names, and the
# run's completion budget): a field by one of these names would be shadowed.
RESERVED_FIELDS = ("prompts", "completions", "completion_ids", "max_completion_length")


class PromptFormatError(UserError, ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Prompt:
  line: int                   # in the file, for messages
  prompt: str | list[dict]    # as the file holds it: what reward functions receive as `prompts`
  fields: dict[str, Any]      # every other field of the row
  text: str = ""              # rendered: what the model continues
  ids: tuple[int, ...] = ()   # its tokens


@dataclasses.dataclass(frozen=True)
class PromptSet:
  train: list[Prompt]
  eval: list[Prompt]
  field_names: tuple[str, ...]  # every field of any row, sorted: the reward functions' keywords
  template: str | None          # the chat template's name (None: no conversation in the file)


def _prompt(value, where: str) -> str | list[dict]:
  if isinstance(value, str):
    if not value.strip():
      raise PromptFormatError(f"{where}: 'prompt' is empty; give the text the model should continue.")
    return value
  if not isinstance(value, list) or not value:
    raise PromptFormatError(f"{where}: 'prompt' must be a string or a non-empty list of messages "
                            f"({{\"role\", \"content\"}}), got {type(value).__name__}.")
  for i, m in enumerate(value, 1):
    if not isinstance(m, dict) or m.get("role") not in chat.ROLES:
      role = m.get("role") if isinstance(m, dict) else None
      raise PromptFormatError(f"{where}: message {i} of 'prompt' has role {role!r}; each message needs "
                              f"a 'role' of {chat.ROLES}.")
    if not isinstance(m.get("content"), str):
      raise PromptFormatError(f"{where}: message {i} ({m['role']}) of 'prompt' has no string 'content'.")
  if value[-1]["role"] == "assistant":
    raise PromptFormatError(f"{where}: 'prompt' ends with an assistant message; a prompt ends with the "
                            f"user (or system) turn the model answers: drop the last message.")
  return [{"role": m["role"], "content": m["content"]} for m in value]


def read_prompts(path: str) -> list[Prompt]:
  """The rows of a prompts jsonl file, checked (not yet rendered); errors name the line."""
  out = []
  try:
    f = open(path, "rb")
  except OSError as e:
    raise PromptFormatError(f"{path}: cannot be read ({e.strerror}); --config.grpo.prompts names a "
                            f".jsonl file with a 'prompt' field on each line.") from None
  with f:
    for n, where, obj in chat.jsonl_objects(f, path, PromptFormatError):
      if not isinstance(obj, dict) or "prompt" not in obj:
        found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise PromptFormatError(f"{where}: each line needs a 'prompt' (a string or a list of messages); "
                                f"found {found}.")
      shadowed = sorted(set(obj) & set(RESERVED_FIELDS))
      if shadowed:
        raise PromptFormatError(f"{where}: field {shadowed[0]!r} is a name reward functions are called "
                                f"with ({', '.join(RESERVED_FIELDS)}); rename it.")
      prompt = _prompt(obj.pop("prompt"), where)
      out.append(Prompt(line=n, prompt=prompt, fields=obj))
  if not out:
    raise PromptFormatError(f"{path}: no prompts (every line is empty).")
  return out


def load_prompts(path: str, *, tokenizer: str = tokenizer_lib.BYTE, eos_token: str | None = None,
                 template: str | None = None, eval_fraction: float = 0.0, seed: int = 0,
                 max_prompt_tokens: int | None = None) -> PromptSet:
  """Reads, checks, renders and tokenizes a prompts file and splits it.

  template: a jinja file for the conversations; default the tokenizer's chat template,
  else chat.DEFAULT_TEMPLATE. max_prompt_tokens: a longer prompt is an error (the
  rollout's prompt buffer has a fixed length), naming how many and the first.
  """
  rows = read_prompts(path)
  tok = tokenizer_lib.load_tokenizer(tokenizer, eos_token=eos_token)
  compiled, template_name = None, None
  if any(not isinstance(r.prompt, str) for r in rows):
    compiled, template_name = chat.resolve_template(tokenizer, template)
  eos_name = tok.tokenizer.id_to_token(tok.eos_id)
  tok.tokenizer.encode_special_tokens = False  # the template's special tokens (EOS) are parsed
  rendered = []
  for r in rows:
    if isinstance(r.prompt, str):
      text = r.prompt
    else:
      try:
        text = chat.render_prompt(compiled, r.prompt, eos_name)
      except Exception as e:  # a template's raise_exception or a jinja error, for this row
        raise PromptFormatError(f"{path}, line {r.line}: the chat template ({template_name}) failed on "
                                f"this conversation: {e}".splitlines()[0]) from None
    ids = tuple(tok.tokenizer.encode(text, add_special_tokens=False).ids)
    if not ids:
      raise PromptFormatError(f"{path}, line {r.line}: the prompt renders to no tokens.")
    rendered.append(dataclasses.replace(r, text=text, ids=ids))
  if max_prompt_tokens is not None:
    long = [p for p in rendered if len(p.ids) > max_prompt_tokens]
    if long:
      raise PromptFormatError(
          f"{path}: {len(long)} prompts are longer than max_prompt_tokens={max_prompt_tokens}, the first "
          f"at line {long[0].line} ({len(long[0].ids)} tokens); raise the limit or shorten those prompts.")
  names = tuple(sorted({k for r in rendered for k in r.fields}))
  split = chat.split_order(len(rendered), eval_fraction, seed)
  out = PromptSet(train=[rendered[i] for i in split["train"]], eval=[rendered[i] for i in split["validation"]],
                  field_names=names, template=template_name)
  log.info("%s: %d train and %d eval prompts; fields %s.", path, len(out.train), len(out.eval), list(names))
  return out


def reward_inputs(batch: Sequence[Prompt], field_names: Sequence[str], group_size: int = 1):
  """(prompts, fields) for the reward functions of `group_size` completions per prompt:
  each prompt and each field's value repeated group_size times, a group's completions
  together (TRL's order); a row without a field gives None."""
  prompts = [p.prompt for p in batch for _ in range(group_size)]
  fields = {k: [p.fields.get(k) for p in batch for _ in range(group_size)] for k in field_names}
  return prompts, fields


def fingerprint(prompts: Sequence[Prompt]) -> str:
  """Of the rendered prompts and their fields, in order: a resume checks it walks the same list."""
  h = hashlib.sha256()
  for p in prompts:
    h.update(json.dumps([p.text, p.fields], sort_keys=True, ensure_ascii=False, default=str).encode())
  return h.hexdigest()[:16]


class PromptIterator:
  """Endless global batches of `batch_size` prompts, reshuffled each epoch; resumable
  through `get_state`/`set_state` (a JSON dict)."""

  def __init__(self, prompts: Sequence[Prompt], batch_size: int, seed: int):
    if not prompts:
      raise PromptFormatError("no train prompts: the prompts file is empty or eval_fraction takes them all.")
    if batch_size < 1:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    if batch_size > len(prompts):
      log.warning("%d prompts, fewer than one batch of %d: a batch repeats prompts.", len(prompts), batch_size)
    self.prompts, self.batch_size, self.seed = list(prompts), batch_size, seed
    self.fingerprint = fingerprint(self.prompts)
    self.epoch, self.position = 0, 0
    self._order = None

  def _epoch_order(self) -> np.ndarray:
    if self._order is None or self._order[0] != self.epoch:
      perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.prompts))
      self._order = (self.epoch, perm)
    return self._order[1]

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
            "prompts": len(self.prompts), "fingerprint": self.fingerprint}

  def set_state(self, state: dict) -> None:
    if state.get("prompts") != len(self.prompts) or state.get("fingerprint") != self.fingerprint:
      raise UserError(f"the checkpoint's prompt iterator walked {state.get('prompts')} prompts (fingerprint "
                      f"{state.get('fingerprint')}), this run has {len(self.prompts)} ({self.fingerprint}); "
                      f"resume with the same prompts file, template and split, or start a new workdir.")
    if state["seed"] != self.seed:
      log.info("the prompt order continues with the checkpoint's seed %d, not %d.", state["seed"], self.seed)
    self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
    self._order = None

  def __iter__(self) -> Iterator[list[Prompt]]:
    return self

  def __next__(self) -> list[Prompt]:
    out = []
    while len(out) < self.batch_size:
      order = self._epoch_order()
      take = order[self.position:self.position + self.batch_size - len(out)]
      out += [self.prompts[i] for i in take]
      self.position += len(take)
      if self.position == len(order):
        self.epoch, self.position = self.epoch + 1, 0
    return out


def eval_batches(prompts: Sequence[Prompt], batch_size: int) -> Iterator[list[Prompt]]:
  """The eval prompts in order, `batch_size` at a time; the last batch may be shorter."""
  for start in range(0, len(prompts), batch_size):
    yield list(prompts[start:start + batch_size])
