"""What a model's parameters are: the schema every layer kind's weights follow (names,
logical axes, shapes), how they are initialised, and the paths and shapes of a
parameter tree. What checkpoints, conversion, the run config and the AOT compile
import; it runs nothing.

Shapes: d d_model, i d_inner (= h * p), h heads, p headdim, g groups, n d_state,
k conv kernel, v vocabulary.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp

from mamba_train.model import attention as attn_lib, matmul as mm, moe as moe_lib
from mamba_train.model.config import ATTENTION, MAMBA, MLP, MOE, Mamba2Config

F32 = jnp.float32
Array = jax.Array

# The parameters of one block, with their logical axes (the stacked `layers`
# axis is prepended). The in_proj of mamba_ssm is stored split into z|x, B|C and
# dt so that tensor parallelism cuts whole heads and never mixes the pieces.
BLOCK_PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "norm": ("embed",),
    "in_proj_zx": ("embed", None, "inner"),  # (d, 2, i): z then x
    "in_proj_bc": ("embed", None, "state"),  # (d, 2, g*n): B then C
    "in_proj_dt": ("embed", "heads"),  # (d, h)
    "conv_x": ("conv", "inner"),  # (k, i)
    "conv_x_bias": ("inner",),
    "conv_bc": ("conv", None, "state"),  # (k, 2, g*n)
    "conv_bc_bias": (None, "state"),
    "dt_bias": ("heads",),
    "A_log": ("heads",),
    "D": ("heads",),
    "gate_norm": ("inner",),
    "out_proj": ("inner", "embed"),  # (i, d)
}


# The parameters each layer multiplies by in the compute dtype (its projections);
# every other parameter enters float32 math.
MATMUL_WEIGHTS = frozenset({"in_proj_zx", "in_proj_bc", "in_proj_dt", "out_proj", "q_proj", "k_proj",
                            "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"}) | moe_lib.MATMUL_WEIGHTS


# The key under which a layer's adapters travel beside its weights (`Mamba2LM._compute_params`).
ADAPTERS = mm.ADAPTERS


# Each layer kind: its name in `Mamba2LM.params()` and the keys of its decoding
# state. The Mamba-2 stack is `layers` in pure models and hybrids alike, so a pure
# model's parameters and checkpoints carry no hybrid-only name.
KIND_PARAMS = {MAMBA: "layers", ATTENTION: "attn", MLP: "mlp", MOE: "moe"}
# (A mixture-of-experts layer has no decoding state; over a sequence it returns
# its router statistics, moe.STATS, in the place of one.)
STATE_KEYS = {MAMBA: ("conv_x", "conv_bc", "ssm"), ATTENTION: ("k", "v", "kv_valid", "kv_pos"),
              MLP: (), MOE: ()}
# A windowed Mamba-2 layer (`Mamba2Config.ssd_window`) holds its last W positions'
# inputs instead of an SSM state (`ssd.ssd_window_step`).
WINDOW_KEYS = ("conv_x", "conv_bc", "win_x", "win_B", "win_a")


def state_keys(cfg: Mamba2Config, kind: str) -> tuple[str, ...]:
  """The keys of one layer's decoding state of `kind`."""
  return WINDOW_KEYS if kind == MAMBA and cfg.ssd_window else STATE_KEYS[kind]


def kind_axes(cfg: Mamba2Config, kind: str) -> dict[str, tuple[str | None, ...]]:
  """One layer's parameter names of `kind` and their logical axes."""
  if kind == MAMBA:
    return BLOCK_PARAM_AXES
  if kind == ATTENTION:
    return attn_lib.param_axes(attn_lib.attn_shapes(cfg), attn_lib.ATTN_PARAM_AXES)
  if kind == MOE:
    return moe_lib.param_axes(cfg)
  return attn_lib.param_axes(attn_lib.mlp_shapes(cfg), attn_lib.MLP_PARAM_AXES)


def weight_names(cfg: Mamba2Config) -> set[str]:
  """The names of every layer parameter the model has (what LoRA targets are matched to)."""
  return {name for kind in KIND_PARAMS if cfg.count(kind) for name in kind_axes(cfg, kind)}


def _block_uniform_shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
  d, i, h, gn, k = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.ngroups * cfg.d_state, cfg.d_conv
  return {"in_proj_zx": (d, 2, i), "in_proj_bc": (d, 2, gn), "in_proj_dt": (d, h),
          "conv_x": (k, i), "conv_x_bias": (i,), "conv_bc": (k, 2, gn), "conv_bc_bias": (2, gn),
          "out_proj": (i, d), "dt": (h,), "A": (h,)}


