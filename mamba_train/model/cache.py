"""The decoding cache: the whole memory of a Mamba-2 model about its context.

Per Mamba-2 layer it is the last d_conv-1 inputs of the two depthwise
convolutions and the SSM state (h, p, n); nothing grows with the number of
tokens seen, which is the point of a state-space model. Per Mamba-3 layer it is the
rotary angle, the SSM state, and the last position's rotated key and input (the
trapezoid's carried term); nothing grows either. The arrays are stacked
over layers (leading axis L) to match the scanned blocks, and are float32
whatever the compute dtype: the state is a running product of decays and
rounding it to bfloat16 every step compounds over thousands of steps.

A hybrid's attention layers add a fixed-size key/value buffer each (leading
axis A, the attention layers): `capacity` positions chosen when decoding starts
(prompt plus new tokens), which positions hold a valid key (left padding does
not), and where the next one goes. Its size grows with the capacity; the rest
does not. MLP layers hold nothing.

A windowed model (`Mamba2Config.ssd_window` = W) is the exception among Mamba-2
layers: each holds its last W positions' inputs (dt*x, B, dt*A) in place of the
SSM state, O(W) per layer like a sliding-window attention layer's keys and values
(`window_bytes_per_position`), because a position leaving the window must leave
the output exactly and a state cannot forget it without a subtraction.

Shapes: L Mamba-2 layers, M Mamba-3 layers, A attention layers, b batch, k conv kernel,
i d_inner, g groups, n d_state, h heads, p headdim, R MIMO rank, a rotary angles, S capacity, kv key/value
heads, e attention head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mamba_train.model import attention as attn_lib, mamba3
from mamba_train.model.config import ATTENTION, MAMBA, MAMBA3, Mamba2Config
from mamba_train.model.mamba2 import zero_state
from mamba_train.parallel import sharding

Array = jax.Array

# Logical axes, named like the activations they come from, so the cache is
# sharded by the same rules table: batch over data/fsdp, heads over tensor.
CACHE_AXES: dict[str, tuple[str | None, ...]] = {
    "conv_x": ("layers", "batch", None, "act_inner"),  # (L, b, k-1, i)
    "conv_bc": ("layers", "batch", None, None, None),  # (L, b, k-1, 2, g*n)
    "ssm": ("layers", "batch", "act_inner", None, None),  # (L, b, h, p, n)
    "win_x": ("layers", "batch", None, "act_inner", None),  # (L, b, W, h, p)
    "win_B": ("layers", "batch", None, None, None),  # (L, b, W, g, n)
    "win_a": ("layers", "batch", None, "act_inner"),  # (L, b, W, h)
    "k": ("layers", "batch", None, "act_kv_heads", None),  # (A, b, S, kv, e)
    "v": ("layers", "batch", None, "act_kv_heads", None),  # (A, b, S, kv, e)
    "kv_valid": ("layers", "batch", None),  # (A, b, S)
    "kv_pos": ("layers",),  # (A,)
    "m3_angle": ("layers", "batch", "act_inner", None),  # (M, b, h, a)
    "m3_ssm": ("layers", "batch", "act_inner", None, None),  # (M, b, h, p, n)
    "m3_k": ("layers", "batch", None, "act_inner", None),  # (M, b, R, h, n)
    "m3_v": ("layers", "batch", "act_inner", None),  # (M, b, h, p)
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mamba2Cache:
  """Stacked per-layer decoding state; a PyTree, so it passes through jit,
  lax.while_loop and buffer donation as its arrays. A kind the model lacks
  leaves its fields None."""

  conv_x: Array | None  # (L, b, k-1, i) float32: the last k-1 x inputs of the conv
  conv_bc: Array | None  # (L, b, k-1, 2, g*n) float32: the same for B and C
  ssm: Array | None  # (L, b, h, p, n) float32
  win_x: Array | None = None  # (L, b, W, h, p) float32, windowed layers: dt*x of the last W
  win_B: Array | None = None  # (L, b, W, g, n) float32: their B
  win_a: Array | None = None  # (L, b, W, h) float32: their log decays dt*A
  k: Array | None = None  # (A, b, S, kv, e) float32: keys, rotary applied
  v: Array | None = None  # (A, b, S, kv, e) float32
  kv_valid: Array | None = None  # (A, b, S) bool: positions holding a key
  kv_pos: Array | None = None  # (A,) int32: where the next key goes
  m3_angle: Array | None = None  # (M, b, h, a) float32, Mamba-3 layers: the rotary angle
  m3_ssm: Array | None = None  # (M, b, h, p, n) float32: the SSM state
  m3_k: Array | None = None  # (M, b, R, h, n) float32: the last position's rotated key
  m3_v: Array | None = None  # (M, b, h, p) float32: the last position's x

  @classmethod
  def init(cls, cfg: Mamba2Config, batch: int, capacity: int = 0) -> "Mamba2Cache":
    """The empty cache: the state before any token, with room for `capacity`
    positions in each attention layer."""
    out = {}
    for kind, one in ((MAMBA, lambda: zero_state(cfg, batch)), (MAMBA3, lambda: mamba3.zero_state(cfg, batch)),
                      (ATTENTION, lambda: attn_lib.empty_kv(cfg, batch, capacity))):
      if cfg.count(kind):
        out.update({k: jnp.broadcast_to(v, (cfg.count(kind),) + v.shape) for k, v in one().items()})
    return cls(**{k: out.get(k) for k in CACHE_AXES})

  @classmethod
  def from_states(cls, states: dict[str, Array]) -> "Mamba2Cache":
    """From the stacked states dict that `Mamba2LM.step` uses."""
    return cls(**{k: states.get(k) for k in CACHE_AXES})

  @classmethod
  def from_prefill(cls, states: dict[str, Array], capacity: int, mask=None) -> "Mamba2Cache":
    """From what `Mamba2LM.backbone` returns after a prompt of l positions: the
    attention layers' keys and values go into buffers of `capacity` (>= l)
    positions, where mask (b, l) (False on padding) says which are valid."""
    states = dict(states)
    if "k" in states:
      kv = jax.vmap(lambda k, v: attn_lib.kv_from_prefill({"k": k, "v": v}, capacity, mask))(
          states.pop("k"), states.pop("v"))
      states.update(kv)
    return cls.from_states(states)

  def states(self) -> dict[str, Array]:
    """As the stacked states dict that `Mamba2LM.step` takes."""
    return {k: getattr(self, k) for k in CACHE_AXES if getattr(self, k) is not None}

  @property
  def nbytes(self) -> int:
    return sum(a.size * a.dtype.itemsize for a in self.states().values())

  @staticmethod
  def bytes_for(cfg: Mamba2Config, batch: int, capacity: int = 0) -> int:
    """Cache size in bytes, computed from the config alone (no allocation).
    Independent of the context length for a pure Mamba-2 model; a hybrid's grows
    by `bytes_per_position` with the capacity, a windowed model's holds W positions
    (`window_bytes_per_position` each) whatever the context."""
    shapes = jax.eval_shape(lambda: Mamba2Cache.init(cfg, batch, capacity))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))

  @staticmethod
  def bytes_per_position(cfg: Mamba2Config, batch: int) -> int:
    """What one more position of capacity costs: keys and values of every
    attention layer (float32) and the valid flag."""
    return Mamba2Cache.bytes_for(cfg, batch, 1) - Mamba2Cache.bytes_for(cfg, batch, 0)

  @staticmethod
  def window_bytes_per_position(cfg: Mamba2Config, batch: int) -> int:
    """What one position of a windowed model's window costs (0 for the exact
    model): dt*x, B and dt*A of every Mamba-2 layer, float32."""
    if not cfg.ssd_window:
      return 0
    per = cfg.nheads * cfg.headdim + cfg.ngroups * cfg.d_state + cfg.nheads
    return cfg.count(MAMBA) * batch * 4 * per

  def repeat(self, n: int) -> "Mamba2Cache":
    """Each row n times along the batch axis, in place (row r of the result is row
    r // n): one prefilled prompt's state copied for n samples of it (GRPO's group),
    pinned to the active mesh again. Exact: copies, no arithmetic."""
    def rows(x, axes):
      return x if x is None or "batch" not in axes else jnp.repeat(x, n, axis=axes.index("batch"))
    return Mamba2Cache(**{k: rows(getattr(self, k), axes) for k, axes in CACHE_AXES.items()}).constrain()

  def constrain(self) -> "Mamba2Cache":
    """Pin the cache to the active mesh by the rules table (no-op without one)."""
    return Mamba2Cache(**{k: None if getattr(self, k) is None else
                          sharding.constrain(getattr(self, k), axes)
                          for k, axes in CACHE_AXES.items()})
