"""Instruction and chat data: jsonl -> chat template -> tokens with a loss mask -> packed rows.

Input, one JSON object a line, either
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
  {"prompt": "...", "response": "..."}   (a user turn and an assistant turn)

Rendering uses the tokenizer's chat template (jinja, in a sandbox, as
transformers renders it) or DEFAULT_TEMPLATE for tokenizers without one. The
loss mask is 1 on the tokens of each assistant turn (its content and whatever
the template closes it with, e.g. EOS) and 0 elsewhere: the text an assistant
turn adds is what rendering the conversation up to it adds beyond the same
conversation rendered with a generation prompt.

Packing: examples are placed whole into rows of seq_len + 1 tokens, first fit
among the open rows, in file order; each row stores its tokens, mask and the
example number of each position (seq_idx), so no state crosses examples. An
example longer than a row follows the `too_long` rule: "drop" it, or
"truncate" it to the row (kept if an assistant token survives).

Layout of a prepared instruction set `data/<name>/`: per split
`{split}.tokens.npy`, `{split}.loss_mask.npy` (uint8), `{split}.seq_idx.npy`
(uint16), each (rows, seq_len + 1); tokenizer.json; metadata.json with
`packed: {seq_len, too_long, template}`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import numpy as np

from mamba_train.errors import UserError
from mamba_train.data import prepare
from mamba_train.data import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
TOO_LONG_RULES = ("drop", "truncate")
# Zephyr-style turns; the assistant turn ends with EOS, so a finetuned model learns to stop.
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ChatFormatError(UserError, ValueError):
  pass


def jsonl_objects(f, path: str, error: type[Exception] = ChatFormatError):
  """(line number, "<path>, line <n>", the line's JSON value) for each non-blank line of the
  binary file `f`: the one reader of the chat, preference and prompts files, so that a bad
  line gets the same message, naming the line and the fix, in all of them."""
  for n, raw in enumerate(f, 1):
    where = f"{path}, line {n}"
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise error(f"{where}: not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                  f"{e.start + 1}); re-encode the file as UTF-8.") from None
    if not line.strip():
      continue
    try:
      yield n, where, json.loads(line)
    except json.JSONDecodeError as e:
      raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno}).") from None


def read_chat_jsonl(path: str) -> list[list[dict]]:
  """Conversations (lists of {role, content}) of a jsonl file; errors name the line."""
  with open(path, "rb") as f:
    out = [_conversation(obj, where) for _, where, obj in jsonl_objects(f, path)]
  if not out:
    raise ChatFormatError(f"{path}: no examples.")
  return out


def _conversation(obj, where: str) -> list[dict]:
  if not isinstance(obj, dict):
    raise ChatFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
  if "messages" in obj:
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
      raise ChatFormatError(f"{where}: 'messages' must be a non-empty list.")
  elif "prompt" in obj or "response" in obj:
    for key in ("prompt", "response"):
      if not isinstance(obj.get(key), str):
        raise ChatFormatError(f"{where}: needs string fields 'prompt' and 'response' "
                              f"({key!r} is {'missing' if key not in obj else 'not a string'}).")
    msgs = [{"role": "user", "content": obj["prompt"]},
            {"role": "assistant", "content": obj["response"]}]
  else:
    raise ChatFormatError(f"{where}: no 'messages' (role/content) or 'prompt'/'response' "
                          f"field; found {sorted(obj)}.")
  for i, m in enumerate(msgs, 1):
    if not isinstance(m, dict) or "role" not in m:
      raise ChatFormatError(f"{where}: message {i} has no 'role'.")
    if m["role"] not in ROLES:
      raise ChatFormatError(f"{where}: message {i} has role {m['role']!r}, not one of {ROLES}.")
    if not isinstance(m.get("content"), str):
      raise ChatFormatError(f"{where}: message {i} ({m['role']}) has no string 'content'.")
    if m["role"] == "assistant" and not m["content"].strip():
      raise ChatFormatError(f"{where}: message {i} is an empty assistant response.")
  if not any(m["role"] == "assistant" for m in msgs):
    raise ChatFormatError(f"{where}: no assistant message, so nothing to learn from.")
  return [{"role": m["role"], "content": m["content"]} for m in msgs]


def chat_template(tokenizer: str) -> str | None:
  """The chat template shipped with a tokenizer (tokenizer_config.json beside it,
  or transformers' for a hub name), or None."""
  if tokenizer == tokenizer_lib.BYTE:
    return None
  d = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
  if os.path.exists(tokenizer):
    for name in ("chat_template.jinja", "tokenizer_config.json"):
      path = os.path.join(d, name)
      if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
          return f.read() if name.endswith(".jinja") else json.load(f).get("chat_template")
    return None
  import transformers  # pylint: disable=import-outside-toplevel
  return getattr(transformers.AutoTokenizer.from_pretrained(tokenizer), "chat_template", None)


def compile_template(source: str):
  """A jinja template compiled as transformers compiles chat templates."""
  from jinja2 import ext, sandbox  # pylint: disable=import-outside-toplevel

  def raise_exception(message):
    raise ChatFormatError(f"chat template: {message}")

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
  env.globals.update(raise_exception=raise_exception,
                     strftime_now=lambda fmt: time.strftime(fmt))
  return env.from_string(source)


def render(template, messages: list[dict], eos_token: str, bos_token: str = "") -> list[tuple[str, bool]]:
  """[(text, learn)] pieces whose concatenation is the rendered conversation;
  learn is True for the text each assistant turn adds."""
  def text(msgs, gen=False):
    return template.render(messages=msgs, add_generation_prompt=gen, eos_token=eos_token,
                           bos_token=bos_token)

  pieces, done = [], ""
  for k, m in enumerate(messages):
    if m["role"] == "assistant":
      prompt = text(messages[:k], gen=True)
      if not prompt.startswith(done):
        raise ChatFormatError("chat template output is not append-only across turns")
      pieces.append((prompt[len(done):], False))
      done = prompt
    full = text(messages[:k + 1])
    if not full.startswith(done):
      raise ChatFormatError("chat template output is not append-only across turns")
    pieces.append((full[len(done):], m["role"] == "assistant"))
    done = full
  return [(t, learn) for t, learn in pieces if t]


def render_prompt(template, messages: list[dict], eos_token: str, bos_token: str = "") -> str:
  """A conversation rendered to be continued by the model: the template with its
  generation prompt, as SFT renders the text before each assistant turn."""
  return template.render(messages=messages, add_generation_prompt=True, eos_token=eos_token,
                         bos_token=bos_token)


def encode(tok: tokenizer_lib.TokenizerInfo, pieces) -> tuple[np.ndarray, np.ndarray]:
  """Token ids and their learn mask; special tokens in the template (EOS) are parsed."""
  ids, mask = [], []
  tok.tokenizer.encode_special_tokens = False
  for t, learn in pieces:
    e = tok.tokenizer.encode(t, add_special_tokens=False).ids
    ids += e
    mask += [learn] * len(e)
  return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)


def pack(examples, row_len: int, too_long: str, eos_id: int):
  """First-fit packing of (ids, mask) examples into rows of row_len tokens.

  Returns (tokens, mask, seq_idx) arrays of shape (rows, row_len) and counts.
  Padding is EOS with mask 0, each pad run its own seq_idx.
  """
  if too_long not in TOO_LONG_RULES:
    raise ValueError(f"too_long must be one of {TOO_LONG_RULES}, got {too_long!r}")
  rows, free = [], []  # rows: lists of example indices; free: room left per row
  kept, stats = [], dict(examples=len(examples), dropped=0, truncated=0)
  for ids, mask in examples:
    if len(ids) > row_len:
      if too_long == "drop" or not mask[:row_len].any():
        stats["dropped"] += 1
        continue
      ids, mask = ids[:row_len], mask[:row_len]
      stats["truncated"] += 1
    kept.append((ids, mask))
    n = len(ids)
    r = next((r for r in range(max(0, len(rows) - 64), len(rows)) if free[r] >= n), None)
    if r is None:  # first fit among the last 64 rows keeps this linear in the file size
      rows.append([])
      free.append(row_len)
      r = len(rows) - 1
    rows[r].append(len(kept) - 1)
    free[r] -= n
  tokens = np.full((len(rows), row_len), eos_id, np.int64)
  masks = np.zeros((len(rows), row_len), np.uint8)
  seq_idx = np.zeros((len(rows), row_len), np.uint16)
  for r, members in enumerate(rows):
    pos = 0
    for j, e in enumerate(members):
      ids, mask = kept[e]
      tokens[r, pos:pos + len(ids)], masks[r, pos:pos + len(ids)] = ids, mask
      seq_idx[r, pos:pos + len(ids)] = j
      pos += len(ids)
    seq_idx[r, pos:] = len(members)
  stats.update(rows=len(rows), tokens=int(sum(len(i) for i, _ in kept)),
               loss_tokens=int(sum(int(m.sum()) for _, m in kept)))
  stats["efficiency"] = stats["tokens"] / max(1, len(rows) * row_len)
  return tokens, masks, seq_idx, stats


def resolve_template(tokenizer: str, template: str | None):
  """(compiled template, its name for the metadata): a jinja file, else the tokenizer's
  own chat template, else DEFAULT_TEMPLATE."""
  if template:
    with open(template, encoding="utf-8") as f:
      return compile_template(f.read()), template
  source = chat_template(tokenizer)
  return compile_template(source or DEFAULT_TEMPLATE), "tokenizer" if source else "default"


def split_order(n: int, val_fraction: float, seed: int) -> dict[str, list[int]]:
  """{train, validation}: example indices, in file order within each split."""
  order = np.random.default_rng(seed).permutation(n)
  n_val = min(n - 1, max(1, round(val_fraction * n))) if val_fraction > 0 else 0
  return {"train": sorted(order[n_val:]), "validation": sorted(order[:n_val])}


def write_packed(source: str, name: str, root: str, tok: tokenizer_lib.TokenizerInfo, packed: dict,
                 splits: dict, pack_split) -> str:
  """Writes a packed dataset `root/name/` (the layout in the module doc): for each split
  with examples, `pack_split(indices) -> (tokens, mask, seq_idx, stats)`. Returns the path."""
  out = os.path.join(root, name)
  tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  dtype = prepare.shard_dtype(tok.vocab_size)
  try:
    meta = dict(format_version=prepare.FORMAT_VERSION, name=name, source=source,
                tokenizer=tok.name, tokenizer_fingerprint=tok.fingerprint,
                vocab_size=tok.vocab_size, eos_id=tok.eos_id, dtype=dtype.name,
                fingerprint=None, packed=packed, splits={},
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    tok.tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    max_id = 0
    for split, idx in splits.items():
      if not idx:
        continue
      tokens, masks, seq_idx, stats = pack_split(idx)
      if not len(tokens):
        raise ValueError(f"{source}: no {split} example fits in {packed['seq_len'] + 1} tokens "
                         f"(too_long={packed['too_long']!r}); raise seq_len or use too_long='truncate'.")
      files = {}
      for field, arr in (("tokens", tokens.astype(dtype)), ("loss_mask", masks), ("seq_idx", seq_idx)):
        files[field] = f"{split}.{field}.npy"
        np.save(os.path.join(tmp, files[field]), arr)
      max_id = max(max_id, int(tokens.max()))
      meta["splits"][split] = dict(files=files, documents=len(idx), **stats)
      log.info("%s (%s): %d examples in %d rows (%.1f%% of tokens are not padding), "
               "%d dropped, %d truncated (too_long=%s).", source, split, len(idx),
               stats["rows"], 100 * stats["efficiency"], stats["dropped"], stats["truncated"],
               packed["too_long"])
    meta["max_token_id"] = max_id
    with open(os.path.join(tmp, "metadata.json"), "w") as f:
      json.dump(meta, f, indent=2)
    prepare._publish(tmp, out, None)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out


def prepare_chat_dataset(source: str, name: str | None = None, *, root: str = "data",
                         seq_len: int = 2048, tokenizer: str = tokenizer_lib.BYTE,
                         eos_token: str | None = None, template: str | None = None,
                         too_long: str = "drop", val_fraction: float = 0.05, seed: int = 0) -> str:
  """Renders, masks and packs a chat/instruction jsonl file into `root/name/`.

  template: a jinja file; default the tokenizer's own chat template, else
  DEFAULT_TEMPLATE. Returns the dataset directory.
  """
  tok = tokenizer_lib.load_tokenizer(tokenizer, eos_token=eos_token)
  compiled, template_name = resolve_template(tokenizer, template)
  eos_name = tok.tokenizer.id_to_token(tok.eos_id)
  examples = [encode(tok, render(compiled, c, eos_name)) for c in read_chat_jsonl(source)]
  return write_packed(source, name or prepare._default_name(source), root, tok,
                      dict(seq_len=seq_len, too_long=too_long, template=template_name),
                      split_order(len(examples), val_fraction, seed),
                      lambda idx: pack([examples[i] for i in idx], seq_len + 1, too_long, tok.eos_id))
