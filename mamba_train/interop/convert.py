"""Weight and config conversion between mamba_train and the outside layouts.

`LAYOUTS` is the one table of them, one row (`tables.Layout`) per module:
transformers' Mamba2ForCausalLM (`hf`, hf_mamba2.py), transformers'
NemotronHForCausalLM (`nemotron_h`, the hybrids), transformers'
GraniteMoeHybridForCausalLM (`granite`, import only) and mamba_ssm's released
state-spaces/mamba2-* and mamba3-* checkpoints (`mamba_ssm`). `load_model` and the exports read
it; both directions of the weights' conversion below are derived from each row's
per-layer tables.
"""

from __future__ import annotations

import numpy as np

from mamba_train.interop import granite, hf_mamba2, mamba_ssm, nemotron_h
from mamba_train.interop.tables import Layout
from mamba_train.model.config import Mamba2Config
from mamba_train.model.params import KIND_PARAMS

# In the order `config_layout` asks them: transformers' Mamba2 (any config with
# hidden_size) after the model types that have one too.
LAYOUTS: dict[str, Layout] = {row.name: row for row in (
    nemotron_h.LAYOUT, granite.LAYOUT, mamba_ssm.LAYOUT, hf_mamba2.LAYOUT)}


def config_layout(outside: dict) -> str | None:
  """'mamba_ssm', 'hf', 'nemotron_h' or 'granite' for an outside config.json's contents, None
  for none of them."""
  return next((name for name, row in LAYOUTS.items() if row.recognizes(outside)), None)


def state_dict_to_params(sd: dict[str, np.ndarray], cfg: Mamba2Config, layout: str) -> dict:
  """Outside state dict (numpy arrays) -> our nested params. Strict about names and shapes."""
  row = LAYOUTS[layout]
  sd = row.from_files(sd, cfg)
  slots = row.slots(cfg)
  top = {v: k for k, v in row.top.items()}
  shapes = {kind: row.shapes[kind](cfg) for kind in set(cfg.pattern)}
  expected = {f"{prefix}{s}": shp for kind, prefix, _ in slots for s, shp in shapes[kind].items()}
  emb_name, norm_name, head_name = top["embedding"], top["norm_f"], top["lm_head"]
  expected[emb_name] = None  # rows checked below (may be padded)
  expected[norm_name] = (cfg.d_model,)
  tied_head = cfg.tie_embeddings
  if not tied_head:
    expected[head_name] = None
  names = set(sd)
  missing = sorted(set(expected) - names)
  # A tied lm_head may be stored (mamba_ssm writes a copy); anything else is unknown.
  unknown = sorted(names - set(expected) - ({head_name} if tied_head else set()))
  if missing or unknown:
    raise ValueError(f"State dict does not match a {layout} Mamba-2 with n_layer={cfg.n_layer}: "
                     f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                     f"unknown {unknown[:8]}{'...' if len(unknown) > 8 else ''}")
  bad = [f"{k}: {tuple(sd[k].shape)} != expected {shp}" for k, shp in expected.items()
         if shp is not None and tuple(sd[k].shape) != shp]
  v_pad, d = cfg.padded_vocab_size, cfg.d_model
  for name in [emb_name] + ([] if tied_head else [head_name]):
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
    params["lm_head"] = pad_rows(sd[head_name])
  return params


def params_to_state_dict(params: dict, cfg: Mamba2Config, layout: str, *,
                         vocab_rows: int | None = None) -> dict[str, np.ndarray]:
  """Our params -> an outside state dict (numpy). `vocab_rows` trims the embedding."""
  row = LAYOUTS[layout]
  rows = vocab_rows or cfg.padded_vocab_size
  top = {v: k for k, v in row.top.items()}
  sd = {top["embedding"]: np.asarray(params["embedding"])[:rows],
        top["norm_f"]: np.asarray(params["norm_f"])}
  slots = row.slots(cfg)
  stacks = {attr: {k: np.asarray(v) for k, v in params[attr].items()}
            for attr in {KIND_PARAMS[k] for k in cfg.pattern}}
  seen = dict.fromkeys(KIND_PARAMS, 0)
  for kind, prefix, table in slots:
    j, seen[kind] = seen[kind], seen[kind] + 1  # index among this kind's layers
    for suffix, (ours, codec) in table.items():
      sd[f"{prefix}{suffix}"] = np.ascontiguousarray(
          codec.to_outside(tuple(stacks[KIND_PARAMS[kind]][n][j] for n in ours), cfg))
  if not cfg.tie_embeddings or row.tied_head == "write":
    sd[top["lm_head"]] = np.asarray(params["embedding" if cfg.tie_embeddings else "lm_head"])[:rows]
  for alias, source in tied_aliases(cfg, layout).items():
    sd[alias] = sd[source]
  return row.to_files(sd)


def tied_aliases(cfg: Mamba2Config, layout: str) -> dict[str, str]:
  """{name: the name whose tensor it is}: outside names that hold another's tensor
  (mamba_ssm's state dict stores the tied LM head as the embedding itself)."""
  row = LAYOUTS[layout]
  if row.tied_head == "alias" and cfg.tie_embeddings:
    top = {v: k for k, v in row.top.items()}
    return {top["lm_head"]: top["embedding"]}
  return {}
