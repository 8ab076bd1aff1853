"""Weight and config conversion between mamba_train and the outside layouts:
transformers' Mamba2ForCausalLM (`hf`), transformers' NemotronHForCausalLM
(`nemotron_h`, the hybrids), transformers' GraniteMoeHybridForCausalLM
(`granite`, IBM's Granite 4.0 hybrids; import only) and the released
state-spaces/mamba2-* checkpoints (`mamba_ssm`). This is the only module that
knows outside names.

One table per layer kind (`KIND_TABLES`) maps each outside per-layer tensor to
our parameters with a codec; both directions are derived from them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mamba_train.model import moe as moe_lib
from mamba_train.model.config import ATTENTION, MAMBA, MLP, MOE, Mamba2Config
from mamba_train.model.params import KIND_PARAMS

# The files of the outside layouts.
CONFIG_FILE = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded safetensors: name -> file
MAMBA_SSM_WEIGHTS = "pytorch_model.bin"


@dataclass(frozen=True)
class Codec:
  """to_ours(outside, cfg) -> tuple of our arrays; to_outside(tuple, cfg) -> array."""
  to_ours: Callable
  to_outside: Callable


IDENTITY = Codec(lambda w, cfg: (w,), lambda ws, cfg: ws[0])
TRANSPOSE = Codec(lambda w, cfg: (w.T,), lambda ws, cfg: ws[0].T)


def _in_proj_sizes(cfg):
  gn = cfg.ngroups * cfg.d_state
  return [cfg.d_inner, cfg.d_inner, gn, gn, cfg.nheads]  # z, x, B, C, dt (mamba_ssm order)


def _split_in_proj(w, cfg):  # outside (d_in_proj, d) -> zx (d, 2, i), bc (d, 2, gn), dt (d, h)
  z, x, B, C, dt = np.split(w, np.cumsum(_in_proj_sizes(cfg))[:-1], axis=0)
  return np.stack([z.T, x.T], 1), np.stack([B.T, C.T], 1), dt.T


def _join_in_proj(ws, cfg):
  zx, bc, dt = ws
  return np.concatenate([zx[:, 0].T, zx[:, 1].T, bc[:, 0].T, bc[:, 1].T, dt.T], axis=0)


def _split_conv_w(w, cfg):  # outside (conv_dim, 1, k) -> x (k, i), bc (k, 2, gn)
  w = w[:, 0, :].T
  i, gn = cfg.d_inner, cfg.ngroups * cfg.d_state
  return w[:, :i], w[:, i:].reshape(w.shape[0], 2, gn)


def _join_conv_w(ws, cfg):
  x, bc = ws
  return np.concatenate([x, bc.reshape(bc.shape[0], -1)], axis=1).T[:, None, :]


def _split_conv_b(b, cfg):
  i = cfg.d_inner
  return b[:i], b[i:].reshape(2, -1)


def _join_conv_b(ws, cfg):
  return np.concatenate([ws[0], ws[1].reshape(-1)])


# Outside per-layer suffix (after "backbone.layers.{i}.") -> (our block params, codec).
LAYER_TABLE: dict[str, tuple[tuple[str, ...], Codec]] = {
    "norm.weight": (("norm",), IDENTITY),
    "mixer.in_proj.weight": (("in_proj_zx", "in_proj_bc", "in_proj_dt"),
                             Codec(_split_in_proj, _join_in_proj)),
    "mixer.conv1d.weight": (("conv_x", "conv_bc"), Codec(_split_conv_w, _join_conv_w)),
    "mixer.conv1d.bias": (("conv_x_bias", "conv_bc_bias"), Codec(_split_conv_b, _join_conv_b)),
    "mixer.dt_bias": (("dt_bias",), IDENTITY),
    "mixer.A_log": (("A_log",), IDENTITY),
    "mixer.D": (("D",), IDENTITY),
    "mixer.norm.weight": (("gate_norm",), IDENTITY),
    "mixer.out_proj.weight": (("out_proj",), TRANSPOSE),
}
# Outside top-level name -> our top-level parameter. The embedding's name is the
# one difference between the layouts ("embeddings" in transformers).
TOP_TABLE = {
    "hf": {"backbone.embeddings.weight": "embedding", "backbone.norm_f.weight": "norm_f",
           "lm_head.weight": "lm_head"},
    "mamba_ssm": {"backbone.embedding.weight": "embedding", "backbone.norm_f.weight": "norm_f",
                  "lm_head.weight": "lm_head"},
}
TOP_TABLE["nemotron_h"] = TOP_TABLE["hf"]
TOP_TABLE["granite"] = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "norm_f",
                        "lm_head.weight": "lm_head"}
LAYER_PREFIX = "backbone.layers."
# Tensors transformers itself ignores when loading a NemotronH (multi-token prediction).
NEMOTRON_H_IGNORED = ("mtp.",)


def _heads_codec(e_of):  # outside (heads*e, d) <-> ours (d, heads, e)
  return Codec(lambda w, cfg: (w.T.reshape(w.shape[1], -1, e_of(cfg)),),
               lambda ws, cfg: ws[0].reshape(ws[0].shape[0], -1).T)


def _out_heads_codec(e_of):  # outside (d, heads*e) <-> ours (heads, e, d)
  return Codec(lambda w, cfg: (w.T.reshape(-1, e_of(cfg), w.shape[0]),),
               lambda ws, cfg: ws[0].reshape(-1, ws[0].shape[-1]).T)


_E = lambda cfg: cfg.attn_head_dim
# NemotronH's attention and MLP layers (outside suffix -> ours, codec).
ATTN_TABLE: dict[str, tuple[tuple[str, ...], Codec]] = {
    "norm.weight": (("norm",), IDENTITY),
    "mixer.q_proj.weight": (("q_proj",), _heads_codec(_E)),
    "mixer.k_proj.weight": (("k_proj",), _heads_codec(_E)),
    "mixer.v_proj.weight": (("v_proj",), _heads_codec(_E)),
    "mixer.o_proj.weight": (("o_proj",), _out_heads_codec(_E)),
}
MLP_TABLE: dict[str, tuple[tuple[str, ...], Codec]] = {
    "norm.weight": (("norm",), IDENTITY),
    "mixer.up_proj.weight": (("up_proj",), TRANSPOSE),
    "mixer.down_proj.weight": (("down_proj",), TRANSPOSE),
}
SWAP_LAST = Codec(lambda w, cfg: (np.swapaxes(w, -1, -2),), lambda ws, cfg: np.swapaxes(ws[0], -1, -2))
# NemotronH's mixture-of-experts layers. The routed experts' weights as transformers
# holds them in memory, stacked (e, out, in); its files hold one tensor per expert
# (`mixer.experts.{j}.up_proj.weight`), joined and split by `_join_experts` and
# `_split_experts`. Rows whose parameters the config lacks (no latent projection,
# no shared expert) are left out (`_moe_table`).
MOE_TABLE: dict[str, tuple[tuple[str, ...], Codec]] = {
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
KIND_TABLES = {MAMBA: LAYER_TABLE, ATTENTION: ATTN_TABLE, MLP: MLP_TABLE, MOE: MOE_TABLE}
# Tensors transformers keeps float32 whatever the model's dtype (NemotronH's
# `_keep_in_fp32_modules_strict`): the router. An export in bfloat16 leaves them float32.
FLOAT32_SUFFIXES = ("mixer.gate.weight", "mixer.gate.e_score_correction_bias")
_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def _moe_table(cfg: Mamba2Config) -> dict[str, tuple[tuple[str, ...], Codec]]:
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
    m = re.match(r"^(.*\.mixer\.experts)\.(up_proj|down_proj)$", k)
    if m:
      out.update({f"{m[1]}.{j}.{m[2]}.weight": np.ascontiguousarray(v[j]) for j in range(v.shape[0])})
    else:
      out[k] = v
  return out


def _renamed(table: dict, renames: dict[str, str]) -> dict:
  """A kind's table with its outside suffixes renamed (prefix by prefix)."""
  def name(suffix):
    for old, new in renames.items():
      if suffix.startswith(old):
        return new + suffix[len(old):]
    return suffix
  return {name(k): v for k, v in table.items()}


