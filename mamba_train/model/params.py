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
from mamba_train.model.config import ATTENTION, MAMBA, MAMBA3, MLP, MOE, Mamba2Config

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
    # (i, d): its rows split over tensor x fsdp, so that fsdp gathers it on its major
    # axis (parallel/sharding.py, 'inner_fsdp'); the model dimension whole.
    "out_proj": ("inner_fsdp", None),
}


# A Mamba-3 layer's parameters (model/mamba3.py), named as mamba_ssm's Mamba3 names
# them, but for two, as the Mamba-2 layer's: its one in_proj is stored split so that
# tensor parallelism cuts whole heads (interop joins the pieces back in mamba_ssm's
# order [z, x, B, C, dd_dt, dd_A, trap, angles]), and `mixer.norm` (is_outproj_norm)
# is `gate_norm`, since `norm` is the block's pre-norm (mamba_ssm's block `norm`).
# R = mimo_rank (1 without is_mimo), A_n = num_rope_angles; B and C are "(r g n)".
MAMBA3_PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "norm": ("embed",),
    "in_proj_zx": ("embed", None, "inner"),  # (d, 2, i): z then x
    "in_proj_bc": ("embed", None, "state"),  # (d, 2, R*g*n): B then C
    "in_proj_heads": ("embed", None, "heads"),  # (d, 3, h): dd_dt, dd_A, trap
    "in_proj_angles": ("embed", None),  # (d, A_n): shared by the heads
    "dt_bias": ("heads",),
    "B_norm": ("state",),  # (n,)
    "C_norm": ("state",),
    "B_bias": ("heads", None, "state"),  # (h, R, n)
    "C_bias": ("heads", None, "state"),
    "mimo_x": ("heads", None, None),  # (h, R, p), is_mimo only
    "mimo_z": ("heads", None, None),
    "mimo_o": ("heads", None, None),
    "D": ("heads",),
    "gate_norm": ("inner",),  # (i,), is_outproj_norm only
    "out_proj": ("inner", "embed"),  # (i, d)
}
MAMBA3_MIMO_ONLY = ("mimo_x", "mimo_z", "mimo_o")
MAMBA3_NORM_ONLY = ("gate_norm",)


def mamba3_axes(cfg: Mamba2Config) -> dict[str, tuple[str | None, ...]]:
  """A Mamba-3 layer's parameter names and logical axes for `cfg` (the MIMO
  projections with is_mimo, the output norm with is_outproj_norm)."""
  skip = (() if cfg.is_mimo else MAMBA3_MIMO_ONLY) + (() if cfg.is_outproj_norm else MAMBA3_NORM_ONLY)
  return {k: v for k, v in MAMBA3_PARAM_AXES.items() if k not in skip}


def mamba3_shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
  """A Mamba-3 layer's parameter shapes (`mamba3_axes`' names)."""
  d, i, h, p, n, R = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.headdim, cfg.d_state, cfg.mamba3_rank
  shapes = {"norm": (d,), "in_proj_zx": (d, 2, i), "in_proj_bc": (d, 2, R * cfg.ngroups * n),
            "in_proj_heads": (d, 3, h), "in_proj_angles": (d, cfg.num_rope_angles), "dt_bias": (h,),
            "B_norm": (n,), "C_norm": (n,), "B_bias": (h, R, n), "C_bias": (h, R, n),
            "mimo_x": (h, R, p), "mimo_z": (h, R, p), "mimo_o": (h, R, p), "D": (h,), "gate_norm": (i,),
            "out_proj": (i, d)}
  return {k: shapes[k] for k in mamba3_axes(cfg)}


# The uniform draws of one Mamba-3 layer: its matmul weights and dt.
_M3_DRAWS = ("in_proj_zx", "in_proj_bc", "in_proj_heads", "in_proj_angles", "out_proj")


