"""transformers' NemotronHForCausalLM (`nemotron_h`): the hybrids of Mamba-2,
attention, MLP and mixture-of-experts layers (latent or not), read and written.

transformers holds the model as `model.*` in memory and writes `backbone.*` (its
checkpoint conversion); both are read. It never ties NemotronH's head, so a tied
head is written out as `lm_head.weight` (and reads back untied, with the same logits).
"""

from __future__ import annotations

import math
import re

import numpy as np

from mamba_train.interop import tables
from mamba_train.interop.files import JSON_INFINITY, SAFETENSORS
from mamba_train.interop.granite import granite_only_problems
from mamba_train.interop.hf_mamba2 import TOP
from mamba_train.interop.tables import IDENTITY, SWAP_LAST, TRANSPOSE
from mamba_train.model import moe as moe_lib
from mamba_train.model.config import ATTENTION, MAMBA, MLP, MOE, Mamba2Config

MLP_TABLE: tables.Table = {
    "norm.weight": (("norm",), IDENTITY),
    "mixer.up_proj.weight": (("up_proj",), TRANSPOSE),
    "mixer.down_proj.weight": (("down_proj",), TRANSPOSE),
}
# The mixture-of-experts layers. The routed experts' weights as transformers holds
# them in memory, stacked (e, out, in); its files hold one tensor per expert
# (`mixer.experts.{j}.up_proj.weight`), joined and split by `_join_experts` and
# `_split_experts`. Rows whose parameters the config lacks (no latent projection,
# no shared expert) are left out (`_moe_table`).
MOE_TABLE: tables.Table = {
    "norm.weight": (("norm",), IDENTITY),
    "mixer.gate.weight": (("router",), TRANSPOSE),
    "mixer.gate.e_score_correction_bias": ((moe_lib.BIAS,), IDENTITY),
    "mixer.experts.up_proj": (("experts_up",), SWAP_LAST),
    "mixer.experts.down_proj": (("experts_down",), SWAP_LAST),
    "mixer.fc1_latent_proj.weight": (("latent_down",), TRANSPOSE),
    "mixer.fc2_latent_proj.weight": (("latent_up",), TRANSPOSE),
    "mixer.shared_experts.up_proj.weight": (("shared_up",), TRANSPOSE),
    "mixer.shared_experts.down_proj.weight": (("shared_down",), TRANSPOSE),
}
# Tensors transformers keeps float32 whatever the model's dtype (NemotronH's
# `_keep_in_fp32_modules_strict`): the router. An export in bfloat16 leaves them float32.
FLOAT32_SUFFIXES = ("mixer.gate.weight", "mixer.gate.e_score_correction_bias")
# Tensors transformers itself ignores when loading a NemotronH (multi-token prediction).
NEMOTRON_H_IGNORED = ("mtp.",)
_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.mixer\.experts)\.(up_proj|down_proj)$")


def _moe_table(cfg: Mamba2Config) -> tables.Table:
  have = moe_lib.shapes(cfg)
  return {s: row for s, row in MOE_TABLE.items() if all(n in have for n in row[0])}


def _join_experts(sd: dict, cfg: Mamba2Config) -> dict:
  """A file's per-expert tensors -> the stacked ones of MOE_TABLE. The expert
  indices of a layer must be exactly 0 .. n_routed_experts - 1."""
  out, per = {}, {}
  for k, v in sd.items():
    m = _EXPERT.match(k)
    if m:
      per.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = v
    else:
      out[k] = v
  for name, experts in per.items():
    if sorted(experts) != list(range(cfg.n_routed_experts)):
      raise ValueError(f"{name}: experts {sorted(experts)[:8]}..., expected 0..{cfg.n_routed_experts - 1}")
    out[name] = np.stack([experts[j] for j in range(cfg.n_routed_experts)])
  return out


def _split_experts(sd: dict) -> dict:
  """The inverse of `_join_experts`: the layout transformers writes."""
  out = {}
  for k, v in sd.items():
    m = _STACKED.match(k)
    if m:
      out.update({f"{m[1]}.{j}.{m[2]}.weight": np.ascontiguousarray(v[j]) for j in range(v.shape[0])})
    else:
      out[k] = v
  return out


def _from_files(sd: dict, cfg: Mamba2Config) -> dict:
  sd = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v
        for k, v in sd.items() if not k.startswith(NEMOTRON_H_IGNORED)}
  return _join_experts(sd, cfg) if MOE in cfg.pattern else sd


def _slots(cfg: Mamba2Config) -> list[tables.Slot]:
  by_kind = {MAMBA: tables.MAMBA_TABLE, ATTENTION: tables.ATTN_TABLE, MLP: MLP_TABLE,
             MOE: _moe_table(cfg) if MOE in cfg.pattern else MOE_TABLE}
  return [(k, f"{tables.LAYER_PREFIX}{i}.", by_kind[k]) for i, k in enumerate(cfg.pattern)]