def init_block_params(cfg: Mamba2Config, u: Array) -> dict[str, Array]:
  """One block's parameters, initialised as mamba_ssm does, from a flat vector of
  uniform [0, 1) draws (see `init_params` for why the draws come in one piece)."""
  shapes = _block_uniform_shapes(cfg)
  sizes = [math.prod(s) for s in shapes.values()]
  pieces = jnp.split(u, list(itertools.accumulate(sizes))[:-1])
  parts = dict(zip(shapes, (c.reshape(s) for c, s in zip(pieces, shapes.values()))))
  sym = lambda name, bound: (2.0 * parts[name] - 1.0) * bound  # uniform(-bound, bound)
  lin = 1.0 / math.sqrt(cfg.d_model)  # torch nn.Linear default: kaiming_uniform(a=sqrt(5))
  conv = 1.0 / math.sqrt(cfg.d_conv)  # depthwise conv: fan_in = kernel size
  # dt log-uniform in [dt_min, dt_max], floored, stored through an inverse softplus.
  dt = jnp.exp(parts["dt"] * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min))
  dt = jnp.maximum(dt, cfg.dt_init_floor)
  lo, hi = cfg.A_init_range
  h, i, d = cfg.nheads, cfg.d_inner, cfg.d_model
  return {
      "norm": jnp.ones((d,), F32),
      "in_proj_zx": sym("in_proj_zx", lin),
      "in_proj_bc": sym("in_proj_bc", lin),
      "in_proj_dt": sym("in_proj_dt", lin),
      "conv_x": sym("conv_x", conv),
      "conv_x_bias": sym("conv_x_bias", conv),
      "conv_bc": sym("conv_bc", conv),
      "conv_bc_bias": sym("conv_bc_bias", conv),
      "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),
      "A_log": jnp.log(lo + (hi - lo) * parts["A"]),
      "D": jnp.ones((h,), F32),
      "gate_norm": jnp.ones((i,), F32),
      # mamba_ssm rescales out_proj by 1/sqrt(n_layer) (one residual per block).
      "out_proj": sym("out_proj", 1.0 / math.sqrt(i)) / math.sqrt(cfg.n_layer),
  }



@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: Mamba2Config, key) -> dict[str, Any]:
  # Two random draws in all, in one compiled program: XLA:CPU compiles each
  # threefry call slowly (seconds), so per-tensor draws made init take a minute.
  # (A hybrid's attention and MLP layers draw from keys folded off `key`, not from
  # `key_layers`: the Mamba-2 layers' draws then depend on the seed and their count
  # alone, the same in a pure model as in any pattern.)
  key_emb, key_layers = jax.random.split(key)
  v, d = cfg.padded_vocab_size, cfg.d_model
  n_emb = 1 if cfg.tie_embeddings else 2
  emb = 0.02 * jax.random.normal(key_emb, (n_emb, v, d), F32)
  out = {"embedding": emb[0], "norm_f": jnp.ones((d,), F32)}
  if cfg.count(MAMBA):
    per_layer = sum(math.prod(s) for s in _block_uniform_shapes(cfg).values())
    u = jax.random.uniform(key_layers, (cfg.count(MAMBA), per_layer), F32)
    out["layers"] = jax.vmap(lambda r: init_block_params(cfg, r))(u)
  for salt, kind, shapes, out_names in (
      (1, ATTENTION, attn_lib.attn_shapes(cfg), ("o_proj",)),
      (2, MLP, attn_lib.mlp_shapes(cfg), ("down_proj",))):
    if cfg.count(kind):
      u = jax.random.uniform(jax.random.fold_in(key, salt),
                             (cfg.count(kind), attn_lib.draws(shapes)), F32)
      out[KIND_PARAMS[kind]] = jax.vmap(lambda r: attn_lib.init_params(shapes, out_names, cfg, r))(u)
  if cfg.count(MOE):
    keys = jax.random.split(jax.random.fold_in(key, 3), cfg.count(MOE))
    out[KIND_PARAMS[MOE]] = jax.vmap(lambda k: moe_lib.init_params(cfg, k))(keys)
  if not cfg.tie_embeddings:
    out["lm_head"] = emb[1]
  return out


def unstack(tree, n: int) -> list:
  """[tree with every leaf's index i along axis 0, for i < n]: layer-stacked -> per layer."""
  return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(n)]



def param_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{'layers/A_log': shape, ...}: every array-like leaf of a parameter tree by its path."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): tuple(v.shape)
          for path, v in flat}


def shape_problems(wanted: dict[str, tuple], got: dict[str, tuple]) -> list[str]:
  """Every parameter whose shape in `got` differs from `wanted`, or that one side lacks."""
  msgs = []
  for name in sorted(set(wanted) | set(got)):
    w, g = wanted.get(name), got.get(name)
    if w is None:
      msgs.append(f"unexpected {name}")
    elif g is None:
      msgs.append(f"missing {name} (expected shape {w})")
    elif w != g:
      msgs.append(f"{name}: shape {g}, expected {w}")
  return msgs
