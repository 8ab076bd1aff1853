"""`load_model(path)`: a Mamba2LM from whatever a user points at.

Recognised layouts:
  * a training workdir (its newest checkpoint), its `checkpoints/` directory, or
    one checkpoint step `<workdir>/checkpoints/<step>` (Orbax);
  * a transformers directory (`config.json` with model_type mamba2 and
    `model.safetensors`, possibly sharded with `model.safetensors.index.json`);
  * a mamba_ssm directory (`config.json` with `ssm_cfg` and `pytorch_model.bin`;
    reading it needs torch, the `test` or `bench` extra).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from mamba_train import checkpoint, convert
from mamba_train.config import Mamba2Config
from mamba_train.model import Mamba2LM


def detect_layout(path: Path) -> str:
  cfg_file = path / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist")
  if checkpoint.find_step_dir(path) is not None:
    return "checkpoint"
  if path.is_dir() and cfg_file.exists():
    cfg = convert.read_json(cfg_file)
    if "ssm_cfg" in cfg or "d_model" in cfg:
      return "mamba_ssm"
    if cfg.get("model_type") == "mamba2" or "hidden_size" in cfg:
      return "hf"
  raise ValueError(
      f"{path} is not a model directory this library knows: expected a training workdir or "
      f"checkpoint step (checkpoints/<step>/state), a transformers Mamba2 directory "
      f"(config.json + model.safetensors) or a mamba_ssm one (config.json + pytorch_model.bin)")


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  index = path / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  elif (path / "model.safetensors").exists():
    files = ["model.safetensors"]
  else:
    raise FileNotFoundError(f"{path} has no model.safetensors (nor a sharded index): "
                            f"save the model with save_pretrained(..., safe_serialization=True)")
  sd = {}
  for f in files:
    sd.update(load_file(str(path / f)))
  return sd


def read_torch_bin(file: Path) -> dict[str, np.ndarray]:
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"Reading {file} needs PyTorch: pip install -e '.[test]' "
                      f"(which installs the CPU build torch==2.13.0)") from e
  if not file.exists():
    raise FileNotFoundError(f"{file} is missing")
  sd = torch.load(file, map_location="cpu", weights_only=True)
  return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in sd.items()}


def load_hf(path: Path, **overrides) -> Mamba2LM:
  cfg = convert.hf_config_to_ours(convert.read_json(path / "config.json")).replace(**overrides)
  params = convert.state_dict_to_params(read_safetensors(path), cfg, "hf")
  return Mamba2LM.from_params(cfg, params)


def load_mamba_ssm(path: Path, **overrides) -> Mamba2LM:
  cfg = convert.mamba_ssm_config_to_ours(convert.read_json(path / "config.json")).replace(**overrides)
  params = convert.state_dict_to_params(read_torch_bin(path / "pytorch_model.bin"), cfg, "mamba_ssm")
  return Mamba2LM.from_params(cfg, params)


def load_checkpoint(path: Path, **overrides) -> Mamba2LM:
  step_dir = checkpoint.find_step_dir(path)
  model_dict = dict(checkpoint.saved_config(step_dir)["model"])
  cfg = Mamba2Config.from_dict(model_dict).replace(**overrides)
  abstract = jax.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)).params())
  params = checkpoint.restore_params(step_dir, abstract)
  return Mamba2LM.from_params(cfg, params)


def load_model(path: str | os.PathLike, **overrides) -> Mamba2LM:
  """Load a Mamba2LM from a workdir / checkpoint step, a transformers or a mamba_ssm directory.

  `overrides` replace Mamba2Config fields that do not change the weights, for
  example compute_dtype='bfloat16', chunk_size=128 or remat='full'.
  """
  path = Path(path)
  layout = detect_layout(path)
  return {"hf": load_hf, "mamba_ssm": load_mamba_ssm,
          "checkpoint": load_checkpoint}[layout](path, **overrides)