def init_mamba3_params(cfg: Mamba2Config, u: Array) -> dict[str, Array]:
  """One Mamba-3 layer's parameters, initialised as mamba_ssm's Mamba3 inside its
  MambaLMHeadModel: in_proj torch's nn.Linear default (uniform +-1/sqrt(d_model)),
  out_proj the same then scaled by 1/sqrt(n_layer) (`_init_weights`); dt_bias the
  inverse softplus of a log-uniform dt in [dt_min, dt_max] floored at dt_init_floor;
  B_bias, C_bias, the norms' weights and D ones; mimo_x and mimo_o 1/R, mimo_z ones.
  u: a flat vector of uniform [0, 1) draws (`init_params`)."""
  shapes = mamba3_shapes(cfg)
  draw = {k: shapes[k] for k in _M3_DRAWS} | {"dt": (cfg.nheads,)}
  pieces = jnp.split(u, list(itertools.accumulate(math.prod(s) for s in draw.values()))[:-1])
  parts = {k: c.reshape(s) for (k, s), c in zip(draw.items(), pieces)}
  lin = lambda k, fan_in: (2.0 * parts[k] - 1.0) / math.sqrt(fan_in)
  dt = jnp.exp(parts["dt"] * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min))
  dt = jnp.maximum(dt, cfg.dt_init_floor)
  R = cfg.mamba3_rank
  out = {k: lin(k, cfg.d_model) for k in _M3_DRAWS[:-1]}
  out.update(
      norm=jnp.ones(shapes["norm"], F32), dt_bias=dt + jnp.log(-jnp.expm1(-dt)),
      B_norm=jnp.ones(shapes["B_norm"], F32), C_norm=jnp.ones(shapes["C_norm"], F32),
      B_bias=jnp.ones(shapes["B_bias"], F32), C_bias=jnp.ones(shapes["C_bias"], F32),
      D=jnp.ones(shapes["D"], F32),
      out_proj=lin("out_proj", cfg.d_inner) / math.sqrt(cfg.n_layer))
  if cfg.is_mimo:
    out.update(mimo_x=jnp.full(shapes["mimo_x"], 1.0 / R, F32), mimo_z=jnp.ones(shapes["mimo_z"], F32),
               mimo_o=jnp.full(shapes["mimo_o"], 1.0 / R, F32))
  if cfg.is_outproj_norm:
    out["gate_norm"] = jnp.ones(shapes["gate_norm"], F32)
  return {k: out[k] for k in shapes}


def _mamba3_draws(cfg: Mamba2Config) -> int:
  shapes = mamba3_shapes(cfg)
  return sum(math.prod(shapes[k]) for k in _M3_DRAWS) + cfg.nheads


# The parameters each layer multiplies by in the compute dtype (its projections);
# every other parameter enters float32 math.
MATMUL_WEIGHTS = frozenset({"in_proj_zx", "in_proj_bc", "in_proj_dt", "in_proj_heads", "in_proj_angles", "out_proj",
                            "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj",
                            "down_proj"}) | moe_lib.MATMUL_WEIGHTS


# The key under which a layer's adapters travel beside its weights (`Mamba2LM._compute_params`).
ADAPTERS = mm.ADAPTERS


# Each layer kind: its name in `Mamba2LM.params()` and the keys of its decoding
# state. The Mamba-2 stack is `layers` in pure models and hybrids alike, so a pure
# model's parameters and checkpoints carry no hybrid-only name.
KIND_PARAMS = {MAMBA: "layers", ATTENTION: "attn", MLP: "mlp", MOE: "moe", MAMBA3: "mamba3"}
# (A mixture-of-experts layer has no decoding state; over a sequence it returns
# its router statistics, moe.STATS, in the place of one.)
# A Mamba-3 layer's: its rotary angle (b, h, A_n), SSM state (b, h, p, n), and the
# last position's rotated k (b, R, h, n) and x (b, h, p) (mamba_ssm's angle_dt_state,
# ssm_state, k_state, v_state).
STATE_KEYS = {MAMBA: ("conv_x", "conv_bc", "ssm"), ATTENTION: ("k", "v", "kv_valid", "kv_pos"),
              MLP: (), MOE: (), MAMBA3: ("m3_angle", "m3_ssm", "m3_k", "m3_v")}
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
  if kind == MAMBA3:
    return mamba3_axes(cfg)
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
  if cfg.count(MAMBA3):
    u = jax.random.uniform(jax.random.fold_in(key, 4), (cfg.count(MAMBA3), _mamba3_draws(cfg)), F32)
    out[KIND_PARAMS[MAMBA3]] = jax.vmap(lambda r: init_mamba3_params(cfg, r))(u)
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
