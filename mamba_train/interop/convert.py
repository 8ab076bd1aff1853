"""Weight and config conversion between mamba_train and the outside layouts:
transformers' Mamba2ForCausalLM (`hf`) and the released state-spaces/mamba2-*
checkpoints (`mamba_ssm`). This is the only module that knows outside names.

One table (`LAYER_TABLE`) maps each outside per-layer tensor to our parameters
with a codec; both directions are derived from it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mamba_train.model.config import Mamba2Config

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
LAYER_PREFIX = "backbone.layers."


def _outside_layer_shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
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
  shapes = _outside_layer_shapes(cfg)
  expected = {f"{LAYER_PREFIX}{i}.{s}": shp for i in range(cfg.n_layer) for s, shp in shapes.items()}
  emb_name = next(k for k, v in top.items() if v == "embedding")
  expected[emb_name] = None  # rows checked below (may be padded)
  expected["backbone.norm_f.weight"] = (cfg.d_model,)
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
  per_layer: dict[str, list] = {}
  for i in range(cfg.n_layer):
    for suffix, (ours, codec) in LAYER_TABLE.items():
      for name, arr in zip(ours, codec.to_ours(f32(sd[f"{LAYER_PREFIX}{i}.{suffix}"]), cfg)):
        per_layer.setdefault(name, []).append(arr)
  params = {"embedding": pad_rows(sd[emb_name]), "norm_f": f32(sd["backbone.norm_f.weight"]),
            "layers": {k: np.stack(v) for k, v in per_layer.items()}}
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
  layers = {k: np.asarray(v) for k, v in params["layers"].items()}
  for i in range(cfg.n_layer):
    for suffix, (ours, codec) in LAYER_TABLE.items():
      sd[f"{LAYER_PREFIX}{i}.{suffix}"] = np.ascontiguousarray(
          codec.to_outside(tuple(layers[n][i] for n in ours), cfg))
  if not cfg.tie_embeddings:
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


def mamba_ssm_config_to_ours(mc: dict) -> Mamba2Config:
  ssm = dict(mc.get("ssm_cfg") or {})
  problems = []
  if ssm.pop("layer", "Mamba1") != "Mamba2":
    problems.append("ssm_cfg.layer is not 'Mamba2'")
  if not mc.get("rms_norm", True):
    problems.append("rms_norm=false (LayerNorm) is not supported")
  if mc.get("d_intermediate", 0):
    problems.append("d_intermediate>0 (MLP blocks) is not supported")
  if mc.get("attn_layer_idx"):
    problems.append("attention layers (attn_layer_idx) are not supported")
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
  return Mamba2Config(d_model=mc["d_model"], n_layer=mc["n_layer"], vocab_size=mc["vocab_size"],
                      pad_vocab_size_multiple=mc.get("pad_vocab_size_multiple", 16),
                      tie_embeddings=mc.get("tie_embeddings", True), **ssm)


def ours_to_mamba_ssm_config(cfg: Mamba2Config) -> dict:
  d = Mamba2Config()  # write only what differs from mamba_ssm's Mamba2 defaults
  ssm = {"layer": "Mamba2"}
  for name in ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_min",
               "dt_max", "dt_init_floor"):
    if getattr(cfg, name) != getattr(d, name):
      ssm[name] = getattr(cfg, name)
  if cfg.dt_limit != d.dt_limit:
    ssm["dt_limit"] = list(cfg.dt_limit)
  return {"d_model": cfg.d_model, "d_intermediate": 0, "n_layer": cfg.n_layer,
          "vocab_size": cfg.vocab_size, "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {},
          "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
          "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple,
          "tie_embeddings": cfg.tie_embeddings}


def config_layout(outside: dict) -> str | None:
  """'mamba_ssm' or 'hf' for an outside config.json's contents, None for neither."""
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