def _split_halves(axis):  # [gate; up] joined on `axis` of (..., 2f, d) -> gate, up as (..., d, f)
  def to_ours(w, cfg):
    gate, up = np.split(w, 2, axis=axis)
    return np.swapaxes(gate, -1, -2), np.swapaxes(up, -1, -2)
  return Codec(to_ours, lambda ws, cfg: np.concatenate([np.swapaxes(a, -1, -2) for a in ws], axis=axis))


# GraniteMoeHybrid: each of its decoder layers is two of ours, a mixer (Mamba-2,
# `mamba.*`, or attention, `self_attn.*`, after `input_layernorm`) and then,
# after `post_attention_layernorm`, the MoE (`block_sparse_moe.*`: a softmax
# router, gated experts with gate and up joined as gate_up_proj (e, 2f, d)) plus
# its shared gated MLP (`shared_mlp.input_linear`, gate then up), or that MLP
# alone when the model has no experts. Names as transformers 5.24 holds them in
# memory; the released files' older names are renamed first (GRANITE_FILE_NAMES).
GRANITE_TABLES: dict[str, dict[str, tuple[tuple[str, ...], Codec]]] = {
    MAMBA: _renamed(LAYER_TABLE, {"norm.weight": "input_layernorm.weight", "mixer.": "mamba."}),
    ATTENTION: _renamed(ATTN_TABLE, {"norm.weight": "input_layernorm.weight", "mixer.": "self_attn."}),
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


def _granite_name(name: str) -> str:
  for old, new in GRANITE_FILE_NAMES.items():
    if name.endswith("." + old):
      return name[: -len(old)] + new
  return name


def _split_qkv(w, cfg):  # mamba_ssm MHA in_proj ((h + 2kv) e, d) -> q (d, h, e), k, v (d, kv, e)
  e, h, kv = cfg.attn_head_dim, cfg.attn_num_heads, cfg.n_kv_heads
  q, k, v = np.split(w, np.cumsum([h * e, kv * e])[:], axis=0)
  return tuple(a.T.reshape(w.shape[1], -1, e) for a in (q, k, v))


def _join_qkv(ws, cfg):
  return np.concatenate([a.reshape(a.shape[0], -1).T for a in ws], axis=0)


def _split_fc1(w, cfg):  # GatedMLP fc1 (2f, d): y then gate -> up (d, f), gate (d, f)
  y, gate = np.split(w, 2, axis=0)
  return y.T, gate.T


def _join_fc1(ws, cfg):
  return np.concatenate([ws[0].T, ws[1].T], axis=0)


# mamba_ssm's hybrid blocks (MambaLMHeadModel with attn_layer_idx, d_intermediate):
# block j holds a mixer (Mamba2 or MHA, `norm` + `mixer.*`) and, with
# d_intermediate > 0, a GatedMLP (`norm2` + `mlp.*`) after it: in our pattern a
# mixer layer, then an MLP layer, under one outside index.
MAMBA_SSM_ATTN_TABLE: dict[str, tuple[tuple[str, ...], Codec]] = {
    "norm.weight": (("norm",), IDENTITY),
    "mixer.in_proj.weight": (("q_proj", "k_proj", "v_proj"), Codec(_split_qkv, _join_qkv)),
    "mixer.out_proj.weight": (("o_proj",), _out_heads_codec(_E)),
}
MAMBA_SSM_MLP_TABLE: dict[str, tuple[tuple[str, ...], Codec]] = {
    "norm2.weight": (("norm",), IDENTITY),
    "mlp.fc1.weight": (("up_proj", "gate_proj"), Codec(_split_fc1, _join_fc1)),
    "mlp.fc2.weight": (("down_proj",), TRANSPOSE),
}
MAMBA_SSM_TABLES = {MAMBA: LAYER_TABLE, ATTENTION: MAMBA_SSM_ATTN_TABLE, MLP: MAMBA_SSM_MLP_TABLE}


def _layer_slots(cfg: Mamba2Config, layout: str) -> list[tuple[str, str, dict]]:
  """For each of our layers in pattern order: (kind, outside name prefix, table)."""
  if layout == "granite":  # a mixer starts each of its layers; the MoE or MLP after it shares it
    slots, layer = [], -1
    for k in cfg.pattern:
      layer += k in (MAMBA, ATTENTION)
      slots.append((k, f"model.layers.{layer}.", GRANITE_TABLES[k]))
    return slots
  if layout != "mamba_ssm":
    if layout == "hf" and cfg.pattern != MAMBA * cfg.n_layer:
      raise ValueError(f"transformers' Mamba2 layout holds pure Mamba-2 models; a hybrid "
                       f"(layer_pattern {cfg.layer_pattern!r}) reads and writes as nemotron_h")
    tables = {**KIND_TABLES, MOE: _moe_table(cfg) if MOE in cfg.pattern else MOE_TABLE}
    return [(k, f"{LAYER_PREFIX}{i}.", tables[k]) for i, k in enumerate(cfg.pattern)]
  problem = mamba_ssm_pattern_problem(cfg)
  if problem:
    raise ValueError(f"Cannot represent this model in the mamba_ssm layout: {problem}")
  slots, block = [], -1
  for k in cfg.pattern:
    block += k != MLP
    slots.append((k, f"{LAYER_PREFIX}{block}.", MAMBA_SSM_TABLES[k]))
  return slots


def mamba_ssm_pattern_problem(cfg: Mamba2Config) -> str | None:
  """Why mamba_ssm's MambaLMHeadModel cannot hold `cfg`'s layers, or None."""
  p = cfg.pattern
  if granite_only_problems(cfg, "mamba_ssm"):
    return "; ".join(granite_only_problems(cfg, "mamba_ssm"))
  if MOE in p:
    return "mamba_ssm has no mixture-of-experts layers ('E'); export as NemotronH (save_hf)"
  if p.startswith(MLP) or MLP + MLP in p:
    return f"layer_pattern {p!r}: every MLP must follow a Mamba-2 or attention layer"
  if MLP in p and p.count(MLP) != p.count(MAMBA) + p.count(ATTENTION):
    return f"layer_pattern {p!r}: with MLPs, every block (mixer) must have one after it"
  if MLP in p and (cfg.mlp_act != "swiglu" or cfg.d_intermediate % 128):
    return ("mamba_ssm's MLP is GatedMLP: mlp_act must be 'swiglu' and d_intermediate a "
            f"multiple of 128 (got {cfg.mlp_act!r}, {cfg.d_intermediate})")
  return None


def _outside_layer_shapes(cfg: Mamba2Config, kind: str = MAMBA,
                          layout: str = "hf") -> dict[str, tuple[int, ...]]:
  d = cfg.d_model
  if layout == "granite" and kind in (MOE, MLP):
    e, f = cfg.n_routed_experts, cfg.moe_intermediate_size
    s = cfg.moe_shared_expert_intermediate_size if kind == MOE else cfg.d_intermediate
    out = {"post_attention_layernorm.weight": (d,), "shared_mlp.input_linear.weight": (2 * s, d),
           "shared_mlp.output_linear.weight": (d, s)}
    if kind == MOE:
      out.update({"block_sparse_moe.router.weight": (e, d), "block_sparse_moe.experts.gate_up_proj": (e, 2 * f, d),
                  "block_sparse_moe.experts.down_proj": (e, d, f)})
    return out
  if layout == "granite":  # the NemotronH shapes under Granite's names
    renames = {s: g for (s, _), g in zip(KIND_TABLES[kind].items(), GRANITE_TABLES[kind])}
    return {renames[s]: shp for s, shp in _outside_layer_shapes(cfg, kind, "nemotron_h").items()}
  if layout == "mamba_ssm" and kind == ATTENTION:
    he, kve = cfg.attn_num_heads * cfg.attn_head_dim, cfg.n_kv_heads * cfg.attn_head_dim
    return {"norm.weight": (d,), "mixer.in_proj.weight": (he + 2 * kve, d),
            "mixer.out_proj.weight": (d, he)}
  if layout == "mamba_ssm" and kind == MLP:
    f = cfg.d_intermediate
    return {"norm2.weight": (d,), "mlp.fc1.weight": (2 * f, d), "mlp.fc2.weight": (d, f)}
  if kind == ATTENTION:
    he, kve = cfg.attn_num_heads * cfg.attn_head_dim, cfg.n_kv_heads * cfg.attn_head_dim
    return {"norm.weight": (d,), "mixer.q_proj.weight": (he, d), "mixer.k_proj.weight": (kve, d),
            "mixer.v_proj.weight": (kve, d), "mixer.o_proj.weight": (d, he)}
  if kind == MLP:
    f = cfg.d_intermediate
    return {"norm.weight": (d,), "mixer.up_proj.weight": (f, d), "mixer.down_proj.weight": (d, f)}
  if kind == MOE:  # our shapes through each row's codec (all transposes)
    ours = moe_lib.shapes(cfg)
    flip = lambda shp: shp if len(shp) == 1 else shp[:-2] + (shp[-1], shp[-2])
    return {s: flip(ours[names[0]]) for s, (names, _) in _moe_table(cfg).items()}
  d_in_proj = sum(_in_proj_sizes(cfg))
  return {
      "norm.weight": (cfg.d_model,),
      "mixer.in_proj.weight": (d_in_proj, cfg.d_model),
      "mixer.conv1d.weight": (cfg.conv_dim, 1, cfg.d_conv),
      "mixer.conv1d.bias": (cfg.conv_dim,),
      "mixer.dt_bias": (cfg.nheads,),
      "mixer.A_log": (cfg.nheads,),
      "mixer.D": (cfg.nheads,),
      "mixer.norm.weight": (cfg.d_inner,),
      "mixer.out_proj.weight": (cfg.d_model, cfg.d_inner),
  }


def state_dict_to_params(sd: dict[str, np.ndarray], cfg: Mamba2Config, layout: str) -> dict:
  """Outside state dict (numpy arrays) -> our nested params. Strict about names and shapes."""
  top = TOP_TABLE[layout]
  if layout == "nemotron_h":
    # transformers holds NemotronH as `model.*` in memory and writes `backbone.*`
    # (its checkpoint conversion); both are read.
    sd = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in sd.items() if not k.startswith(NEMOTRON_H_IGNORED)}
    if MOE in cfg.pattern:
      sd = _join_experts(sd, cfg)
  if layout == "granite":
    sd = {_granite_name(k): v for k, v in sd.items()}
  slots = _layer_slots(cfg, layout)
  shapes = {kind: _outside_layer_shapes(cfg, kind, layout) for kind in set(cfg.pattern)}
  expected = {f"{prefix}{s}": shp for kind, prefix, _ in slots for s, shp in shapes[kind].items()}
  emb_name = next(k for k, v in top.items() if v == "embedding")
  norm_name = next(k for k, v in top.items() if v == "norm_f")
  expected[emb_name] = None  # rows checked below (may be padded)
  expected[norm_name] = (cfg.d_model,)
  tied_head = cfg.tie_embeddings
  if not tied_head:
    expected["lm_head.weight"] = None
  names = set(sd)
  missing = sorted(set(expected) - names)
  # A tied lm_head may be stored (mamba_ssm writes a copy); anything else is unknown.
  unknown = sorted(names - set(expected) - ({"lm_head.weight"} if tied_head else set()))
  if missing or unknown:
    raise ValueError(f"State dict does not match a {layout} Mamba-2 with n_layer={cfg.n_layer}: "
                     f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                     f"unknown {unknown[:8]}{'...' if len(unknown) > 8 else ''}")
  bad = [f"{k}: {tuple(sd[k].shape)} != expected {shp}" for k, shp in expected.items()
         if shp is not None and tuple(sd[k].shape) != shp]
  v_pad, d = cfg.padded_vocab_size, cfg.d_model
  for name in [emb_name] + ([] if tied_head else ["lm_head.weight"]):
    rows, cols = sd[name].shape
    if cols != d or not cfg.vocab_size <= rows <= v_pad:
      bad.append(f"{name}: {tuple(sd[name].shape)}, expected ({cfg.vocab_size}..{v_pad}, {d})")
  if bad:
    raise ValueError("Tensor shapes do not match the config: " + "; ".join(bad))

  f32 = lambda a: np.asarray(a, np.float32)
  pad_rows = lambda a: np.pad(f32(a), [(0, v_pad - a.shape[0]), (0, 0)])
  per_layer: dict[str, dict[str, list]] = {}
  for kind, prefix, table in slots:
    mine = per_layer.setdefault(KIND_PARAMS[kind], {})
    for suffix, (ours, codec) in table.items():
      for name, arr in zip(ours, codec.to_ours(f32(sd[f"{prefix}{suffix}"]), cfg)):
        mine.setdefault(name, []).append(arr)
  params = {"embedding": pad_rows(sd[emb_name]), "norm_f": f32(sd[norm_name])}
  params.update({attr: {k: np.stack(v) for k, v in stacks.items()}
                 for attr, stacks in per_layer.items()})
  if not tied_head:
    params["lm_head"] = pad_rows(sd["lm_head.weight"])
  return params


