"""transformers' GraniteMoeHybridForCausalLM (`granite`, IBM's Granite 4.0 hybrids):
read only. Also what the other layouts cannot hold of a Granite model
(`granite_only_problems`), which their config writers refuse by name.

Each of its decoder layers is two of ours, a mixer (Mamba-2, `mamba.*`, or
attention, `self_attn.*`, after `input_layernorm`) and then, after
`post_attention_layernorm`, the MoE (`block_sparse_moe.*`: a softmax router,
gated experts with gate and up joined as gate_up_proj (e, 2f, d)) plus its shared
gated MLP (`shared_mlp.input_linear`, gate then up), or that MLP alone when the
model has no experts. The tables use the names transformers holds in memory; the
released files' older names are renamed first (GRANITE_FILE_NAMES).
"""

from __future__ import annotations

import math

import numpy as np

from mamba_train.interop import tables
from mamba_train.interop.files import SAFETENSORS, json_float
from mamba_train.interop.tables import IDENTITY, SWAP_LAST, TRANSPOSE, Codec, renamed
from mamba_train.model.config import ATTENTION, MAMBA, MLP, MOE, Mamba2Config


def _split_halves(axis):  # [gate; up] joined on `axis` of (..., 2f, d) -> gate, up as (..., d, f)
  def to_ours(w, cfg):
    gate, up = np.split(w, 2, axis=axis)
    return np.swapaxes(gate, -1, -2), np.swapaxes(up, -1, -2)
  return Codec(to_ours, lambda ws, cfg: np.concatenate([np.swapaxes(a, -1, -2) for a in ws], axis=axis))


# Granite's mixers are transformers' Mamba-2 and attention layers under its names.
_MAMBA_NAMES = {"norm.weight": "input_layernorm.weight", "mixer.": "mamba."}
_ATTN_NAMES = {"norm.weight": "input_layernorm.weight", "mixer.": "self_attn."}
GRANITE_TABLES: dict[str, tables.Table] = {
    MAMBA: renamed(tables.MAMBA_TABLE, _MAMBA_NAMES),
    ATTENTION: renamed(tables.ATTN_TABLE, _ATTN_NAMES),
    MOE: {
        "post_attention_layernorm.weight": (("norm",), IDENTITY),
        "block_sparse_moe.router.weight": (("router",), TRANSPOSE),
        "block_sparse_moe.experts.gate_up_proj": (("experts_gate", "experts_up"), _split_halves(1)),
        "block_sparse_moe.experts.down_proj": (("experts_down",), SWAP_LAST),
        "shared_mlp.input_linear.weight": (("shared_gate", "shared_up"), _split_halves(0)),
        "shared_mlp.output_linear.weight": (("shared_down",), TRANSPOSE),
    },
    MLP: {
        "post_attention_layernorm.weight": (("norm",), IDENTITY),
        "shared_mlp.input_linear.weight": (("gate_proj", "up_proj"), _split_halves(0)),
        "shared_mlp.output_linear.weight": (("down_proj",), TRANSPOSE),
    },
}
# The released Granite 4.0 files' names -> transformers' (its conversion_mapping, 'granitemoe').
GRANITE_FILE_NAMES = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
                      "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
                      "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight"}
TOP = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "norm_f",
       "lm_head.weight": "lm_head"}


def _granite_name(name: str) -> str:
  for old, new in GRANITE_FILE_NAMES.items():
    if name.endswith("." + old):
      return name[: -len(old)] + new
  return name


def _from_files(sd: dict, cfg: Mamba2Config) -> dict:
  return {_granite_name(k): v for k, v in sd.items()}


def _slots(cfg: Mamba2Config) -> list[tables.Slot]:
  # A mixer starts each of its layers; the MoE or MLP after it shares its index.
  slots, layer = [], -1
  for k in cfg.pattern:
    layer += k in (MAMBA, ATTENTION)
    slots.append((k, f"model.layers.{layer}.", GRANITE_TABLES[k]))
  return slots


def _ffn_shapes(cfg: Mamba2Config, kind: str) -> tables.Shapes:
  d, e, f = cfg.d_model, cfg.n_routed_experts, cfg.moe_intermediate_size
  s = cfg.moe_shared_expert_intermediate_size if kind == MOE else cfg.d_intermediate
  out = {"post_attention_layernorm.weight": (d,), "shared_mlp.input_linear.weight": (2 * s, d),
         "shared_mlp.output_linear.weight": (d, s)}
  if kind == MOE:
    out.update({"block_sparse_moe.router.weight": (e, d), "block_sparse_moe.experts.gate_up_proj": (e, 2 * f, d),
                "block_sparse_moe.experts.down_proj": (e, d, f)})
  return out


SHAPES = {MAMBA: lambda cfg: renamed(tables.mamba_shapes(cfg), _MAMBA_NAMES),
          ATTENTION: lambda cfg: renamed(tables.attn_shapes(cfg), _ATTN_NAMES),
          MOE: lambda cfg: _ffn_shapes(cfg, MOE), MLP: lambda cfg: _ffn_shapes(cfg, MLP)}

