"""Write a model in the layouts other tools serve from.

  * `save_hf`: a transformers directory (`config.json`, `model.safetensors`, and
    tokenizer files when there is a tokenizer) that `Mamba2ForCausalLM.from_pretrained`
    (a pure Mamba-2 model) or `NemotronHForCausalLM.from_pretrained` (a hybrid)
    and `AutoTokenizer.from_pretrained` read with no extra code. transformers
    never ties NemotronH's head, so a hybrid's tied head is written out as
    `lm_head.weight` (and reads back untied, with the same logits).
  * `save_mamba_ssm`: the layout of the released state-spaces/mamba2-* and mamba3-*
    repositories (`config.json` + `pytorch_model.bin`); writing the .bin needs torch.
    The only layout a Mamba-3 model exports to: transformers has no Mamba-3 class.

Files are written into a temporary directory beside `out` and renamed into place,
so an interrupted export never leaves a half directory that looks complete. An
existing `out` is replaced only when asked and only when it is a previous export
(it holds the marker file `MARKER`), never a workdir or an unrelated directory;
`check_out` refuses an `out` equal to, inside or containing what is read, and an
`out` on a bucket (the rename into place needs a local disk; copy the export to a
bucket afterwards). What is read may be on a bucket.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from mamba_train.errors import UserError
from mamba_train.interop import convert, files
from mamba_train.model.config import MAMBA3
from mamba_train.model.lm import Mamba2LM
from mamba_train.workdir import storage

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


MARKER = ".mamba_train_export"  # in every export: what --overwrite may replace


class ExportPathError(UserError, ValueError):
  """An --out that would overwrite or delete something it must not."""


class NotExpressibleError(UserError, ValueError):
  """A model the target format cannot hold without changing its function."""


def refuse_window(cfg, fmt: str) -> None:
  """transformers and mamba_ssm have no windowed SSD: the same weights there would
  compute the exact model, a different function, so a window is refused by name."""
  if cfg.ssd_window:
    raise NotExpressibleError(
        f"Cannot export a model with ssd_window={cfg.ssd_window} as {fmt}: it has no windowed "
        f"SSD, so the exported weights would compute the exact (unwindowed) model. Serve it "
        f"with mamba_train (generate), or finetune with ssd_window=0 before exporting")


def check_out(out, source) -> None:
  """Refuse an output directory equal to, inside or containing `source` (what is read),
  or on a bucket."""
  if storage.is_remote(out):
    raise ExportPathError(f"--out {out} is not a local directory; export to a local one and copy "
                          "it (gcloud storage cp -r OUT gs://...)")
  if storage.is_remote(source):
    return  # a local --out is never inside a bucket
  o, s = Path(out).resolve(), Path(source).resolve()
  if o == s or s in o.parents or o in s.parents:
    where = "is" if o == s else "is inside" if s in o.parents else "contains"
    raise ExportPathError(f"--out {out} {where} the checkpoint {source} it reads; "
                          "choose an --out outside it")


@contextlib.contextmanager
def _atomic_dir(out: Path, overwrite: bool):
  out = Path(out)
  if out.exists() and any(out.iterdir()):
    if not overwrite:
      raise FileExistsError(f"{out} exists and is not empty; choose another --out or pass overwrite")
    if not (out / MARKER).exists():
      raise ExportPathError(f"{out} is not a previous export (it has no {MARKER} file), so "
                            "overwrite will not replace it; choose another --out")
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  try:
    yield tmp
    (tmp / MARKER).write_text("written by mamba_train's export; --overwrite may replace this directory\n")
    if out.exists():
      shutil.rmtree(out)
    os.replace(tmp, out)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)


def _cast(sd: dict, dtype: str, keep_float32: tuple[str, ...]) -> dict:
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  keep = lambda k: k.endswith(keep_float32)  # as the outside model keeps them (the router)
  return {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(np.float32 if keep(k) else DTYPES[dtype]))
          for k, v in sd.items()}


def _tokenizer_files(dst: Path, tokenizer_file: Path, eos_token: str | None):
  """tokenizer.json plus the small files AutoTokenizer looks for."""
  shutil.copy(tokenizer_file, dst / "tokenizer.json")
  for name, contents in files.hf_tokenizer_files(eos_token).items():
    (dst / name).write_text(json.dumps(contents, indent=2))


def _save(model: Mamba2LM, out, layout: str, *, dtype: str, overwrite: bool,
          eos_token_id: int | None = None, tokenizer=None) -> Path:
  """`model` written in `layout` (a row of convert.LAYOUTS) into `out`.
  tokenizer: (tokenizer.json's path, its EOS token) or None."""
  row, cfg = convert.LAYOUTS[layout], model.config
  row.weights.writable()
  rows = None if row.padded_vocab else cfg.vocab_size
  # Config first: it refuses what the outside model cannot express, before any work.
  outside_cfg = row.write_config(cfg, vocab_rows=rows, eos_token_id=eos_token_id,
                                 bos_token_id=eos_token_id, pad_token_id=eos_token_id, dtype=dtype)
  sd = _cast(convert.params_to_state_dict(model.params(), cfg, layout, vocab_rows=rows), dtype,
             row.float32_suffixes)
  with _atomic_dir(Path(out), overwrite) as tmp:
    row.weights.write(sd, tmp, convert.tied_aliases(cfg, layout))
    (tmp / files.CONFIG_FILE).write_text(json.dumps(outside_cfg, indent=2))
    if tokenizer:
      _tokenizer_files(tmp, *tokenizer)
  return Path(out)


def save_hf(model: Mamba2LM, out, *, dtype: str = "float32", tokenizer_file=None,
            eos_token: str | None = None, eos_token_id: int | None = None,
            overwrite: bool = False) -> Path:
  refuse_window(model.config, "transformers")
  cfg = model.config
  if MAMBA3 in cfg.pattern:
    raise NotExpressibleError("Cannot export a Mamba-3 model ('3' layers) as transformers: it has no "
                              "Mamba-3 class; export with --format mamba_ssm")
  # A pure Mamba-2 model as Mamba2ForCausalLM; a hybrid as NemotronH. The true
  # vocabulary: transformers then never samples a padding row.
  layout = "hf" if cfg.pattern == "M" * cfg.n_layer else "nemotron_h"
  return _save(model, out, layout, dtype=dtype, overwrite=overwrite, eos_token_id=eos_token_id,
               tokenizer=(Path(tokenizer_file), eos_token) if tokenizer_file else None)


def save_mamba_ssm(model: Mamba2LM, out, *, dtype: str = "float32", overwrite: bool = False) -> Path:
  refuse_window(model.config, "mamba_ssm")
  return _save(model, out, "mamba_ssm", dtype=dtype, overwrite=overwrite)
