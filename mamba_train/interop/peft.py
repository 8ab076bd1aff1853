"""LoRA adapters in peft's format: `adapter_config.json` and `adapter_model.safetensors`,
which `peft.PeftModel.from_pretrained` puts on transformers' Mamba2ForCausalLM (a pure
Mamba-2 model) or NemotronHForCausalLM (a hybrid) loaded from the base.

peft's LoRA on an nn.Linear with weight (out, in) adds (lora_alpha / r) *
lora_B.weight @ lora_A.weight, lora_A (r, in), lora_B (out, r). Ours (model/lora.py)
add (alpha / r) * A @ B over the weight's input and output axes flattened in the
order transformers' Linear has them (in_proj's z|x|B|C|dt, the heads then the head
dim), so lora_A = A.T and lora_B = B.T, per layer. The head's B loses the padding
rows of the vocabulary, as the exported head does.

peft refuses LoRA on a Mamba model's `out_proj` (`_check_lora_target_modules_mamba`:
mamba_ssm's fused kernel skipped out_proj's forward), so adapters on out_proj are
refused here with the way out: the merged export holds them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mamba_train.errors import UserError
from mamba_train.interop.export import _atomic_dir
from mamba_train.interop.tables import LAYER_PREFIX
from mamba_train.model import lora as lora_lib
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.params import KIND_PARAMS

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Our target -> transformers' module name after backbone.layers.{i}. (both Mamba2 and NemotronH).
MODULES = {t: f"mixer.{t}" for t in lora_lib.TARGETS}
PEFT_REFUSES = ("out_proj",)


class PeftExportError(UserError, ValueError):
  pass


def adapter_state_dict(model: Mamba2LM) -> dict[str, np.ndarray]:
  """{peft key: float32 array} of a model's adapters."""
  cfg, spec = model.config, model.lora
  refused = [t for t in spec.targets if t in PEFT_REFUSES]
  if refused:
    raise PeftExportError(
        f"peft does not load LoRA on a Mamba model's {refused} (it refuses them by name), and these "
        "adapters hold some: export them merged (--format hf or mamba_ssm), or train with "
        "lora.targets that leave them out")
  sd = {}
  layer_of = {kind: [i for i, k in enumerate(cfg.pattern) if k == kind] for kind in KIND_PARAMS}
  stack_kind = {v: k for k, v in KIND_PARAMS.items()}
  for stack, per_target in model.adapters.items():
    if stack == lora_lib.HEAD:
      a, b = np.asarray(per_target["a"]), np.asarray(per_target["b"])[:, :cfg.vocab_size]
      sd.update(_pair("lm_head", a, b))
      continue
    for target, ab in per_target.items():
      a, b = np.asarray(ab["a"]), np.asarray(ab["b"])
      for j, i in enumerate(layer_of[stack_kind[stack]]):
        sd.update(_pair(f"{LAYER_PREFIX}{i}.{MODULES[target]}", a[j], b[j]))
  return sd


def _pair(module: str, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
  key = f"{PEFT_PREFIX}{module}.lora_"
  return {key + "A.weight": np.ascontiguousarray(a.T, np.float32),
          key + "B.weight": np.ascontiguousarray(b.T, np.float32)}


def adapter_config(model: Mamba2LM, base: str) -> dict:
  spec = model.lora
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
      "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "bias": "none",
      "target_modules": sorted(t for t in spec.targets), "fan_in_fan_out": False,
      "use_rslora": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
  }


def save_peft(model: Mamba2LM, out, *, base: str = "", overwrite: bool = False) -> Path:
  """Write `model`'s adapters (it must have some) in peft's format into `out`.
  `base`: the base model's path or hub name, recorded as peft records it."""
  from safetensors.numpy import save_file
  if model.lora is None:
    raise PeftExportError("this model has no LoRA adapters to export in peft's format; "
                          "drop --peft to export the whole model")
  sd = adapter_state_dict(model)  # refuses what peft cannot load, before anything is written
  with _atomic_dir(Path(out), overwrite) as tmp:
    save_file(sd, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(model, base), indent=2))
  return Path(out)
