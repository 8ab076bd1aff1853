"""Preference data for DPO: jsonl pairs -> chat template -> one packed row per pair.

Input, one JSON object a line, in the layouts TRL's DPOTrainer reads:
  {"prompt": "...", "chosen": "...", "rejected": "..."}              strings
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}  conversational
  {"chosen": [messages], "rejected": [messages]}                     the prompt implicit
with messages {"role", "content"} as in chat.py. A chosen / rejected list that opens
with a non-assistant message is the whole conversation (UltraFeedback's binarized
sets repeat the prompt there, beside a string "prompt"); otherwise it follows the
prompt. Extra fields (scores, ids) are ignored.

Each side is rendered with the chat template as SFT renders it (chat.render), and
its loss mask covers the final assistant turn only: the response being compared.
A row holds the pair: prompt + chosen as example 0, prompt + rejected as example 1
(seq_idx 0 and 1), then padding (seq_idx 2): the packed layout of chat.py, so the
loaders read it unchanged and seq_idx keeps the two responses apart. metadata.json
marks it `packed.preference: true`. A pair longer than a row is dropped, or with
too_long="truncate" each side cut to half a row (kept if both keep a response token).
"""

from __future__ import annotations

import glob
import logging
import os

import numpy as np

from mamba_train.data import chat, prepare, tokenizer as tokenizer_lib

log = logging.getLogger(__name__)


def _messages(value, role: str, where: str, key: str) -> list[dict]:
  if isinstance(value, str):
    return [{"role": role, "content": value}]
  if isinstance(value, list) and value:
    return value
  raise chat.ChatFormatError(f"{where}: {key!r} must be a string or a non-empty list of messages, "
                             f"got {type(value).__name__}.")


def read_pairs(path: str) -> list[tuple[list[dict], list[dict]]]:
  """(chosen conversation, rejected conversation) per line of a jsonl file."""
  out = []
  with open(path, "rb") as f:
    for _, where, obj in chat.jsonl_objects(f, path):
      if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        raise chat.ChatFormatError(f"{where}: a preference pair needs 'chosen' and 'rejected' (and a "
                                   f"'prompt' unless they hold whole conversations); found "
                                   f"{sorted(obj) if isinstance(obj, dict) else type(obj).__name__}.")
      prompt = _messages(obj["prompt"], "user", where, "prompt") if "prompt" in obj else []
      pair = []
      for key in ("chosen", "rejected"):
        msgs = _messages(obj[key], "assistant", where, key)
        whole = isinstance(msgs[0], dict) and msgs[0].get("role") != "assistant"
        conv = chat._conversation({"messages": msgs if whole else prompt + msgs}, f"{where} ({key})")
        if conv[-1]["role"] != "assistant":
          raise chat.ChatFormatError(f"{where}: {key!r} does not end with an assistant response.")
        pair.append(conv)
      out.append(tuple(pair))
  if not out:
    raise chat.ChatFormatError(f"{path}: no preference pairs.")
  return out


def encode_response(tok, template, conv: list[dict], eos_name: str) -> tuple[np.ndarray, np.ndarray]:
  """Token ids of a rendered conversation and a mask on its final assistant turn."""
  pieces = chat.render(template, conv, eos_name)
  last = max(i for i, (_, learn) in enumerate(pieces) if learn)
  return chat.encode(tok, [(t, learn and i == last) for i, (t, learn) in enumerate(pieces)])


def pack_pairs(pairs, row_len: int, too_long: str, eos_id: int):
  """One row per pair: (tokens, loss_mask, seq_idx) arrays (rows, row_len) and counts."""
  if too_long not in chat.TOO_LONG_RULES:
    raise ValueError(f"too_long must be one of {chat.TOO_LONG_RULES}, got {too_long!r}")
  kept, stats = [], dict(examples=len(pairs), dropped=0, truncated=0)
  for sides in pairs:
    if sum(len(ids) for ids, _ in sides) > row_len:
      half = row_len // 2
      if too_long == "drop" or not all(m[:half].any() for _, m in sides):
        stats["dropped"] += 1
        continue
      sides = [(ids[:half], m[:half]) for ids, m in sides]
      stats["truncated"] += 1
    kept.append(sides)
  tokens = np.full((len(kept), row_len), eos_id, np.int64)
  masks = np.zeros((len(kept), row_len), np.uint8)
  seq_idx = np.full((len(kept), row_len), 2, np.uint16)
  for r, sides in enumerate(kept):
    pos = 0
    for j, (ids, mask) in enumerate(sides):
      tokens[r, pos:pos + len(ids)], masks[r, pos:pos + len(ids)] = ids, mask
      seq_idx[r, pos:pos + len(ids)] = j
      pos += len(ids)
  stats.update(rows=len(kept), tokens=int(sum(len(i) for s in kept for i, _ in s)),
               loss_tokens=int(sum(int(m.sum()) for s in kept for _, m in s)))
  stats["efficiency"] = stats["tokens"] / max(1, len(kept) * row_len)
  return tokens, masks, seq_idx, stats


def prepare_preference_dataset(source: str, name: str | None = None, *, root: str = "data",
                               seq_len: int = 2048, tokenizer: str = tokenizer_lib.BYTE,
                               eos_token: str | None = None, template: str | None = None,
                               too_long: str = "drop", val_fraction: float = 0.05, seed: int = 0) -> str:
  """Renders, masks and packs preference jsonl files (a path or glob) into `root/name/`.
  The template as for `chat.prepare_chat_dataset`. Returns the dataset directory."""
  files = sorted(glob.glob(source)) if any(c in source for c in "*?[") else [source]
  if not files:
    raise FileNotFoundError(f"--source {source!r} matches no file")
  for f in files:
    if not os.path.isfile(f):
      raise FileNotFoundError(f"{f} does not exist")
  tok = tokenizer_lib.load_tokenizer(tokenizer, eos_token=eos_token)
  compiled, template_name = chat.resolve_template(tokenizer, template)
  eos_name = tok.tokenizer.id_to_token(tok.eos_id)
  pairs = [tuple(encode_response(tok, compiled, conv, eos_name) for conv in pair)
           for f in files for pair in read_pairs(f)]
  return chat.write_packed(source, name or prepare._default_name(files[0]), root, tok,
                           dict(seq_len=seq_len, too_long=too_long, template=template_name, preference=True),
                           chat.split_order(len(pairs), val_fraction, seed),
                           lambda idx: pack_pairs([pairs[i] for i in idx], seq_len + 1, too_long, tok.eos_id))
