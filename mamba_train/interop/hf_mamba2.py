"""transformers' Mamba2ForCausalLM (`hf`): pure Mamba-2 models, read and written.
A hybrid reads and writes as NemotronH (`nemotron_h.py`)."""

from __future__ import annotations

import math

from mamba_train.interop.files import JSON_INFINITY, SAFETENSORS, json_float
from mamba_train.interop.granite import granite_only_problems
from mamba_train.interop.tables import LAYER_PREFIX, MAMBA_TABLE, Layout, Slot, mamba_shapes
from mamba_train.model.config import MAMBA, Mamba2Config

# Outside top-level name -> ours. transformers names the embedding "embeddings"
# (mamba_ssm: "embedding"); NemotronH's files use these names too.
TOP = {"backbone.embeddings.weight": "embedding", "backbone.norm_f.weight": "norm_f",
       "lm_head.weight": "lm_head"}


def _slots(cfg: Mamba2Config) -> list[Slot]:
  if cfg.pattern != MAMBA * cfg.n_layer:
    raise ValueError(f"transformers' Mamba2 layout holds pure Mamba-2 models; a hybrid "
                     f"(layer_pattern {cfg.layer_pattern!r}) reads and writes as nemotron_h")
  return [(MAMBA, f"{LAYER_PREFIX}{i}.", MAMBA_TABLE) for i in range(cfg.n_layer)]


def hf_config_to_ours(hf: dict) -> Mamba2Config:
  problems = []
  if hf.get("model_type", "mamba2") != "mamba2":
    problems.append(f"model_type is {hf.get('model_type')!r}, not 'mamba2'")
  if hf.get("use_bias", False):
    problems.append("use_bias=true (biases on in_proj/out_proj) is not supported")
  if not hf.get("use_conv_bias", True):
    problems.append("use_conv_bias=false is not supported")
  if hf.get("hidden_act", "silu") != "silu":
    problems.append(f"hidden_act={hf.get('hidden_act')!r}: only 'silu' is supported")
  if problems:
    raise ValueError("Cannot represent this transformers Mamba2 config: " + "; ".join(problems))
  d_model, expand, head_dim = hf["hidden_size"], hf.get("expand", 2), hf.get("head_dim", 64)
  limit = hf.get("time_step_limit", [0.0, math.inf])
  cfg = Mamba2Config(
      d_model=d_model, n_layer=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
      d_state=hf.get("state_size", 128), d_conv=hf.get("conv_kernel", 4), expand=expand,
      headdim=head_dim, ngroups=hf.get("n_groups", 1), chunk_size=hf.get("chunk_size", 256),
      dt_min=hf.get("time_step_min", 0.001), dt_max=hf.get("time_step_max", 0.1),
      dt_init_floor=hf.get("time_step_floor", 1e-4),
      dt_limit=tuple(json_float(v) for v in limit),
      norm_eps=hf.get("layer_norm_epsilon", 1e-5),
      tie_embeddings=hf.get("tie_word_embeddings", False))  # transformers' default
  if "num_heads" in hf and hf["num_heads"] != cfg.nheads:
    raise ValueError(f"num_heads={hf['num_heads']} does not equal expand*hidden_size/head_dim "
                     f"= {cfg.nheads}; such a model cannot be represented")
  return cfg


def ours_to_hf_config(cfg: Mamba2Config, *, vocab_rows: int | None = None,
                      eos_token_id: int | None = None, bos_token_id: int | None = None,
                      pad_token_id: int | None = None, dtype: str = "float32",
                      for_json: bool = True) -> dict:
  """transformers' Mamba2Config fields of `cfg`. for_json: as `save_pretrained` writes
  them (infinity as {"__float__": "Infinity"}); else as Python values, for
  `transformers.Mamba2Config(**...)`."""
  if cfg.mamba_num_heads:
    raise ValueError("Cannot export as Mamba2ForCausalLM: mamba_num_heads is set (d_inner is not "
                     "expand * d_model); export a hybrid as NemotronH")
  if granite_only_problems(cfg, "Mamba2ForCausalLM"):
    raise ValueError("Cannot export as Mamba2ForCausalLM: " + "; ".join(granite_only_problems(cfg, "Mamba2")))
  lo, hi = cfg.dt_limit
  return {
      "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
      "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer,
      "vocab_size": vocab_rows or cfg.padded_vocab_size,
      "state_size": cfg.d_state, "conv_kernel": cfg.d_conv, "expand": cfg.expand,
      "head_dim": cfg.headdim, "num_heads": cfg.nheads, "n_groups": cfg.ngroups,
      "chunk_size": cfg.chunk_size, "time_step_min": cfg.dt_min, "time_step_max": cfg.dt_max,
      "time_step_floor": cfg.dt_init_floor,
      "time_step_limit": [lo, hi if math.isfinite(hi) or not for_json else dict(JSON_INFINITY)],
      "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "residual_in_fp32": True, "rms_norm": True, "use_bias": False, "use_conv_bias": True,
      "hidden_act": "silu", "norm_before_gate": False, "rescale_prenorm_residual": False,
      "eos_token_id": eos_token_id, "bos_token_id": bos_token_id, "pad_token_id": pad_token_id,
      "torch_dtype": dtype,
  }


def _recognizes(outside: dict) -> bool:
  # Asked last (convert.LAYOUTS' order): NemotronH and Granite have hidden_size too.
  return outside.get("model_type") == "mamba2" or "hidden_size" in outside


LAYOUT = Layout(
    name="hf", recognizes=_recognizes, config_to_ours=hf_config_to_ours,
    write_config=ours_to_hf_config, weights=SAFETENSORS, top=TOP, slots=_slots,
    shapes={MAMBA: mamba_shapes})
