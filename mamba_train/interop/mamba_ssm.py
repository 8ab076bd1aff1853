"""mamba_ssm's MambaLMHeadModel (`mamba_ssm`): the released state-spaces/mamba2-*
and mamba3-* checkpoints (`config.json` + `pytorch_model.bin`) and its hybrids, read
and written.

A hybrid (attn_layer_idx, d_intermediate) holds in its block j a mixer (Mamba2,
Mamba3 or MHA, `norm` + `mixer.*`) and, with d_intermediate > 0, a GatedMLP (`norm2`
+ `mlp.*`) after it: in our pattern a mixer layer, then an MLP layer, under one
outside index. `ssm_cfg.layer` names one SSM class for every block, so a model's SSM
layers are all Mamba-2 ('M') or all Mamba-3 ('3'). Its state dict stores a tied head
as the embedding's tensor under `lm_head.weight`.
"""

from __future__ import annotations

import numpy as np

from mamba_train.interop import tables
from mamba_train.interop.files import TORCH_BIN, json_float
from mamba_train.interop.granite import granite_only_problems
from mamba_train.interop.tables import IDENTITY, TRANSPOSE, Codec, attn_head_dim, out_heads_codec
from mamba_train.model.config import ATTENTION, MAMBA, MAMBA3, MLP, MOE, Mamba2Config

TOP = {"backbone.embedding.weight": "embedding", "backbone.norm_f.weight": "norm_f",
       "lm_head.weight": "lm_head"}


def _split_qkv(w, cfg):  # MHA in_proj ((h + 2kv) e, d) -> q (d, h, e), k, v (d, kv, e)
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


ATTN_TABLE: tables.Table = {
    "norm.weight": (("norm",), IDENTITY),
    "mixer.in_proj.weight": (("q_proj", "k_proj", "v_proj"), Codec(_split_qkv, _join_qkv)),
    "mixer.out_proj.weight": (("o_proj",), out_heads_codec(attn_head_dim)),
}
MLP_TABLE: tables.Table = {
    "norm2.weight": (("norm",), IDENTITY),
    "mlp.fc1.weight": (("up_proj", "gate_proj"), Codec(_split_fc1, _join_fc1)),
    "mlp.fc2.weight": (("down_proj",), TRANSPOSE),
}
MAMBA_SSM_TABLES = {MAMBA: tables.MAMBA_TABLE, ATTENTION: ATTN_TABLE, MLP: MLP_TABLE}


# ----------------------------------------------------------------------------
# The Mamba-3 mixer (mamba_ssm's Mamba3). Its in_proj rows are
# [z, x, B, C, dd_dt, dd_A, trap, angles]; ours are stored split (model/params.py
# MAMBA3_PARAM_AXES) and joined back here. B and C keep mamba_ssm's "(r g n)" order.


def _m3_in_proj_sizes(cfg):
  i, bc, h = cfg.d_inner, cfg.mamba3_rank * cfg.ngroups * cfg.d_state, cfg.nheads
  return [i, i, bc, bc, h, h, h, cfg.num_rope_angles]


def _split_m3_in_proj(w, cfg):  # (rows, d) -> zx (d, 2, i), bc (d, 2, R g n), heads (d, 3, h), angles (d, A_n)
  z, x, B, C, dt, A, trap, ang = np.split(w, np.cumsum(_m3_in_proj_sizes(cfg))[:-1], axis=0)
  return np.stack([z.T, x.T], 1), np.stack([B.T, C.T], 1), np.stack([dt.T, A.T, trap.T], 1), ang.T


def _join_m3_in_proj(ws, cfg):
  zx, bc, heads, ang = ws
  return np.concatenate([zx[:, 0].T, zx[:, 1].T, bc[:, 0].T, bc[:, 1].T,
                         heads[:, 0].T, heads[:, 1].T, heads[:, 2].T, ang.T], axis=0)


def mamba3_table(cfg: Mamba2Config) -> tables.Table:
  """A Mamba3 block's tensors: the MIMO projections with is_mimo, the output norm
  (`mixer.norm`, our `gate_norm`) with is_outproj_norm."""
  table = {
      "norm.weight": (("norm",), IDENTITY),
      "mixer.in_proj.weight": (("in_proj_zx", "in_proj_bc", "in_proj_heads", "in_proj_angles"),
                               Codec(_split_m3_in_proj, _join_m3_in_proj)),
      "mixer.dt_bias": (("dt_bias",), IDENTITY),
      "mixer.B_bias": (("B_bias",), IDENTITY),
      "mixer.C_bias": (("C_bias",), IDENTITY),
      "mixer.B_norm.weight": (("B_norm",), IDENTITY),
      "mixer.C_norm.weight": (("C_norm",), IDENTITY),
      "mixer.D": (("D",), IDENTITY),
      "mixer.out_proj.weight": (("out_proj",), TRANSPOSE),
  }
  if cfg.is_mimo:
    table.update({f"mixer.{k}": ((k,), IDENTITY) for k in ("mimo_x", "mimo_z", "mimo_o")})
  if cfg.is_outproj_norm:
    table["mixer.norm.weight"] = (("gate_norm",), IDENTITY)
  return table


