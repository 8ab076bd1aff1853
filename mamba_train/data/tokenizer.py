"""Tokenizers: the byte-level default, a tokenizer.json file, or a transformers name.

Everything is a `tokenizers.Tokenizer` underneath, so preparation, the saved
`tokenizer.json` next to the shards and the exported model all use one format
that `transformers.PreTrainedTokenizerFast(tokenizer_file=...)` reads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

BYTE = "byte"
EOS_TOKEN = "<|endoftext|>"
# EOS names tried, in order, for tokenizers that do not say which token ends text.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
  tokenizer: tokenizers.Tokenizer
  name: str        # what the user passed: "byte", a path, or a transformers name
  eos_id: int
  vocab_size: int  # including added tokens: every id the tokenizer can emit is < this

  @property
  def fingerprint(self) -> str:
    return tokenizer_fingerprint(self.tokenizer)


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's printable stand-in character for each byte, as ByteLevel uses."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  out, extra = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  return out


def byte_tokenizer() -> tokenizers.Tokenizer:
  """Token id b is byte b (0..255); `<|endoftext|>` is 256. No merges.

  Built as a BPE model with an empty merge list over the ByteLevel alphabet, the
  standard way to express bytes in tokenizer.json, so any reader of that format
  decodes it. use_regex=False: with no merges, splitting into words changes no
  id and costs 8x the time.
  """
  vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(EOS_TOKEN, special=True)])
  return tok


def load_tokenizer(spec: str = BYTE, *, eos_token: str | None = None) -> TokenizerInfo:
  """`spec` is "byte", a tokenizer.json path (or a directory holding one), or a
  name transformers can load (it uses its cache; it reaches the network only
  when the name is not cached, which the user asked for by naming it)."""
  if spec == BYTE:
    tok = byte_tokenizer()
    hf_eos = EOS_TOKEN
  elif os.path.exists(spec) or spec.endswith(".json"):  # "org/name" is a hub name
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
      raise FileNotFoundError(
          f"Tokenizer file {path!r} does not exist. Pass 'byte', a tokenizer.json path "
          "or a transformers tokenizer name.")
    tok = tokenizers.Tokenizer.from_file(path)
    hf_eos = None
  else:
    try:
      import transformers  # pylint: disable=import-outside-toplevel
      hf = transformers.AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
      raise ValueError(
          f"Could not load tokenizer {spec!r} with transformers ({e}). Use 'byte', a "
          "tokenizer.json path, or a name that is cached or reachable on the network."
      ) from e
    if not getattr(hf, "is_fast", False):
      raise ValueError(f"Tokenizer {spec!r} has no fast (tokenizers) version; save it "
                       "as tokenizer.json first.")
    tok = hf.backend_tokenizer
    hf_eos = hf.eos_token
  vocab = tok.get_vocab(with_added_tokens=True)
  name = eos_token or hf_eos or next((t for t in _EOS_CANDIDATES if t in vocab), None)
  if name is None or name not in vocab:
    raise ValueError(f"Tokenizer {spec!r} has no end-of-text token "
                     f"(looked for {eos_token or _EOS_CANDIDATES}); pass eos_token=.")
  # Ids can exceed len(vocab) when the vocab has holes; every emitted id is < this.
  vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
  return TokenizerInfo(tok, spec, vocab[name], vocab_size)


def token_bytes(tok: tokenizers.Tokenizer, size: int | None = None) -> list[bytes] | None:
  """The bytes each token id decodes to (special tokens: none, as decoding skips
  them), `size` entries (default: the tokenizer's ids); for matching stop strings
  on the device (`mamba_train.generation.token_byte_table`).

  Exact for ByteLevel decoders (GPT-2, GPT-NeoX, the byte tokenizer): decoding a
  sequence there is joining its tokens' bytes. None for other decoders, whose
  output is not a concatenation (Metaspace drops the first space, WordPiece joins
  with spaces), so a caller falls back to cutting text on the host."""
  decoder = json.loads(tok.to_str()).get("decoder") or {}
  kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
  if kinds != ["ByteLevel"]:
    return None
  to_byte = {ch: b for b, ch in _bytes_to_unicode().items()}
  special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
  size = size or max(tok.get_vocab(with_added_tokens=True).values()) + 1
  out = []
  for i in range(size):
    text = None if i in special else tok.id_to_token(i)
    if text is None:
      out.append(b"")
    elif all(ch in to_byte for ch in text):  # as the ByteLevel decoder maps it
      out.append(bytes(to_byte[ch] for ch in text))
    else:
      out.append(text.encode())
  return out


def tokenizer_fingerprint(tok: tokenizers.Tokenizer) -> str:
  """A hash of what decides the ids (vocab, merges, normalizer, ...), independent of
  where the file came from."""
  blob = json.loads(tok.to_str())
  blob.pop("truncation", None)
  blob.pop("padding", None)
  return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
