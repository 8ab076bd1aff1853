"""llama.cpp's GGUF: one file with the architecture's keys, the tokenizer and the
weights, written through the `gguf` package (llama.cpp's own writer, the `gguf` extra).

A pure Mamba-2 model is llama.cpp's `mamba2` architecture; a hybrid of Mamba-2,
attention and MLP layers its `nemotron_h`. The tensors are first named as the
transformers export names them (`convert.params_to_state_dict`, layouts `hf` and
`nemotron_h`), then renamed by gguf's own table (`gguf.get_tensor_name_map`), the
path llama.cpp's convert_hf_to_gguf.py takes from that export, with the same changes
of form: A stored as -exp(A_log), A and D as (heads, 1), the conv kernel without its
unit axis, the gated norm's weight as (groups, d_inner / groups).

The tokenizer goes in as llama.cpp's byte-level BPE ("gpt2"): tokens, token types,
merges, the pre-tokenizer's name and the end-of-text id. The file holds the true
vocabulary (the model's rows past it are padding that nothing samples), so
`tokenizer.ggml.tokens` and the embedding always have the same number of rows.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from mamba_train.errors import UserError
from mamba_train.interop import convert
from mamba_train.interop.export import ExportPathError, NotExpressibleError, refuse_window
from mamba_train.interop.granite import granite_only_problems
from mamba_train.model.config import ATTENTION, MAMBA, MLP, Mamba2Config
from mamba_train.model.lm import Mamba2LM

T = gguf.MODEL_TENSOR
Q = gguf.GGMLQuantizationType
# --dtype -> (the type of the weight matrices, the file type llama.cpp reports).
DTYPES = {"float32": (Q.F32, gguf.LlamaFileType.ALL_F32),
          "bfloat16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
          "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
# Kept float32 in every file, as llama.cpp's converter keeps them: its kernels take
# norms, the conv kernel, A and D (and every 1-D tensor) only in float32.
FLOAT32_KINDS = (T.SSM_CONV1D, T.SSM_A, T.SSM_D)
# llama.cpp has no position limit for these (its converter writes the same); the
# attention layers' cache is sized by the context a user asks for.
CONTEXT_LENGTH = 2 ** 20
GGUF_MAGIC = b"GGUF"


class TokenizerNotExpressibleError(UserError, ValueError):
  """A tokenizer llama.cpp's byte-level BPE cannot reproduce."""


def architecture(cfg: Mamba2Config) -> gguf.MODEL_ARCH:
  """llama.cpp's architecture for `cfg`; refuses, naming each field, what it cannot run."""
  problems = []
  if cfg.ssd_window:
    refuse_window(cfg, "GGUF")
  if cfg.dt_limit != (0.0, math.inf):
    problems.append(f"dt_limit={cfg.dt_limit}: llama.cpp's ssm_scan clamps dt at neither end")
  extra = sorted(set(cfg.pattern) - {MAMBA, ATTENTION, MLP})
  if extra:
    problems.append(f"layer kinds {extra} in layer_pattern {cfg.pattern!r}: this export writes "
                    f"Mamba-2 ('M'), attention ('*') and MLP ('-') layers (mixture-of-experts is "
                    f"llama.cpp's nemotron_h_moe, not built here)")
  if ATTENTION in cfg.pattern and cfg.attn_rotary_emb_dim:
    problems.append("attn_rotary_emb_dim > 0: llama.cpp's nemotron_h attention has no rotary embedding")
  if MLP in cfg.pattern and cfg.mlp_act != "relu2":
    problems.append(f"mlp_act={cfg.mlp_act!r}: llama.cpp's nemotron_h MLP is relu2 (squared ReLU)")
  problems += granite_only_problems(cfg, "GGUF")
  if problems:
    raise NotExpressibleError("Cannot export as GGUF: " + "; ".join(problems))
  return gguf.MODEL_ARCH.MAMBA2 if cfg.pattern == MAMBA * cfg.n_layer else gguf.MODEL_ARCH.NEMOTRON_H