def _mlp_shapes(cfg: Mamba2Config) -> tables.Shapes:
  d, f = cfg.d_model, cfg.d_intermediate
  return {"norm.weight": (d,), "mixer.up_proj.weight": (f, d), "mixer.down_proj.weight": (d, f)}


def _moe_shapes(cfg: Mamba2Config) -> tables.Shapes:
  """Our shapes through each row's codec (all transposes)."""
  ours = moe_lib.shapes(cfg)
  flip = lambda shp: shp if len(shp) == 1 else shp[:-2] + (shp[-1], shp[-2])
  return {s: flip(ours[names[0]]) for s, (names, _) in _moe_table(cfg).items()}


# NemotronH's names of the layer kinds (transformers' present names and its older ones).
NEMOTRON_H_KINDS = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION,
                    "attention": ATTENTION, "mlp": MLP, "moe": MOE}
NEMOTRON_H_CHARS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
NEMOTRON_H_PATTERN_CHARS = {ours: theirs for theirs, ours in NEMOTRON_H_CHARS.items()}
# NemotronHConfig's mixture-of-experts fields that are ours under the same name,
# with transformers' defaults.
NEMOTRON_H_MOE_FIELDS = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
                         "moe_shared_expert_intermediate_size": 7688, "n_group": 1, "topk_group": 1,
                         "norm_topk_prob": True, "routed_scaling_factor": 1.0}