def _mamba3_shapes(cfg: Mamba2Config) -> tables.Shapes:
  d, i, h, p, n, R = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.headdim, cfg.d_state, cfg.mamba3_rank
  shapes = {"norm.weight": (d,), "mixer.in_proj.weight": (sum(_m3_in_proj_sizes(cfg)), d),
            "mixer.dt_bias": (h,), "mixer.B_bias": (h, R, n), "mixer.C_bias": (h, R, n),
            "mixer.B_norm.weight": (n,), "mixer.C_norm.weight": (n,), "mixer.D": (h,),
            "mixer.out_proj.weight": (d, i), "mixer.norm.weight": (i,),
            **{f"mixer.{k}": (h, R, p) for k in ("mimo_x", "mimo_z", "mimo_o")}}
  return {k: shapes[k] for k in mamba3_table(cfg)}


# mamba_ssm's Mamba3 defaults (its __init__): what its config.json may leave out (an
# export writes them all). chunk_size too: no weight depends on it.
MAMBA3_DEFAULTS = dict(d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=0.001,
                       dt_max=0.1, dt_init_floor=1e-4, A_floor=1e-4, is_outproj_norm=False,
                       is_mimo=False, mimo_rank=4, chunk_size=64)
# Mamba3 arguments that choose a kernel or are swallowed, never a different function:
# the fused MIMO pre-gate norm computes what the unfused one does; dropout is accepted
# "just to absorb the kwarg" and unused.
MAMBA3_IGNORED = ("fuse_pregate_headwise_norm", "dropout")
# The SSM layer classes mamba_ssm's create_block maps ssm_cfg.layer to, and our kinds.
SSM_LAYERS = {"Mamba2": MAMBA, "Mamba3": MAMBA3}


def _attn_shapes(cfg: Mamba2Config) -> tables.Shapes:
  d = cfg.d_model
  he, kve = cfg.attn_num_heads * cfg.attn_head_dim, cfg.n_kv_heads * cfg.attn_head_dim
  return {"norm.weight": (d,), "mixer.in_proj.weight": (he + 2 * kve, d), "mixer.out_proj.weight": (d, he)}


def _mlp_shapes(cfg: Mamba2Config) -> tables.Shapes:
  d, f = cfg.d_model, cfg.d_intermediate
  return {"norm2.weight": (d,), "mlp.fc1.weight": (2 * f, d), "mlp.fc2.weight": (d, f)}


def mamba_ssm_pattern_problem(cfg: Mamba2Config) -> str | None:
  """Why mamba_ssm's MambaLMHeadModel cannot hold `cfg`'s layers, or None."""
  p = cfg.pattern
  if granite_only_problems(cfg, "mamba_ssm"):
    return "; ".join(granite_only_problems(cfg, "mamba_ssm"))
  if MOE in p:
    return "mamba_ssm has no mixture-of-experts layers ('E'); export as NemotronH (save_hf)"
  if MAMBA in p and MAMBA3 in p:
    return (f"layer_pattern {p!r} has Mamba-2 ('M') and Mamba-3 ('3') layers; mamba_ssm's "
            "ssm_cfg.layer names one SSM class for all its blocks")
  if p.startswith(MLP) or MLP + MLP in p:
    return f"layer_pattern {p!r}: every MLP must follow a Mamba-2, Mamba-3 or attention layer"
  if MLP in p and p.count(MLP) != p.count(MAMBA) + p.count(MAMBA3) + p.count(ATTENTION):
    return f"layer_pattern {p!r}: with MLPs, every block (mixer) must have one after it"
  if MLP in p and (cfg.mlp_act != "swiglu" or cfg.d_intermediate % 128):
    return ("mamba_ssm's MLP is GatedMLP: mlp_act must be 'swiglu' and d_intermediate a "
            f"multiple of 128 (got {cfg.mlp_act!r}, {cfg.d_intermediate})")
  return None


def _refuse_pattern(cfg: Mamba2Config) -> None:
  problem = mamba_ssm_pattern_problem(cfg)
  if problem:
    raise ValueError(f"Cannot represent this model in the mamba_ssm layout: {problem}")


def _slots(cfg: Mamba2Config) -> list[tables.Slot]:
  _refuse_pattern(cfg)
  slots, block = [], -1
  by_kind = dict(MAMBA_SSM_TABLES, **({MAMBA3: mamba3_table(cfg)} if MAMBA3 in cfg.pattern else {}))
  for k in cfg.pattern:
    block += k != MLP
    slots.append((k, f"{tables.LAYER_PREFIX}{block}.", by_kind[k]))
  return slots


def _int_if_whole(v):
  # mamba_ssm computes d_inner as int(expand * d_model), so a config may say 2.0.
  return int(v) if isinstance(v, float) and v.is_integer() else v