# ----------------------------------------------------------------------------
# The tokenizer.

# The tokenizer.json pre-tokenizers llama.cpp reproduces, by the name it knows them by.
# ByteLevel's own split (use_regex) is GPT-2's regex: llama.cpp's "gpt-2" (as its
# converter names GPT-2's and GPT-NeoX's, Mamba-2's released tokenizer, family).
GPT2_PRE = "gpt-2"
# A Split by one of these regexes (as tokenizer.json spells them) before a ByteLevel
# that does not split again: llama.cpp's name for it, and the model's ignore_merges
# that name implies (llama.cpp's "llama-bpe" looks a whole word up before merging, as
# Llama 3's tokenizer.json asks with ignore_merges; its "qwen2" merges every word).
SPLIT_PRES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": ("llama-bpe", True),
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": ("qwen2", False),
}
# A merge that never applies. llama.cpp refuses a "gpt2" vocabulary without merges and
# gguf's writer refuses an empty array, so the byte tokenizer (no merges) carries this
# one: its halves are two characters each, and with no merge to join them a word's
# symbols stay single characters, so it never matches and no id changes.
NO_MERGE = "ĠĠ ĠĠ"


@dataclass(frozen=True)
class Vocab:
  tokens: list[str]
  types: list[int]
  merges: list[str]
  pre: str
  eos_id: int | None


def _pre_name(spec: dict, has_merges: bool, ignore_merges: bool) -> str | None:
  """llama.cpp's pre-tokenizer name for a tokenizer.json pre_tokenizer, or None."""
  steps = spec.get("pretokenizers", []) if spec.get("type") == "Sequence" else [spec]
  if len(steps) == 2 and steps[0].get("type") == "Split":
    split, byte_level = steps
    name, ignore = SPLIT_PRES.get((split.get("pattern") or {}).get("Regex"), (None, None))
    plain = (split.get("behavior") == "Isolated" and not split.get("invert")
             and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
             and not byte_level.get("add_prefix_space", False))
    return name if plain and ignore == ignore_merges else None
  if spec.get("type") != "ByteLevel" or spec.get("add_prefix_space", False):
    return None
  if not has_merges:  # every byte its own token (the byte tokenizer): no split changes an id
    return GPT2_PRE
  # GPT-2's split, merging every word (llama.cpp's "gpt-2" looks no whole word up first);
  # ByteLevel without its split has no llama.cpp equivalent (llama.cpp always splits).
  return GPT2_PRE if spec.get("use_regex", True) and not ignore_merges else None