def params_to_state_dict(params: dict, cfg: Mamba2Config, layout: str, *,
                         vocab_rows: int | None = None) -> dict[str, np.ndarray]:
  """Our params -> an outside state dict (numpy). `vocab_rows` trims the embedding."""
  rows = vocab_rows or cfg.padded_vocab_size
  top = {v: k for k, v in TOP_TABLE[layout].items()}
  sd = {top["embedding"]: np.asarray(params["embedding"])[:rows],
        top["norm_f"]: np.asarray(params["norm_f"])}
  slots = _layer_slots(cfg, layout)
  stacks = {attr: {k: np.asarray(v) for k, v in params[attr].items()}
            for attr in {KIND_PARAMS[k] for k in cfg.pattern}}
  seen = dict.fromkeys(KIND_TABLES, 0)
  for kind, prefix, table in slots:
    j, seen[kind] = seen[kind], seen[kind] + 1  # index among this kind's layers
    for suffix, (ours, codec) in table.items():
      sd[f"{prefix}{suffix}"] = np.ascontiguousarray(
          codec.to_outside(tuple(stacks[KIND_PARAMS[kind]][n][j] for n in ours), cfg))
  if layout == "nemotron_h":  # transformers never ties NemotronH's head: write it
    sd[top["lm_head"]] = np.asarray(params["embedding" if cfg.tie_embeddings else "lm_head"])[:rows]
    sd = _split_experts(sd)
  elif not cfg.tie_embeddings:
    sd[top["lm_head"]] = np.asarray(params["lm_head"])[:rows]
  else:
    for alias, source in tied_aliases(cfg, layout).items():
      sd[alias] = sd[source]
  return sd