def _ssm_fields(layer: str, ssm: dict, problems: list) -> dict:
  """ssm_cfg's fields (less `layer`) as ours, for mamba_ssm's Mamba2 or Mamba3 class;
  what ours cannot hold goes into `problems`, by name."""
  if layer == "Mamba3":
    for name in MAMBA3_IGNORED:
      ssm.pop(name, None)
    names = set(MAMBA3_DEFAULTS)
    out = {**MAMBA3_DEFAULTS}  # its defaults, not ours (chunk_size 64, not 256)
  else:
    for flag, ok in (("bias", False), ("conv_bias", True), ("D_has_hdim", False),
                     ("norm_before_gate", False), ("rmsnorm", True)):
      if ssm.pop(flag, ok) != ok:
        problems.append(f"ssm_cfg.{flag} must be {ok}")
    names = {"d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_min",
             "dt_max", "dt_init_floor", "dt_limit", "A_init_range"}
    out = {}
  unknown = sorted(set(ssm) - names)
  if unknown:
    problems.append(f"ssm_cfg fields {unknown} are not supported for layer {layer!r}")
  out.update({k: _int_if_whole(v) if k == "expand" else v for k, v in ssm.items() if k in names})
  if "dt_limit" in out:
    out["dt_limit"] = tuple(json_float(v) for v in out["dt_limit"])
  return out


def mamba_ssm_config_to_ours(mc: dict) -> Mamba2Config:
  ssm = dict(mc.get("ssm_cfg") or {})
  problems = []
  layer = ssm.pop("layer", "Mamba1")
  if layer not in SSM_LAYERS:
    problems.append(f"ssm_cfg.layer is {layer!r}; this library builds {sorted(SSM_LAYERS)}")
    layer = "Mamba2"
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
  mixer = SSM_LAYERS[layer]
  if attn_idx or d_int or mixer != MAMBA:
    hybrid["layer_pattern"] = "".join((ATTENTION if i in attn_idx else mixer) + (MLP if d_int else "")
                                      for i in range(n_blocks))
  fields = _ssm_fields(layer, ssm, problems)
  if problems:
    raise ValueError("Cannot represent this mamba_ssm config: " + "; ".join(problems))
  n_layer = len(hybrid["layer_pattern"]) if "layer_pattern" in hybrid else n_blocks
  return Mamba2Config(d_model=mc["d_model"], n_layer=n_layer, vocab_size=mc["vocab_size"],
                      pad_vocab_size_multiple=mc.get("pad_vocab_size_multiple", 16),
                      tie_embeddings=mc.get("tie_embeddings", True), **fields, **hybrid)


def _mamba3_ssm_cfg(cfg: Mamba2Config) -> dict:
  if cfg.A_activation != "heavy_tail":
    raise ValueError(f"Cannot represent this model in the mamba_ssm layout: A_activation="
                     f"{cfg.A_activation!r}; mamba_ssm's Mamba3 computes A with the heavy-tail "
                     "activation (since its PR #962) and has no field to say otherwise")
  # Every field, defaults included, as the released mamba3-* config.json files state
  # them: the file then means the same model whatever mamba_ssm's defaults become.
  return {"layer": "Mamba3", **{k: getattr(cfg, k) for k in MAMBA3_DEFAULTS}}


def ours_to_mamba_ssm_config(cfg: Mamba2Config) -> dict:
  if cfg.mamba_num_heads:
    raise ValueError("Cannot represent this model in the mamba_ssm layout: mamba_num_heads is set "
                     "(mamba_ssm derives d_inner as expand * d_model)")
  _refuse_pattern(cfg)
  if MAMBA3 in cfg.pattern:
    ssm = _mamba3_ssm_cfg(cfg)
  else:
    d = Mamba2Config()  # write only what differs from mamba_ssm's Mamba2 defaults
    ssm = {"layer": "Mamba2"}
    for name in ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_min",
                 "dt_max", "dt_init_floor"):
      if getattr(cfg, name) != getattr(d, name):
        ssm[name] = getattr(cfg, name)
    if cfg.dt_limit != d.dt_limit:
      ssm["dt_limit"] = list(cfg.dt_limit)
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


def _write_config(cfg: Mamba2Config, **_) -> dict:
  # mamba_ssm's config.json names no token ids or dtype, and its vocabulary is the config's.
  return ours_to_mamba_ssm_config(cfg)


LAYOUT = tables.Layout(
    name="mamba_ssm", recognizes=lambda outside: "ssm_cfg" in outside or "d_model" in outside,
    config_to_ours=mamba_ssm_config_to_ours, write_config=_write_config, weights=TORCH_BIN,
    top=TOP, slots=_slots, shapes={MAMBA: tables.mamba_shapes, MAMBA3: _mamba3_shapes, ATTENTION: _attn_shapes,
            MLP: _mlp_shapes},
    tied_head="alias", padded_vocab=True)
