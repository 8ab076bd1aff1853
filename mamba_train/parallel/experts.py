"""Expert parallelism: a mixture-of-experts layer's experts split over the
'expert' mesh axis, tokens sent to them and back by all-to-all.

Under a mesh the routed experts run in `jax.shard_map`, each device on its own
tokens (its part of the batch, and of the length under a sequence split), so
no device sorts another's. Along the expert axis (n devices, E / n experts
each; Megatron-Core's and MaxText's layout, where the expert axis also splits
the batch like a data axis):

  1. each device sorts its t k (token, expert) assignments by expert, so they
     come grouped by the device that holds the expert, and packs them into a
     (n, C, w) buffer: up to C rows for each device;
  2. one all-to-all swaps the buffers: each device now holds, from every device,
     the rows for its own experts;
  3. it runs its experts on them as grouped matmuls (the math passed in:
     `moe.expert_mlp`, `jax.lax.ragged_dot`), rows sorted by local expert;
  4. a second all-to-all returns the rows, which are weighted and added onto
     their tokens.

C, the rows a device may send to one device, is t k: every assignment of a
device may go to one device, so no token is ever dropped (dropless, as the
one-device dispatch), at the price of buffers n times the assignments. (A
capacity below that, which drops assignments past it as GShard and Switch do, is
not built: it changes the function, and ragged_all_to_all, which sends only the
rows there are, is not lowered on CPU to test against.) With the tensor axis the
experts' hidden units are split too (each device's up-projection columns and
down-projection rows) and the rows summed over it after the down projection,
as Megatron's expert tensor parallelism; with fsdp the experts' weights are
gathered for the layer, as every FSDP weight is.

As the other modules of `parallel/`, this takes the math as a function and the
mesh axes, and imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

F32 = jnp.float32
Axes = str | tuple[str, ...] | None


def _names(axes: Axes) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
  """Tokens split over `tokens` (the mesh axes of the batch, then of the length),
  experts over `expert` (one mesh axis, or None), their hidden units over `hidden`."""
  mesh: Mesh
  batch: Axes
  length: Axes
  expert: str | None
  hidden: Axes

  def experts(self, mlp: Callable, x, experts, weights, up, down, cd):
    """sum_j weights[.., j] * expert_{experts[.., j]}(x) as `moe.experts_ragged`
    computes it, over the mesh. x (b, l, w) or (b, w) in the compute dtype `cd`;
    experts, weights (..., k); up (e, w, f), down (e, f, w). mlp(rows, up, down,
    sizes, cd) -> rows float32: the experts on rows sorted by expert.
    Returns y (..., w) float32."""
    n = self.mesh.shape[self.expert] if self.expert else 1
    e = up.shape[0]
    if e % n:
      raise ValueError(f"n_routed_experts ({e}) must divide over the 'expert' mesh axis ({n} devices)")
    lead = (self.batch, self.length)[:x.ndim - 1]
    tok = P(*lead, None)
    ex = self.expert
    hidden = self.hidden
    if hidden and up.shape[-1] % math.prod(self.mesh.shape[a] for a in _names(hidden)):
      hidden = None  # hidden units that do not divide over the tensor axis stay whole
    specs = (tok, tok, tok, P(ex, None, hidden), P(ex, hidden, None))

    def local(x, experts, weights, up, down):
      shape = x.shape
      x, experts, weights = (a.reshape(-1, a.shape[-1]) for a in (x, experts, weights))
      y = self._local(mlp, x, experts, weights, up, down, cd, n)
      if _names(hidden):
        y = jax.lax.psum(y, hidden)
      return y.reshape(shape[:-1] + y.shape[-1:])

    return jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=tok)(x, experts, weights, up, down)

  def _local(self, mlp, x, experts, weights, up, down, cd, n):
    t, k = experts.shape
    e_local = up.shape[0]
    cap = m = t * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    dest = sorted_e // e_local  # the device holding each assignment's expert
    start = jnp.searchsorted(dest, jnp.arange(n), side="left")  # first assignment to each device
    slot = dest * cap + jnp.arange(m) - start[dest]  # its row in the buffer for its device
    rows = jnp.zeros((n * cap, x.shape[-1]), cd).at[slot].set(jnp.take(x, order // k, axis=0).astype(cd))
    ids = jnp.full((n * cap,), e_local, jnp.int32).at[slot].set((sorted_e - dest * e_local).astype(jnp.int32))
    if n > 1:  # rows (and their local expert ids) to the devices of their experts
      rows = jax.lax.all_to_all(rows.reshape(n, cap, -1), self.expert, 0, 0, tiled=True).reshape(n * cap, -1)
      ids = jax.lax.all_to_all(ids.reshape(n, cap), self.expert, 0, 0, tiled=True).reshape(-1)
    # Empty slots carry id e_local: sorted last, past every group, they meet no expert.
    by_expert = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=e_local + 1)[:e_local].astype(jnp.int32)
    out = mlp(jnp.take(rows, by_expert, axis=0), up, down, sizes, cd)
    out = jnp.zeros_like(out).at[by_expert].set(out)
    if n > 1:  # and back to the devices of their tokens, in the order they were sent
      out = jax.lax.all_to_all(out.reshape(n, cap, -1), self.expert, 0, 0, tiled=True).reshape(n * cap, -1)
    got = jnp.take(out, slot, axis=0) * jnp.take(weights.reshape(-1), order)[:, None]
    return jnp.zeros((t, out.shape[-1]), F32).at[order // k].add(got)