def tied_aliases(cfg: Mamba2Config, layout: str) -> dict[str, str]:
  """{name: the name whose tensor it is}: outside names that hold another's tensor.
  mamba_ssm's state dict stores the tied LM head as the embedding itself."""
  if layout == "mamba_ssm" and cfg.tie_embeddings:
    top = {v: k for k, v in TOP_TABLE[layout].items()}
    return {top["lm_head"]: top["embedding"]}
  return {}


# ----------------------------------------------------------------------------
# Configs.


def _json_float(v):
  # transformers writes infinity as {"__float__": "Infinity"}; plain JSON gives a dict.
  if isinstance(v, dict) and "__float__" in v:
    return float(v["__float__"])
  return float(v)


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
      dt_limit=tuple(_json_float(v) for v in limit),
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
      "time_step_limit": [lo, hi if math.isfinite(hi) or not for_json else {"__float__": "Infinity"}],
      "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "residual_in_fp32": True, "rms_norm": True, "use_bias": False, "use_conv_bias": True,
      "hidden_act": "silu", "norm_before_gate": False, "rescale_prenorm_residual": False,
      "eos_token_id": eos_token_id, "bos_token_id": bos_token_id, "pad_token_id": pad_token_id,
      "torch_dtype": dtype,
  }


# NemotronH's names of the layer kinds (transformers 5 and the older ones).
NEMOTRON_H_KINDS = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION,
                    "attention": ATTENTION, "mlp": MLP, "moe": MOE}
