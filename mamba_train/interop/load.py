"""`load_model(path)`: a Mamba2LM from whatever a user points at.

Recognised layouts:
  * a training workdir (its newest checkpoint), its `checkpoints/` directory, or
    one checkpoint step `<workdir>/checkpoints/<step>` (Orbax);
  * a transformers directory (`config.json` with model_type mamba2 and
    `model.safetensors`, possibly sharded with `model.safetensors.index.json`);
  * a transformers NemotronH directory (model_type nemotron_h: a hybrid of
    Mamba-2, attention, MLP and mixture-of-experts layers);
  * a transformers GraniteMoeHybrid directory (model_type granitemoehybrid: IBM's
    Granite 4.0 hybrids of Mamba-2, attention and mixture-of-experts layers);
  * a mamba_ssm directory (`config.json` with `ssm_cfg` and `pytorch_model.bin`;
    Mamba2 or Mamba3 blocks; reading it needs torch, the `test` or `bench` extra).
Each may be local or on a gs:// bucket (`mamba_train.workdir.storage`).
"""

from __future__ import annotations

import os

import jax
from etils import epath
from flax import nnx

from mamba_train.interop import convert, files
from mamba_train.model import lora as lora_lib
from mamba_train.model.config import NOT_IN_WEIGHTS, Mamba2Config
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.params import weight_names
from mamba_train.model.runtime import Runtime
from mamba_train.workdir import checkpoint, storage


def detect_layout(path: epath.Path) -> str:
  cfg_file = path / files.CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist")
  if checkpoint.find_step_dir(path) is not None:
    return "checkpoint"
  if path.is_dir() and cfg_file.exists():
    layout = convert.config_layout(files.read_json(cfg_file))
    if layout is not None:
      return layout
  raise ValueError(
      f"{path} is not a model directory this library knows: expected a training workdir or "
      f"checkpoint step (checkpoints/<step>/state), a transformers Mamba2, NemotronH or GraniteMoeHybrid "
      f"directory (config.json + model.safetensors) or a mamba_ssm one (config.json + pytorch_model.bin)")


def _configs(cfg: Mamba2Config, runtime: Runtime | None, overrides: dict):
  """(architecture, runtime) with `overrides` applied: Runtime fields, or config
  fields no weight depends on (chunk_size)."""
  rt_names = Runtime.field_names()
  arch = {k: v for k, v in overrides.items() if k not in rt_names}
  bad = sorted(set(arch) - set(NOT_IN_WEIGHTS))
  if bad:
    raise ValueError(f"load_model cannot override {bad}: they change the weights; it takes "
                     f"Runtime fields {sorted(rt_names)} and {list(NOT_IN_WEIGHTS)}")
  rt = (runtime or Runtime()).replace(**{k: v for k, v in overrides.items() if k in rt_names})
  return cfg.replace(**arch), rt


def load_outside(path: epath.Path, layout: str, runtime: Runtime | None = None,
                 **overrides) -> Mamba2LM:
  """A model from a directory in one of the outside layouts (`convert.LAYOUTS`)."""
  row = convert.LAYOUTS[layout]
  cfg, rt = _configs(row.config_to_ours(files.read_json(path / files.CONFIG_FILE)), runtime, overrides)
  params = convert.state_dict_to_params(row.weights.read(path), cfg, layout)
  return Mamba2LM.from_params(cfg, params, rt)


def load_checkpoint(path: epath.Path, runtime: Runtime | None = None, **overrides) -> Mamba2LM:
  step_dir = checkpoint.find_step_dir(path)
  saved = checkpoint.saved_config(step_dir)
  cfg, saved_rt = checkpoint.saved_configs(saved)
  cfg, rt = _configs(cfg, runtime or saved_rt, overrides)
  abstract = jax.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)).params())
  spec = lora_lib.spec_from_config(saved.get("lora", {}), weight_names(cfg))
  if spec is None:
    return Mamba2LM.from_params(cfg, checkpoint.restore_params(step_dir, abstract), rt)
  # Adapters: the checkpoint holds them alone and names their base.
  adapters = checkpoint.restore_params(step_dir, lora_lib.adapter_shapes(abstract, spec))
  params = _lora_base(saved, cfg)
  want = saved.get("lora_base", {}).get("fingerprint")
  if saved.get("init_from") and want and lora_lib.fingerprint(params) != want:
    raise checkpoint.CheckpointDamagedError(
        f"the adapters in {step_dir} were trained on a base with fingerprint {want}, but "
        f"{saved['init_from']} now holds {lora_lib.fingerprint(params)}: it has changed since; "
        "restore the weights they were trained on there")
  frozen = lora_lib.quantize_base(params, spec)
  return Mamba2LM.from_params(cfg, frozen, rt, adapters=adapters, lora=spec)


def _lora_base(saved: dict, cfg: Mamba2Config):
  """The base parameters a LoRA run started from: its init_from, or its seed's random init
  (drawn as train/state.py draws it)."""
  if saved.get("init_from"):
    return load_model(saved["init_from"]).merged().params()  # a LoRA run's base: its merged weights
  init_key, _ = jax.random.split(jax.random.PRNGKey(saved["seed"]))
  return Mamba2LM(cfg, rngs=nnx.Rngs(params=init_key)).params()


def load_config(path: str | os.PathLike) -> Mamba2Config:
  """The architecture of what `load_model(path)` loads, from its config alone (no weight is
  read): a workdir's or checkpoint step's saved run config, or an outside config.json."""
  path = storage.path(path)
  layout = detect_layout(path)
  if layout == "checkpoint":
    return checkpoint.saved_configs(checkpoint.saved_config(checkpoint.find_step_dir(path)))[0]
  return convert.LAYOUTS[layout].config_to_ours(files.read_json(path / files.CONFIG_FILE))


def load_model(path: str | os.PathLike, runtime: Runtime | None = None, **overrides) -> Mamba2LM:
  """Load a Mamba2LM from a workdir / checkpoint step, a transformers (Mamba2,
  NemotronH or GraniteMoeHybrid) or a mamba_ssm directory.

  `runtime` says how it runs (default: a workdir's own, else `Runtime()`); `overrides`
  replace Runtime fields or config fields no weight depends on, for example
  compute_dtype='bfloat16', remat='full', ssd_form='scan' or chunk_size=128.
  """
  path = storage.path(path)
  layout = detect_layout(path)
  if layout == "checkpoint":
    return load_checkpoint(path, runtime, **overrides)
  return load_outside(path, layout, runtime, **overrides)
