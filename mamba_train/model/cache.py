"""The decoding cache: the whole memory of a Mamba-2 model about its context.

Per layer it is the last d_conv-1 inputs of the two depthwise convolutions and
the SSM state (h, p, n); nothing grows with the number of tokens seen, which is
the point of a state-space model. The arrays are stacked over layers (leading
axis L) to match the scanned blocks, and are float32 whatever the compute dtype:
the state is a running product of decays and rounding it to bfloat16 every step
compounds over thousands of steps.

Shapes: L layers, b batch, k conv kernel, i d_inner, g groups, n d_state,
h heads, p headdim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mamba_train.model.config import Mamba2Config
from mamba_train.model.mamba2 import zero_state
from mamba_train.parallel import sharding

Array = jax.Array

# Logical axes, named like the activations they come from, so the cache is
# sharded by the same rules table: batch over data/fsdp, heads over tensor.
CACHE_AXES: dict[str, tuple[str | None, ...]] = {
    "conv_x": ("layers", "batch", None, "act_inner"),  # (L, b, k-1, i)
    "conv_bc": ("layers", "batch", None, None, None),  # (L, b, k-1, 2, g*n)
    "ssm": ("layers", "batch", "act_inner", None, None),  # (L, b, h, p, n)
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mamba2Cache:
  """Stacked per-layer recurrent state; a PyTree, so it passes through jit,
  lax.while_loop and buffer donation as three arrays."""

  conv_x: Array  # (L, b, k-1, i) float32: the last k-1 x inputs of the conv
  conv_bc: Array  # (L, b, k-1, 2, g*n) float32: the same for B and C
  ssm: Array  # (L, b, h, p, n) float32

  @classmethod
  def init(cls, cfg: Mamba2Config, batch: int) -> "Mamba2Cache":
    """The empty cache: the state before any token."""
    one = zero_state(cfg, batch)
    return cls(**{k: jnp.broadcast_to(v, (cfg.n_layer,) + v.shape) for k, v in one.items()})

  @classmethod
  def from_states(cls, states: dict[str, Array]) -> "Mamba2Cache":
    """From the stacked states dict that `Mamba2LM.backbone` / `step` use."""
    return cls(conv_x=states["conv_x"], conv_bc=states["conv_bc"], ssm=states["ssm"])

  def states(self) -> dict[str, Array]:
    """As the stacked states dict that `Mamba2LM.backbone` / `step` take."""
    return {"conv_x": self.conv_x, "conv_bc": self.conv_bc, "ssm": self.ssm}

  @property
  def nbytes(self) -> int:
    return sum(a.size * a.dtype.itemsize for a in (self.conv_x, self.conv_bc, self.ssm))

  @staticmethod
  def bytes_for(cfg: Mamba2Config, batch: int) -> int:
    """Cache size in bytes, computed from the config alone (no allocation).
    Independent of the context length."""
    shapes = jax.eval_shape(lambda: Mamba2Cache.init(cfg, batch))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))

  def constrain(self) -> "Mamba2Cache":
    """Pin the cache to the active mesh by the rules table (no-op without one)."""
    return Mamba2Cache(**{k: sharding.constrain(getattr(self, k), axes)
                          for k, axes in CACHE_AXES.items()})