NEMOTRON_H_CHARS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
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
  # time_step_limit (transformers 5.24, NemotronHMamba2Mixer); ours says so in dt_limit.
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
      "layers_block_type": [names[k] for k in cfg.pattern],
      "num_hidden_layers": cfg.n_layer,
      "ssm_state_size": cfg.d_state, "conv_kernel": cfg.d_conv, "mamba_num_heads": cfg.nheads,
      "mamba_head_dim": cfg.headdim, "n_groups": cfg.ngroups, "chunk_size": cfg.chunk_size,
      # NemotronH's lower clamp of dt (see nemotron_h_config_to_ours); 0 is none.
      "time_step_min": cfg.dt_limit[0], "time_step_max": cfg.dt_max,
      "time_step_floor": cfg.dt_init_floor, "time_step_limit": [cfg.dt_limit[0], {"__float__": "Infinity"}],
      "num_attention_heads": cfg.attn_num_heads or 1, "num_key_value_heads": cfg.n_kv_heads or 1,
      "head_dim": cfg.attn_head_dim, "intermediate_size": cfg.d_intermediate or 1,
      "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_bias": False,
      "mamba_proj_bias": False, "mlp_bias": False, "attention_bias": False, "use_conv_bias": True,
      "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": False,
      "residual_in_fp32": True, "rescale_prenorm_residual": False, "num_nextn_predict_layers": 0,
      "eos_token_id": eos_token_id, "bos_token_id": bos_token_id, "pad_token_id": pad_token_id,
      "torch_dtype": dtype, **moe,
  }


