"""What every outside layout's tables are built from.

A layout maps each of its per-layer tensors to our parameters with a `Codec` (to our
arrays and back); a kind's `Table` holds those rows, and both directions of the
conversion are derived from the tables (`convert.py`). The Mamba-2 mixer's table
(its in_proj and conv split into ours and joined back) is the one all four layouts
share, under their own prefixes; transformers' attention table serves NemotronH and
Granite. `Layout` is the row of `convert.LAYOUTS`: one outside layout's config
reader and writer, weight file, names and tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mamba_train.interop.files import WeightFile
from mamba_train.model.config import Mamba2Config


@dataclass(frozen=True)
class Codec:
  """to_ours(outside, cfg) -> tuple of our arrays; to_outside(tuple, cfg) -> array."""
  to_ours: Callable
  to_outside: Callable


# Outside per-layer suffix (after the layer's prefix) -> (our block params, codec).
Table = dict[str, tuple[tuple[str, ...], Codec]]
Shapes = dict[str, tuple[int, ...]]  # outside per-layer suffix -> its shape

IDENTITY = Codec(lambda w, cfg: (w,), lambda ws, cfg: ws[0])
TRANSPOSE = Codec(lambda w, cfg: (w.T,), lambda ws, cfg: ws[0].T)
SWAP_LAST = Codec(lambda w, cfg: (np.swapaxes(w, -1, -2),), lambda ws, cfg: np.swapaxes(ws[0], -1, -2))


def heads_codec(e_of):  # outside (heads*e, d) <-> ours (d, heads, e)
  return Codec(lambda w, cfg: (w.T.reshape(w.shape[1], -1, e_of(cfg)),),
               lambda ws, cfg: ws[0].reshape(ws[0].shape[0], -1).T)


def out_heads_codec(e_of):  # outside (d, heads*e) <-> ours (heads, e, d)
  return Codec(lambda w, cfg: (w.T.reshape(-1, e_of(cfg), w.shape[0]),),
               lambda ws, cfg: ws[0].reshape(-1, ws[0].shape[-1]).T)


def attn_head_dim(cfg: Mamba2Config) -> int:
  return cfg.attn_head_dim


def renamed(table: dict, renames: dict[str, str]) -> dict:
  """A table (or its shapes) with its outside suffixes renamed (prefix by prefix)."""
  def name(suffix):
    for old, new in renames.items():
      if suffix.startswith(old):
        return new + suffix[len(old):]
    return suffix
  return {name(k): v for k, v in table.items()}


# ----------------------------------------------------------------------------
# The Mamba-2 mixer, as every layout holds it.


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


MAMBA_TABLE: Table = {
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


def mamba_shapes(cfg: Mamba2Config) -> Shapes:
  return {
      "norm.weight": (cfg.d_model,),
      "mixer.in_proj.weight": (sum(_in_proj_sizes(cfg)), cfg.d_model),
      "mixer.conv1d.weight": (cfg.conv_dim, 1, cfg.d_conv),
      "mixer.conv1d.bias": (cfg.conv_dim,),
      "mixer.dt_bias": (cfg.nheads,),
      "mixer.A_log": (cfg.nheads,),
      "mixer.D": (cfg.nheads,),
      "mixer.norm.weight": (cfg.d_inner,),
      "mixer.out_proj.weight": (cfg.d_model, cfg.d_inner),
  }


# ----------------------------------------------------------------------------
# transformers' attention layer (NemotronH's; Granite's under other names).

ATTN_TABLE: Table = {
    "norm.weight": (("norm",), IDENTITY),
    "mixer.q_proj.weight": (("q_proj",), heads_codec(attn_head_dim)),
    "mixer.k_proj.weight": (("k_proj",), heads_codec(attn_head_dim)),
    "mixer.v_proj.weight": (("v_proj",), heads_codec(attn_head_dim)),
    "mixer.o_proj.weight": (("o_proj",), out_heads_codec(attn_head_dim)),
}


def attn_shapes(cfg: Mamba2Config) -> Shapes:
  d = cfg.d_model
  he, kve = cfg.attn_num_heads * cfg.attn_head_dim, cfg.n_kv_heads * cfg.attn_head_dim
  return {"norm.weight": (d,), "mixer.q_proj.weight": (he, d), "mixer.k_proj.weight": (kve, d),
          "mixer.v_proj.weight": (kve, d), "mixer.o_proj.weight": (d, he)}


# ----------------------------------------------------------------------------
# The row of the layout table.

# The prefix of every layer's tensors in transformers' Mamba2 and NemotronH files and mamba_ssm's.
LAYER_PREFIX = "backbone.layers."
Slot = tuple[str, str, Table]  # one of our layers: (kind, outside name prefix, table)


def _unchanged(sd, *_):
  return sd


@dataclass(frozen=True)
class Layout:
  """One outside layout: how its config.json is read and written, which file holds
  its weights, and how its tensors' names map to ours."""
  name: str  # as load_model and the conversion name it: "hf", "nemotron_h", "granite", "mamba_ssm"
  recognizes: Callable[[dict], bool]  # an outside config.json's contents are this layout's
  config_to_ours: Callable[[dict], Mamba2Config]  # refuses, naming the field, what ours cannot hold
  # (cfg, *, vocab_rows, eos_token_id, dtype) -> config.json's contents; refuses what
  # the layout cannot hold. None: it is read, never written.
  write_config: Callable[..., dict] | None
  weights: WeightFile
  top: dict[str, str]  # outside top-level name -> ours (embedding, norm_f, lm_head)
  slots: Callable[[Mamba2Config], list[Slot]]  # our layers in pattern order; refuses a pattern it cannot hold
  shapes: dict[str, Callable[[Mamba2Config], Shapes]]  # per layer kind: its tensors' outside shapes
  # A tied head in the files: "omit" (the embedding serves), "alias" (lm_head names the
  # embedding's tensor), or "write" (a copy of its own: the outside model never ties).
  tied_head: str = "omit"
  # Its files' names -> the tables' (older names, per-expert tensors stacked), and back.
  from_files: Callable[[dict, Mamba2Config], dict] = _unchanged
  to_files: Callable[[dict], dict] = _unchanged
  # Whether the files hold the padded vocabulary (mamba_ssm pads by
  # pad_vocab_size_multiple itself) or the true one (transformers then never
  # samples a padding row).
  padded_vocab: bool = False
  # Tensors the outside model keeps float32 whatever its dtype (by name suffix).
  float32_suffixes: tuple[str, ...] = ()
