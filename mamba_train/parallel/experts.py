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
     `Ops.expert_mlp`, by default `jax.lax.ragged_dot`), rows sorted by local expert;
  4. a second all-to-all returns the rows, which are weighted and added onto
     their tokens.

C, the rows a device may send to one device, is t k without a capacity: every
assignment of a device may go to one device, so no token is ever dropped
(dropless, as the one-device dispatch), at the price of buffers n times the
assignments. With a capacity (`cap`, per sequence and expert, and the rule that
says which assignments it keeps, `moe.within_capacity`) a device keeps at most
cap of each of its rows' assignments to an expert, so C = e_local * rows * min(cap,
tokens a row): about the capacity factor times the assignments in all, not n
times. Under a sequence split each device counts after what the devices before
it in the sequence took (a (rows, E) all-gather over the length axes), so the
assignments kept are those of one device. (`jax.lax.ragged_all_to_all`, which
sends only the rows there are, is in jax 0.10.2 but has no CPU lowering to test
it against the one-device result, so it is not used.) With the tensor axis the
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

  def experts(self, mlp: Callable, x, experts, weights, up, down, cd, cap=None, within=None,
              check_vma: bool = True, mark: Callable = lambda a: a, count: Callable | None = None):
    """sum_j weights[.., j] * expert_{experts[.., j]}(x) as `moe.experts_ragged`
    computes it, over the mesh. x (b, l, w) or (b, w) in the compute dtype `cd`;
    experts, weights (..., k); up (e, w, f) or a tuple of such (a gate and up),
    down (e, f, w). mlp(rows, up, down,
    sizes, cd) -> rows float32 or `cd`: the experts on rows sorted by expert. cap: the
    assignments an expert takes from one sequence (None: dropless), and
    within(experts (b, l, k), cap, before (b, E)) -> keep (b, l, k) the rule.
    check_vma: False where mlp runs a Pallas kernel (megablox), whose outputs carry
    no varying-axes type; shard_map then psums the replicated weights' gradients
    over the axes they are not split on, as check_vma's types would.
    mark(a) -> a: applied to each integer result of the dispatch (which assignments
    are kept, the sort orders, the buffer slots, the group sizes): the model names
    them for its remat policy to save. count(ids, n) -> (n,) int32: how many ids
    equal each of 0..n-1 (default jnp.bincount; the model passes one that compiles
    to less TPU program).
    Returns y (..., w) float32 and keep (..., k) bool (None when dropless)."""
    n = self.mesh.shape[self.expert] if self.expert else 1
    e = down.shape[0]
    if e % n:
      raise ValueError(f"n_routed_experts ({e}) must divide over the 'expert' mesh axis ({n} devices)")
    lead = (self.batch, self.length)[:x.ndim - 1]
    tok = P(*lead, None)
    ex = self.expert
    hidden = self.hidden
    if hidden and down.shape[1] % math.prod(self.mesh.shape[a] for a in _names(hidden)):
      hidden = None  # hidden units that do not divide over the tensor axis stay whole
    # up: one (e, w, f) array, or a tuple of them (swiglu's gate and up), split alike.
    specs = (tok, tok, tok, jax.tree.map(lambda _: P(ex, None, hidden), up), P(ex, hidden, None))
    capped = cap is not None and x.ndim == 3

    def local(x, experts, weights, up, down):
      shape = x.shape
      keep = mark(self._keep(experts, cap, within, e)) if capped else None
      x, experts, weights = (a.reshape(-1, a.shape[-1]) for a in (x, experts, weights))
      y = self._local(mlp, x, experts, weights, up, down, cd, n,
                      None if keep is None else keep.reshape(experts.shape), shape[:-1], cap, mark, count)
      if _names(hidden):
        y = jax.lax.psum(y, hidden)
      y = y.reshape(shape[:-1] + y.shape[-1:])
      return (y, keep) if capped else y

    out_specs = (tok, tok) if capped else tok
    out = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=out_specs,
                        check_vma=check_vma)(x, experts, weights, up, down)
    return out if capped else (out, None)

  def _keep(self, experts, cap, within, e):
    """This device's rows' assignments within capacity (b, l, k), counted after the
    assignments the devices before it along the sequence took from the same rows."""
    before = None
    seq = _names(self.length)
    if seq and math.prod(self.mesh.shape[a] for a in seq) > 1:
      b = experts.shape[0]
      mine = jnp.zeros((b, e), jnp.int32).at[jnp.arange(b)[:, None], experts.reshape(b, -1)].add(1)
      every = jax.lax.all_gather(mine, seq)  # (devices along the sequence, b, E)
      me = jax.lax.axis_index(seq)
      before = jnp.sum(jnp.where((jnp.arange(every.shape[0]) < me)[:, None, None], every, 0), axis=0)
    return within(experts, cap, before)

  def _local(self, mlp, x, experts, weights, up, down, cd, n, keep=None, lead=(), seq_cap=None,
             mark: Callable = lambda a: a, count: Callable | None = None):
    t, k = experts.shape
    e_local = down.shape[0]
    m = t * k
    cap = m
    if keep is not None:  # kept: at most min(capacity, tokens a row) per row and expert
      cap = min(m, e_local * lead[0] * min(seq_cap, lead[1]))
    flat = experts.reshape(-1)
    if keep is not None:
      flat = jnp.where(keep.reshape(-1), flat, n * e_local)  # dropped: past every device
    order = mark(jnp.argsort(flat, stable=True))
    sorted_e = flat[order]
    dest = sorted_e // e_local  # the device holding each assignment's expert (n: dropped)
    start = jnp.searchsorted(dest, jnp.arange(n), side="left")  # first assignment to each device
    slot = dest * cap + jnp.arange(m) - start[jnp.minimum(dest, n - 1)]  # its row in the buffer
    # dropped: out of range (each its own row past the buffer), never written or read
    slot = mark(jnp.where(dest < n, slot, n * cap + jnp.arange(m)))
    # slot never decreases along the sorted assignments (by device, then in turn; the
    # dropped last): said to XLA, whose TPU scatter then needs no sort of its indices
    # (each a large piece of program; docs/bench/compile_depth.md), nor does the
    # scatter-add that is the gradient of the gather by slot below. And no two are
    # equal: said to JAX, whose derivative of a scatter that may overwrite is
    # otherwise a second scatter of u32 ids the size of the buffer, a compare and a
    # masked scatter-add, forward and in the recompute (3.3 GB of an MoE layer's
    # traffic on h100-8: docs/bench/moe.md, "One MoE layer's bytes").
    rows = jnp.zeros((n * cap, x.shape[-1]), cd).at[slot].set(
        jnp.take(x, order // k, axis=0).astype(cd), mode="drop", indices_are_sorted=True, unique_indices=True)
    ids = jnp.full((n * cap,), e_local, jnp.int32).at[slot].set(
        (sorted_e - dest * e_local).astype(jnp.int32), mode="drop", indices_are_sorted=True, unique_indices=True)
    if n > 1:  # rows (and their local expert ids) to the devices of their experts
      rows = jax.lax.all_to_all(rows.reshape(n, cap, -1), self.expert, 0, 0, tiled=True).reshape(n * cap, -1)
      ids = jax.lax.all_to_all(ids.reshape(n, cap), self.expert, 0, 0, tiled=True).reshape(-1)
    # Empty slots carry id e_local: sorted last, past every group, they meet no expert.
    by_expert = mark(jnp.argsort(ids, stable=True))
    count = count or (lambda a, m: jnp.bincount(a, length=m + 1)[:m].astype(jnp.int32))
    sizes = mark(count(ids, e_local))  # empty slots (id e_local) count nowhere
    # The rows come back in the dtype mlp gives them (the compute dtype for tokamax's
    # kernels) and stay in it to the weighted sum, which widens them to float32.
    out = mlp(jnp.take(rows, by_expert, axis=0), up, down, sizes, cd)
    out = jnp.zeros_like(out).at[by_expert].set(out, unique_indices=True)  # by_expert: a permutation
    if n > 1:  # and back to the devices of their tokens, in the order they were sent
      out = jax.lax.all_to_all(out.reshape(n, cap, -1), self.expert, 0, 0, tiled=True).reshape(n * cap, -1)
    got = (jnp.take(out, slot, axis=0, mode="fill", fill_value=0, indices_are_sorted=True)
           * jnp.take(weights.reshape(-1), order)[:, None])
    return jnp.zeros((t, out.shape[-1]), F32).at[order // k].add(got)