# GraniteMoeHybrid's names of its mixers (transformers 5 and the released files).
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
      dt_limit=tuple(_json_float(v) for v in limit), norm_eps=hf.get("rms_norm_eps", 1e-6),
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


def mamba_ssm_config_to_ours(mc: dict) -> Mamba2Config:
  ssm = dict(mc.get("ssm_cfg") or {})
  problems = []
  if ssm.pop("layer", "Mamba1") != "Mamba2":
    problems.append("ssm_cfg.layer is not 'Mamba2'")
  if not mc.get("rms_norm", True):
    problems.append("rms_norm=false (LayerNorm) is not supported")
  n_blocks, d_int = mc["n_layer"], mc.get("d_intermediate", 0) or 0
  attn_idx = sorted(mc.get("attn_layer_idx") or [])
  if any(not 0 <= i < n_blocks for i in attn_idx):
    problems.append(f"attn_layer_idx {attn_idx} has indices outside [0, n_layer={n_blocks})")
  attn = dict(mc.get("attn_cfg") or {})
  hybrid = {}
  if attn_idx:
    # mamba_ssm's MHA, causal (create_block makes it so); the parts it has beyond
    # plain attention must be off: biases (on by default there), a conv on qkv, a
    # fused MLP, a custom scale, interleaved rotary.
    for flag, ok in (("qkv_proj_bias", False), ("out_proj_bias", False), ("d_conv", 0),
                     ("mlp_dim", 0), ("softmax_scale", None), ("rotary_emb_interleaved", False),
                     ("causal", True)):
      if attn.pop(flag, True if flag.endswith("bias") else ok) != ok:
        problems.append(f"attn_cfg.{flag} must be {ok}")
    heads = attn.pop("num_heads", None)
    if not heads:
      problems.append("attn_cfg.num_heads is missing")
    hybrid = dict(attn_num_heads=heads or 1, attn_num_heads_kv=attn.pop("num_heads_kv", None) or 0,
                  attn_head_dim=attn.pop("head_dim", None) or mc["d_model"] // (heads or 1),
                  attn_rotary_emb_dim=attn.pop("rotary_emb_dim", 0),
                  attn_rotary_base=float(attn.pop("rotary_emb_base", 10000.0)))
    if attn:
      problems.append(f"attn_cfg fields {sorted(attn)} are not supported")
  if d_int:
    # GatedMLP rounds its width up to a multiple of 128.
    hybrid.update(d_intermediate=-(-d_int // 128) * 128, mlp_act="swiglu")
  if attn_idx or d_int:
    hybrid["layer_pattern"] = "".join((ATTENTION if i in attn_idx else MAMBA) + (MLP if d_int else "")
                                      for i in range(n_blocks))
  for flag, ok in (("bias", False), ("conv_bias", True), ("D_has_hdim", False),
                   ("norm_before_gate", False), ("rmsnorm", True)):
    if ssm.pop(flag, ok) != ok:
      problems.append(f"ssm_cfg.{flag} must be {ok}")
  names = {"d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_min",
           "dt_max", "dt_init_floor", "dt_limit", "A_init_range"}
  unknown = sorted(set(ssm) - names)
  if unknown:
    problems.append(f"ssm_cfg fields {unknown} are not supported")
  if problems:
    raise ValueError("Cannot represent this mamba_ssm config: " + "; ".join(problems))
  if "dt_limit" in ssm:
    ssm["dt_limit"] = tuple(_json_float(v) for v in ssm["dt_limit"])
  n_layer = len(hybrid["layer_pattern"]) if "layer_pattern" in hybrid else n_blocks
  return Mamba2Config(d_model=mc["d_model"], n_layer=n_layer, vocab_size=mc["vocab_size"],
                      pad_vocab_size_multiple=mc.get("pad_vocab_size_multiple", 16),
                      tie_embeddings=mc.get("tie_embeddings", True), **ssm, **hybrid)


def ours_to_mamba_ssm_config(cfg: Mamba2Config) -> dict:
  if cfg.mamba_num_heads:
    raise ValueError("Cannot represent this model in the mamba_ssm layout: mamba_num_heads is set "
                     "(mamba_ssm derives d_inner as expand * d_model)")
  d = Mamba2Config()  # write only what differs from mamba_ssm's Mamba2 defaults
  ssm = {"layer": "Mamba2"}
  for name in ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_min",
               "dt_max", "dt_init_floor"):
    if getattr(cfg, name) != getattr(d, name):
      ssm[name] = getattr(cfg, name)
  if cfg.dt_limit != d.dt_limit:
    ssm["dt_limit"] = list(cfg.dt_limit)
  problem = mamba_ssm_pattern_problem(cfg)
  if problem:
    raise ValueError(f"Cannot represent this model in the mamba_ssm layout: {problem}")
  mixers = cfg.pattern.replace(MLP, "")
  attn_idx = [i for i, k in enumerate(mixers) if k == ATTENTION]
  attn_cfg = {} if not attn_idx else {
      "num_heads": cfg.attn_num_heads, "num_heads_kv": cfg.n_kv_heads,
      "head_dim": cfg.attn_head_dim, "rotary_emb_dim": cfg.attn_rotary_emb_dim,
      "rotary_emb_base": cfg.attn_rotary_base, "qkv_proj_bias": False, "out_proj_bias": False,
      "causal": True}
  return {"d_model": cfg.d_model, "d_intermediate": cfg.d_intermediate if MLP in cfg.pattern else 0,
          "n_layer": len(mixers), "vocab_size": cfg.vocab_size, "ssm_cfg": ssm,
          "attn_layer_idx": attn_idx, "attn_cfg": attn_cfg,
          "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
          "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple,
          "tie_embeddings": cfg.tie_embeddings}


def config_layout(outside: dict) -> str | None:
  """'mamba_ssm', 'hf', 'nemotron_h' or 'granite' for an outside config.json's contents, None
  for none of them."""
  if outside.get("model_type") == "nemotron_h":
    return "nemotron_h"
  if outside.get("model_type") == "granitemoehybrid":
    return "granite"
  if "ssm_cfg" in outside or "d_model" in outside:
    return "mamba_ssm"
  if outside.get("model_type") == "mamba2" or "hidden_size" in outside:
    return "hf"
  return None


def hf_tokenizer_files(eos_token: str | None) -> dict[str, dict]:
  """The two small files beside tokenizer.json that transformers' AutoTokenizer reads."""
  files = {"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                     "model_max_length": 1_000_000_000}}
  if eos_token:
    special = {k: eos_token for k in ("eos_token", "bos_token", "unk_token", "pad_token")}
    files["tokenizer_config.json"].update(special)
    files["special_tokens_map.json"] = special
  return files


def read_json(path) -> dict:
  """A JSON file; `path` may be an epath.Path on a bucket."""
  with path.open() if hasattr(path, "open") else open(path) as f:
    return json.load(f)
