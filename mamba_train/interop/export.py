"""Write a model in the layouts other tools serve from.

  * `save_hf`: a transformers directory (`config.json`, `model.safetensors`, and
    tokenizer files when there is a tokenizer) that `Mamba2ForCausalLM.from_pretrained`
    (a pure Mamba-2 model) or `NemotronHForCausalLM.from_pretrained` (a hybrid)
    and `AutoTokenizer.from_pretrained` read with no extra code. transformers
    never ties NemotronH's head, so a hybrid's tied head is written out as
    `lm_head.weight` (and reads back untied, with the same logits).
  * `save_mamba_ssm`: the layout of the released state-spaces/mamba2-* repositories
    (`config.json` + `pytorch_model.bin`); writing the .bin needs torch.

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
from mamba_train.interop import convert
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


def _cast(sd: dict, dtype: str) -> dict:
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  # The router stays float32 (as transformers keeps it: convert.FLOAT32_SUFFIXES).
  keep = lambda k: k.endswith(convert.FLOAT32_SUFFIXES)
  return {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(np.float32 if keep(k) else DTYPES[dtype]))
          for k, v in sd.items()}


def _tokenizer_files(dst: Path, tokenizer_file: Path, eos_token: str | None):
  """tokenizer.json plus the small files AutoTokenizer looks for."""
  shutil.copy(tokenizer_file, dst / "tokenizer.json")
  for name, contents in convert.hf_tokenizer_files(eos_token).items():
    (dst / name).write_text(json.dumps(contents, indent=2))


def save_hf(model: Mamba2LM, out, *, dtype: str = "float32", tokenizer_file=None,
            eos_token: str | None = None, eos_token_id: int | None = None,
            overwrite: bool = False) -> Path:
  from safetensors.numpy import save_file
  cfg = model.config
  refuse_window(cfg, "transformers")
  hybrid = cfg.pattern != "M" * cfg.n_layer
  layout = "nemotron_h" if hybrid else "hf"
  to_config = convert.ours_to_nemotron_h_config if hybrid else convert.ours_to_hf_config
  # Config first: it refuses what the outside model cannot express, before any work.
  hf_cfg = to_config(cfg, vocab_rows=cfg.vocab_size, eos_token_id=eos_token_id,
                     bos_token_id=eos_token_id, pad_token_id=eos_token_id, dtype=dtype)
  # The true vocabulary: transformers then never samples a padding row.
  sd = _cast(convert.params_to_state_dict(model.params(), cfg, layout, vocab_rows=cfg.vocab_size), dtype)
  with _atomic_dir(Path(out), overwrite) as tmp:
    save_file(sd, str(tmp / convert.HF_WEIGHTS), metadata={"format": "pt"})
    (tmp / convert.CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2))
    if tokenizer_file:
      _tokenizer_files(tmp, Path(tokenizer_file), eos_token)
  return Path(out)


def save_mamba_ssm(model: Mamba2LM, out, *, dtype: str = "float32", overwrite: bool = False) -> Path:
  refuse_window(model.config, "mamba_ssm")
  try:
    import torch
  except ImportError as e:
    raise ImportError("Writing pytorch_model.bin needs PyTorch: pip install -e '.[test]' "
                      "(the CPU build torch==2.13.0)") from e
  cfg = model.config
  ssm_cfg = convert.ours_to_mamba_ssm_config(cfg)  # refuses a pattern mamba_ssm cannot hold
  sd = _cast(convert.params_to_state_dict(model.params(), cfg, "mamba_ssm"), dtype)
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  tensors = {}
  for k, v in sd.items():
    t = torch.from_numpy(np.asarray(v, np.float32)) if dtype == "bfloat16" else torch.from_numpy(v)
    tensors[k] = t.to(torch_dtype).contiguous()
  # Tied names share one tensor, as in the released checkpoints.
  for alias, source in convert.tied_aliases(cfg, "mamba_ssm").items():
    tensors[alias] = tensors[source]
  with _atomic_dir(Path(out), overwrite) as tmp:
    torch.save(tensors, tmp / convert.MAMBA_SSM_WEIGHTS)
    (tmp / convert.CONFIG_FILE).write_text(json.dumps(ssm_cfg, indent=2))
  return Path(out)