def nemotron_h_config_to_ours(hf: dict) -> Mamba2Config:
  """transformers' NemotronHConfig (as config.json holds it) -> ours: every layer
  kind, mixture-of-experts ones included (latent or not)."""
  if "layers_block_type" in hf or "layer_types" in hf:
    kinds = hf.get("layers_block_type") or hf["layer_types"]
    unknown = sorted({k for k in kinds if k not in NEMOTRON_H_KINDS})
    if unknown:
      raise ValueError(f"NemotronH layers_block_type has kinds {unknown}; known: "
                       f"{sorted(NEMOTRON_H_KINDS)}")
    pattern = "".join(NEMOTRON_H_KINDS[k] for k in kinds)
  else:
    raw = hf.get("hybrid_override_pattern", "")
    unknown = sorted(set(raw) - set(NEMOTRON_H_CHARS))
    if unknown or not raw:
      raise ValueError(f"NemotronH config has no usable layer pattern (layers_block_type or "
                       f"hybrid_override_pattern; characters {unknown} unknown)")
    pattern = "".join(NEMOTRON_H_CHARS[c] for c in raw)
  problems = []
  moe = {}
  if MOE in pattern:
    moe = {k: hf.get(k, v) for k, v in NEMOTRON_H_MOE_FIELDS.items()}
    moe["moe_latent_size"] = hf.get("moe_latent_size") or 0
    moe["routed_scaling_factor"] = float(moe["routed_scaling_factor"])
    if hf.get("moe_shared_expert_overlap", True) is not True:
      problems.append("moe_shared_expert_overlap=false is not supported (transformers ignores it too)")
  for key, ok in (("use_bias", False), ("mamba_proj_bias", False), ("mlp_bias", False),
                  ("use_conv_bias", True), ("mamba_hidden_act", "silu"),
                  ("mlp_hidden_act", "relu2"), ("sliding_window", None)):
    if hf.get(key, ok) != ok:
      problems.append(f"{key}={hf[key]!r} is not supported (only {ok!r})")
  d = hf["hidden_size"]
  inner = hf.get("mamba_num_heads", 128) * hf.get("mamba_head_dim", 64)
  if problems:
    raise ValueError("Cannot represent this transformers NemotronH config: " + "; ".join(problems))
  # NemotronH's Mamba-2 layers clamp dt from below at time_step_min and ignore
  # time_step_limit (its NemotronHMamba2Mixer); ours says so in dt_limit.
  t_min = float(hf.get("time_step_min", 0.001))
  attn = ATTENTION in pattern
  return Mamba2Config(
      d_model=d, n_layer=len(pattern), vocab_size=hf["vocab_size"],
      d_state=hf.get("ssm_state_size", 128), d_conv=hf.get("conv_kernel", 4),
      expand=max(1, inner // d), headdim=hf.get("mamba_head_dim", 64), ngroups=hf.get("n_groups", 8),
      # Heads given outright only where expand cannot say them (see Mamba2Config).
      mamba_num_heads=hf.get("mamba_num_heads", 128) if inner % d else 0,
      chunk_size=hf.get("chunk_size", 128), dt_min=t_min if t_min > 0 else 0.001,
      dt_max=hf.get("time_step_max", 0.1), dt_init_floor=hf.get("time_step_floor", 1e-4),
      dt_limit=(t_min, math.inf), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
      tie_embeddings=False,  # transformers does not tie NemotronH's head, whatever the flag
      layer_pattern=pattern,
      attn_num_heads=hf.get("num_attention_heads", 32) if attn else 0,
      attn_num_heads_kv=(hf.get("num_key_value_heads") or hf.get("num_attention_heads", 32)) if attn else 0,
      attn_head_dim=hf.get("head_dim", 128), d_intermediate=hf.get("intermediate_size", 0) if MLP in pattern else 0,
      mlp_act="relu2", **moe)


def ours_to_nemotron_h_config(cfg: Mamba2Config, *, vocab_rows: int | None = None,
                              eos_token_id: int | None = None, bos_token_id: int | None = None,
                              pad_token_id: int | None = None, dtype: str = "float32") -> dict:
  """transformers' NemotronHConfig fields of `cfg`, as save_pretrained writes them.
  Refuses, naming the field, what NemotronH cannot express."""
  problems = []
  if cfg.attn_rotary_emb_dim:
    problems.append("attn_rotary_emb_dim > 0: NemotronH's attention has no positional encoding")
  if MLP in cfg.pattern and cfg.mlp_act != "relu2":
    problems.append(f"mlp_act={cfg.mlp_act!r}: NemotronH's MLP is relu2 (squared ReLU)")
  if math.isfinite(cfg.dt_limit[1]):
    problems.append(f"dt_limit upper bound {cfg.dt_limit[1]}: NemotronH clamps dt only from "
                    f"below (at time_step_min)")
  if MOE in cfg.pattern and not cfg.moe_shared_expert_intermediate_size:
    problems.append("moe_shared_expert_intermediate_size = 0: NemotronH's MoE layers always "
                    "have a shared expert")
  problems += granite_only_problems(cfg, "NemotronH")
  if problems:
    raise ValueError("Cannot export as NemotronHForCausalLM: " + "; ".join(problems))
  names = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp", MOE: "moe"}
  moe = {}
  if MOE in cfg.pattern:
    moe = {k: getattr(cfg, k) for k in NEMOTRON_H_MOE_FIELDS}
    moe.update(moe_latent_size=cfg.moe_latent_size or None, n_shared_experts=1,
               moe_shared_expert_overlap=True)
  return {
      "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
      "hidden_size": cfg.d_model, "vocab_size": vocab_rows or cfg.padded_vocab_size,
      # The pattern twice: transformers 5 reads layers_block_type (in the kinds' older
      # names, which it maps to its present ones, so that releases between read it too);
      # vLLM's and NVIDIA's own NemotronH config classes and llama.cpp's converter read
      # hybrid_override_pattern (our layer characters are NemotronH's).
      "layers_block_type": [names[k] for k in cfg.pattern],
      "hybrid_override_pattern": "".join(NEMOTRON_H_PATTERN_CHARS[k] for k in cfg.pattern),
      "num_hidden_layers": cfg.n_layer,
      # The dtype a server keeps the Mamba-2 layers' recurrent state in: ours decodes with
      # it in float32 (model/cache.py: a running product of decays), and vLLM, when this
      # key is absent, has taken float16 in some releases.
      "mamba_ssm_cache_dtype": "float32",
      "ssm_state_size": cfg.d_state, "conv_kernel": cfg.d_conv, "mamba_num_heads": cfg.nheads,
      "mamba_head_dim": cfg.headdim, "n_groups": cfg.ngroups, "chunk_size": cfg.chunk_size,
      # NemotronH's lower clamp of dt (see nemotron_h_config_to_ours); 0 is none.
      "time_step_min": cfg.dt_limit[0], "time_step_max": cfg.dt_max,
      "time_step_floor": cfg.dt_init_floor, "time_step_limit": [cfg.dt_limit[0], dict(JSON_INFINITY)],
      "num_attention_heads": cfg.attn_num_heads or 1, "num_key_value_heads": cfg.n_kv_heads or 1,
      "head_dim": cfg.attn_head_dim, "intermediate_size": cfg.d_intermediate or 1,
      "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_bias": False,
      "mamba_proj_bias": False, "mlp_bias": False, "attention_bias": False, "use_conv_bias": True,
      "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": False,
      "residual_in_fp32": True, "rescale_prenorm_residual": False, "num_nextn_predict_layers": 0,
      "eos_token_id": eos_token_id, "bos_token_id": bos_token_id, "pad_token_id": pad_token_id,
      "torch_dtype": dtype, **moe,
  }


LAYOUT = tables.Layout(
    name="nemotron_h", recognizes=lambda outside: outside.get("model_type") == "nemotron_h",
    config_to_ours=nemotron_h_config_to_ours, write_config=ours_to_nemotron_h_config,
    weights=SAFETENSORS, top=TOP, slots=_slots,
    shapes={MAMBA: tables.mamba_shapes, ATTENTION: tables.attn_shapes, MLP: _mlp_shapes, MOE: _moe_shapes},
    tied_head="write", from_files=_from_files, to_files=_split_experts,
    float32_suffixes=FLOAT32_SUFFIXES)
