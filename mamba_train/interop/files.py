"""The outside layouts' files: their names, config.json as they write it, and the
two weight file formats (transformers' safetensors, mamba_ssm's pytorch_model.bin),
each read from a directory (local or on a bucket) and written into one."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from etils import epath

from mamba_train.workdir import storage

CONFIG_FILE = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded safetensors: name -> file
MAMBA_SSM_WEIGHTS = "pytorch_model.bin"
# transformers writes an infinite float this way; plain JSON has no infinity.
JSON_INFINITY = {"__float__": "Infinity"}


def read_json(path) -> dict:
  """A JSON file; `path` may be an epath.Path on a bucket."""
  with path.open() if hasattr(path, "open") else open(path) as f:
    return json.load(f)


def json_float(v) -> float:
  """A float of an outside config.json, JSON_INFINITY included."""
  if isinstance(v, dict) and "__float__" in v:
    return float(v["__float__"])
  return float(v)


def hf_tokenizer_files(eos_token: str | None) -> dict[str, dict]:
  """The two small files beside tokenizer.json that transformers' AutoTokenizer reads."""
  files = {"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                     "model_max_length": 1_000_000_000}}
  if eos_token:
    special = {k: eos_token for k in ("eos_token", "bos_token", "unk_token", "pad_token")}
    files["tokenizer_config.json"].update(special)
    files["special_tokens_map.json"] = special
  return files


def _torch(message: str):
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(message) from e
  return torch


_WRITE_NEEDS_TORCH = (f"Writing {MAMBA_SSM_WEIGHTS} needs PyTorch: pip install -e '.[test]' "
                      "(the CPU build torch==2.13.0)")


def read_safetensors(path: epath.Path) -> dict[str, np.ndarray]:
  """Every tensor of a transformers directory: model.safetensors, or the shards its
  index names."""
  from safetensors.numpy import load, load_file
  index = path / HF_WEIGHTS_INDEX
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  elif (path / HF_WEIGHTS).exists():
    files = [HF_WEIGHTS]
  else:
    raise FileNotFoundError(f"{path} has no model.safetensors (nor a sharded index): "
                            f"save the model with save_pretrained(..., safe_serialization=True)")
  sd = {}
  for f in files:
    sd.update(load((path / f).read_bytes()) if storage.is_remote(path) else load_file(str(path / f)))
  return sd


def write_safetensors(sd: dict[str, np.ndarray], directory: Path, aliases: dict[str, str]) -> None:
  """Each name its own copy, aliases included: safetensors holds no shared tensors."""
  del aliases
  from safetensors.numpy import save_file
  save_file(sd, str(directory / HF_WEIGHTS), metadata={"format": "pt"})


def read_torch_bin(path: epath.Path) -> dict[str, np.ndarray]:
  """pytorch_model.bin of a mamba_ssm directory, floats as float32."""
  file = path / MAMBA_SSM_WEIGHTS
  torch = _torch(f"Reading {file} needs PyTorch: pip install -e '.[test]' "
                 f"(which installs the CPU build torch==2.13.0)")
  if not file.exists():
    raise FileNotFoundError(f"{file} is missing")
  src = io.BytesIO(file.read_bytes()) if storage.is_remote(file) else str(file)
  sd = torch.load(src, map_location="cpu", weights_only=True)
  return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in sd.items()}


def write_torch_bin(sd: dict[str, np.ndarray], directory: Path, aliases: dict[str, str]) -> None:
  """Each tensor in its array's dtype; an alias shares its source's tensor, as in the
  released checkpoints."""
  import ml_dtypes
  torch = _torch(_WRITE_NEEDS_TORCH)
  # numpy's bfloat16 is ml_dtypes', which torch.from_numpy does not take: through float32.
  tensors = {k: torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16).contiguous()
             if v.dtype == ml_dtypes.bfloat16 else torch.from_numpy(v).contiguous() for k, v in sd.items()}
  for alias, source in aliases.items():
    tensors[alias] = tensors[source]
  torch.save(tensors, directory / MAMBA_SSM_WEIGHTS)


@dataclass(frozen=True)
class WeightFile:
  """A weight file format: the file's name and how a directory's tensors are read
  and written (`write(state dict, directory, {alias: source})`)."""
  name: str
  read: Callable[[epath.Path], dict[str, np.ndarray]]
  write: Callable[[dict[str, np.ndarray], Path, dict[str, str]], None]
  # Checks that writing can happen (its library is installed) before any work.
  writable: Callable[[], object] = lambda: None


SAFETENSORS = WeightFile(HF_WEIGHTS, read_safetensors, write_safetensors)
TORCH_BIN = WeightFile(MAMBA_SSM_WEIGHTS, read_torch_bin, write_torch_bin,
                       writable=lambda: _torch(_WRITE_NEEDS_TORCH))