def read_vocab(tokenizer_file, rows: int, eos_id: int | None) -> Vocab:
  """The GGUF vocabulary of a tokenizer.json with `rows` ids (the model's vocabulary):
  ids the tokenizer lacks are llama.cpp's unused [PAD<i>] tokens, as its converter writes."""
  blob = json.loads(Path(tokenizer_file).read_text())
  model, decoder = blob.get("model") or {}, blob.get("decoder") or {}
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  pre = _pre_name(blob.get("pre_tokenizer") or {}, bool(merges), bool(model.get("ignore_merges")))
  norm = (blob.get("normalizer") or {}).get("type")
  problems = []
  if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
      or model.get("end_of_word_suffix"):
    problems.append(f"its model is {model.get('type')} (byte-level BPE without byte_fallback or "
                    f"word affixes is what llama.cpp's gpt2 vocabulary holds)")
  if decoder.get("type") != "ByteLevel":
    problems.append(f"its decoder is {decoder.get('type')}, not ByteLevel")
  if pre is None:
    problems.append(f"its pre_tokenizer {json.dumps(blob.get('pre_tokenizer'))[:120]} is not one this "
                    f"export maps to llama.cpp's (ByteLevel; a Split by Llama 3's or Qwen2's regex, then ByteLevel)")
  # NFC: llama.cpp does not normalize; text already in NFC (as most is) tokenizes the same.
  if norm not in (None, "NFC"):
    problems.append(f"its normalizer is {norm}")
  if problems:
    raise TokenizerNotExpressibleError(
        f"Cannot write tokenizer {tokenizer_file} into GGUF: " + "; ".join(problems) +
        ". Export with --format hf and convert with llama.cpp's convert_hf_to_gguf.py")
  vocab = dict(model.get("vocab", {}))
  added = {t["id"]: t for t in blob.get("added_tokens", [])}
  vocab.update({t["content"]: i for i, t in added.items()})
  if max(vocab.values()) >= rows:
    raise TokenizerNotExpressibleError(
        f"Tokenizer {tokenizer_file} has id {max(vocab.values())}, past the model's {rows} rows: "
        f"pass the tokenizer the model was trained with (--tokenizer)")
  by_id = {i: t for t, i in vocab.items()}
  tokens, types = [], []
  for i in range(rows):
    if i not in by_id:
      tokens.append(f"[PAD{i}]")
      types.append(gguf.TokenType.UNUSED)
    else:
      tokens.append(by_id[i])
      types.append(gguf.TokenType.NORMAL if i not in added else
                   gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
  return Vocab(tokens, [int(t) for t in types], merges or [NO_MERGE], pre, eos_id)


def _write_vocab(w: gguf.GGUFWriter, v: Vocab) -> None:
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(v.pre)
  w.add_token_list(v.tokens)
  w.add_token_types(v.types)
  w.add_token_merges(v.merges)
  if v.eos_id is not None:
    # As the transformers export: end-of-text also begins and pads; nothing is
    # added to a prompt (the model was trained on text as it is).
    w.add_eos_token_id(v.eos_id)
    w.add_bos_token_id(v.eos_id)
    w.add_pad_token_id(v.eos_id)
  w.add_add_bos_token(False)
  w.add_add_eos_token(False)


# ----------------------------------------------------------------------------
# The keys and the tensors.


def _write_keys(w: gguf.GGUFWriter, cfg: Mamba2Config, arch: gguf.MODEL_ARCH, dtype: str) -> None:
  w.add_context_length(CONTEXT_LENGTH)
  w.add_embedding_length(cfg.d_model)
  w.add_block_count(cfg.n_layer)
  w.add_ssm_conv_kernel(cfg.d_conv)
  w.add_ssm_inner_size(cfg.d_inner)
  w.add_ssm_state_size(cfg.d_state)
  w.add_ssm_time_step_rank(cfg.nheads)  # llama.cpp's name for the number of heads
  w.add_ssm_group_count(cfg.ngroups)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  if arch == gguf.MODEL_ARCH.MAMBA2:
    w.add_feed_forward_length(0)  # read but unused by llama.cpp's mamba2
    w.add_head_count(0)
  else:
    # llama.cpp tells a layer's kind by these per-layer counts: a Mamba-2 layer has
    # neither key/value heads nor an MLP width, attention only the first, an MLP the second.
    w.add_layer_norm_eps(cfg.norm_eps)  # nemotron_h reads both
    w.add_feed_forward_length([cfg.d_intermediate if k == MLP else 0 for k in cfg.pattern])
    w.add_head_count(cfg.attn_num_heads)
    w.add_head_count_kv([cfg.n_kv_heads if k == ATTENTION else 0 for k in cfg.pattern])
    w.add_key_length(cfg.attn_head_dim)
    w.add_value_length(cfg.attn_head_dim)
  w.add_file_type(DTYPES[dtype][1])
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def gguf_tensors(params: dict, cfg: Mamba2Config, arch: gguf.MODEL_ARCH,
                 rows: int) -> dict[str, tuple[gguf.MODEL_TENSOR, np.ndarray]]:
  """GGUF name -> (its kind, float32 array in llama.cpp's form), the embedding and head
  cut to `rows`. A tied head is left out: llama.cpp then uses the embedding."""
  layout = "hf" if arch == gguf.MODEL_ARCH.MAMBA2 else "nemotron_h"
  sd = convert.params_to_state_dict(params, cfg, layout, vocab_rows=rows)
  if cfg.tie_embeddings:
    sd.pop("lm_head.weight", None)
  names = gguf.get_tensor_name_map(arch, cfg.n_layer)
  out = {}
  for name, a in sd.items():
    # gguf's table knows mamba's dt_proj.bias, which transformers' Mamba-2 calls dt_bias.
    found = names.get_type_and_name(name.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=(".weight", ".bias"))
    if found is None:
      raise KeyError(f"gguf {gguf.__version__} has no name for {name} in {arch.name}")
    kind, new = found
    a = np.asarray(a, np.float32)
    if kind == T.SSM_A:
      a = -np.exp(a)  # llama.cpp takes A itself
    if kind in (T.SSM_A, T.SSM_D):
      a = a.reshape(-1, 1)
    elif kind == T.SSM_CONV1D and a.ndim == 3:
      a = a[:, 0, :]  # (conv_dim, 1, k) -> (conv_dim, k)
    elif kind == T.SSM_NORM:
      a = a.reshape(cfg.ngroups, -1)  # llama.cpp normalizes each group of the gated norm
    out[new] = (kind, np.ascontiguousarray(a))
  return out


def tensor_type(kind: gguf.MODEL_TENSOR, name: str, a: np.ndarray, dtype: str) -> gguf.GGMLQuantizationType:
  """The type `name` is stored in for --dtype `dtype`: the weight matrices in that type,
  the rest float32, as llama.cpp's converter chooses (`FLOAT32_KINDS`)."""
  qtype = DTYPES[dtype][0]
  if (qtype == Q.F32 or a.ndim < 2 or kind in FLOAT32_KINDS or not name.endswith(".weight")
      or name.endswith("_norm.weight")):
    return Q.F32
  block = gguf.GGML_QUANT_SIZES[qtype][0]
  # q8_0 quantizes rows in blocks of 32: a matrix whose rows are not a multiple stays
  # float32 (exact; llama.cpp's converter falls back to float16 there).
  return qtype if a.shape[-1] % block == 0 else Q.F32


# ----------------------------------------------------------------------------
# The file.


def check_out(out, overwrite: bool) -> None:
  """Refuse an `out` that is not <name>.gguf, or that exists and is not a GGUF file
  (or exists and `overwrite` is not given)."""
  out = Path(out)
  if out.suffix != ".gguf":
    raise ExportPathError(f"--out {out}: a GGUF export is one file; name it <name>.gguf")
  if out.is_dir():
    raise ExportPathError(f"--out {out} is a directory; a GGUF export is one file, <name>.gguf")
  if out.exists():
    if not overwrite:
      raise FileExistsError(f"{out} exists; choose another --out or pass --overwrite")
    with open(out, "rb") as f:
      if f.read(4) != GGUF_MAGIC:
        raise ExportPathError(f"{out} is not a GGUF file, so --overwrite will not replace it; "
                              f"choose another --out")


def save_gguf(model: Mamba2LM, out, *, tokenizer_file, eos_token_id: int | None = None,
              dtype: str = "float32", overwrite: bool = False, name: str | None = None) -> Path:
  """`model` as one GGUF file `out` (<name>.gguf) that llama.cpp runs, with the
  tokenizer of `tokenizer_file` (tokenizer.json). Written to a temporary file
  beside `out` and renamed into place; an existing `out` is replaced only when
  asked and only when it is a GGUF file."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  out = Path(out)
  cfg = model.config
  arch = architecture(cfg)  # refusals first, before any work
  check_out(out, overwrite)
  vocab = read_vocab(tokenizer_file, cfg.vocab_size, eos_token_id)
  tensors = gguf_tensors(model.params(), cfg, arch, cfg.vocab_size)

  w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
  w.add_name(name or out.stem)
  _write_keys(w, cfg, arch, dtype)
  _write_vocab(w, vocab)
  for tname, (kind, a) in tensors.items():
    qtype = tensor_type(kind, tname, a, dtype)
    w.add_tensor(tname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
  os.close(fd)
  try:
    w.write_header_to_file(path=Path(tmp))
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return out