# GraniteMoeHybrid's names of its mixers (transformers' names and the released files').
GRANITE_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


def granite_config_to_ours(hf: dict) -> Mamba2Config:
  """transformers' GraniteMoeHybridConfig (as config.json holds it) -> ours. Each of
  its layers becomes a mixer ('M' or '*') and an 'E' (a 'softmax' router, swiglu
  experts and shared expert; '-', its shared MLP alone, when num_local_experts is 0),
  with its multipliers; refuses, naming the field, what it cannot represent."""
  problems = []
  kinds = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * hf["num_hidden_layers"]
  unknown = sorted({k for k in kinds if k not in GRANITE_KINDS})
  if unknown:
    problems.append(f"layer_types has {unknown}; known: {sorted(GRANITE_KINDS)}")
  experts = hf.get("num_local_experts", 8) or 0
  ffn = MOE if experts else MLP
  shared = hf.get("shared_intermediate_size", 1024)
  for key, ok in (("hidden_act", "silu"), ("mamba_proj_bias", False), ("mamba_conv_bias", True),
                  ("attention_bias", False)):
    if hf.get(key, ok) != ok:
      problems.append(f"{key}={hf[key]!r} is not supported (only {ok!r})")
  rope = hf.get("position_embedding_type")
  rp = dict(hf.get("rope_parameters") or {})
  if rope not in (None, "rope"):
    problems.append(f"position_embedding_type={rope!r}: only None or 'rope'")
  elif rope == "rope" and rp.get("rope_type", rp.get("type", "default")) != "default":
    problems.append(f"rope_parameters rope_type {rp.get('rope_type', rp.get('type'))!r}: only 'default' rotary")
  if rope == "rope" and hf.get("rope_scaling"):
    problems.append(f"rope_scaling={hf['rope_scaling']!r} is not supported")
  if not shared:
    problems.append("shared_intermediate_size = 0 is not supported (every Granite layer has a shared MLP)")
  if problems:
    raise ValueError("Cannot represent this transformers GraniteMoeHybrid config: " + "; ".join(problems))
  pattern = "".join(GRANITE_KINDS[k] + ffn for k in kinds)
  d = hf["hidden_size"]
  expand = hf.get("mamba_expand", 2)
  head = hf.get("mamba_d_head", "auto")
  heads = hf.get("mamba_n_heads", 128)
  head = expand * d // heads if head == "auto" else head
  limit = hf.get("time_step_limit") or [0.0, math.inf]
  attn = {}
  if ATTENTION in pattern:
    n_heads = hf.get("num_attention_heads", 32)
    e = hf.get("head_dim") or d // n_heads
    attn = dict(attn_num_heads=n_heads, attn_num_heads_kv=hf.get("num_key_value_heads") or n_heads,
                attn_head_dim=e, attn_rotary_emb_dim=e if rope == "rope" else 0,
                attn_rotary_base=float(rp.get("rope_theta", hf.get("rope_theta", 10000.0))),
                attention_multiplier=float(hf.get("attention_multiplier", 1.0)))
  ffn_fields = (dict(n_routed_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                     moe_intermediate_size=hf.get("intermediate_size", 11008),
                     moe_shared_expert_intermediate_size=shared, moe_router_score_function="softmax")
                if experts else dict(d_intermediate=shared))
  return Mamba2Config(
      d_model=d, n_layer=len(pattern), vocab_size=hf["vocab_size"],
      d_state=hf.get("mamba_d_state", 256), d_conv=hf.get("mamba_d_conv", 4), expand=expand,
      headdim=head, ngroups=hf.get("mamba_n_groups", 1), chunk_size=hf.get("mamba_chunk_size", 256),
      dt_limit=tuple(json_float(v) for v in limit), norm_eps=hf.get("rms_norm_eps", 1e-6),
      tie_embeddings=hf.get("tie_word_embeddings", False), layer_pattern=pattern, mlp_act="swiglu",
      embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
      residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
      logits_scaling=float(hf.get("logits_scaling", 1.0)), **attn, **ffn_fields)


def granite_only_problems(cfg: Mamba2Config, target: str) -> list[str]:
  """What `target` (an export layout) cannot hold of a Granite model's functions."""
  out = [f"{name}={getattr(cfg, name)} (Granite's)" for name, plain in
         (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0), ("attention_multiplier", 0.0),
          ("logits_scaling", 1.0)) if getattr(cfg, name) != plain]
  if MOE in cfg.pattern and cfg.moe_router_score_function != "sigmoid":
    out.append(f"moe_router_score_function={cfg.moe_router_score_function!r}")
  if MOE in cfg.pattern and cfg.mlp_act != "relu2":
    out.append(f"mlp_act={cfg.mlp_act!r} in mixture-of-experts layers")
  return [f"{p}: {target} has no such layer (GraniteMoeHybrid export is not built)" for p in out]


LAYOUT = tables.Layout(
    name="granite", recognizes=lambda outside: outside.get("model_type") == "granitemoehybrid",
    config_to_ours=granite_config_to_ours, write_config=None, weights=SAFETENSORS, top=TOP,
    slots=_slots, shapes=SHAPES, from_files=_from_files)
