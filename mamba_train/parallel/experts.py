"""Expert parallelism: a mixture-of-experts layer's experts split over the
'expert' mesh axis, tokens sent to them and back by all-to-all.

Under a mesh the routed experts run in `jax.shard_map`, each device on its own
tokens (its part of the batch, and of the length under a sequence split), so
no device lays out another's. Along the expert axis (n devices, E / n experts
each; Megatron-Core's and MaxText's layout, where the expert axis also splits
the batch like a data axis):

  1. each device lays its t k (token, expert) assignments out by expert (the
     order a stable sort would give, from running counts: no sort), so they
     come grouped by the device that holds the expert, in a (n, C, w) buffer:
     up to C rows for each device;
  2. one all-to-all swaps the buffers: each device now holds, from every device,
     the rows for its own experts;
  3. it runs its experts on them as grouped matmuls (the math passed in:
     `Ops.expert_mlp`, by default `jax.lax.ragged_dot`), rows grouped by local expert;
  4. a second all-to-all returns the rows, which are weighted and added onto
     their tokens.

C, the rows a device may send to one device, is t k without a capacity: every
assignment of a device may go to one device, so no token is ever dropped
(dropless, as the one-device dispatch), at the price of buffers n times the
assignments. With a capacity (`cap`, per sequence and expert, and the rule that
says which assignments it keeps, `moe.within_capacity`) a device keeps at most
cap of each of its rows' assignments to an expert, so C = e_local * rows * min(cap,
tokens a row): about the capacity factor times the assignments in all, not n
times. That bound is reached (a row's cap for each expert of a device can all come
from one part of the row), so under a sequence split over s devices a device
that sent only its own part of each row would need the whole row's C: s times the
capacity factor times its assignments (2.5x at cf 1.25 and s 2). Instead the s
devices of a row pool it (`_pooled`): each gathers the row's tokens and routing
along the sequence axes, all count the row's capacity alike, and each sends its
1/s share of every destination's C-row block (the same rows in the same order on
each: C / s rows a destination); the rows come back to the device that sent them,
and a reduce-scatter along the sequence gives each device its own tokens' sums.
The assignments kept, and so the function, are those of one device. Dropless,
each device sends its own part (C = its t k; pooling would not shrink it).
(`jax.lax.ragged_all_to_all`, which sends only the rows there are, is in jax
0.10.2 but has no CPU lowering to test it against the one-device result, so it is
not used.) With the tensor axis the experts' hidden units are split too (each
device's up-projection columns and down-projection rows) and the rows summed over
it after the down projection, as Megatron's expert tensor parallelism; with fsdp
the experts' weights are gathered for the layer, as every FSDP weight is.

As the other modules of `parallel/`, this takes the math as a function and the
mesh axes; the rows' layout and moves are `ops/dispatch.py`'s (gathers both ways).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from mamba_train.ops.dispatch import assignment_slots, by_choice, combine, group_by_expert, take_rows

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
    sizes, cd) -> rows float32 or `cd`: the experts on rows grouped by expert. cap: the
    assignments an expert takes from one sequence (None: dropless), and
    within(experts (b, l, k), cap, None) -> keep (b, l, k) the rule, on whole rows.
    check_vma: False where mlp runs a Pallas kernel (megablox), whose outputs carry
    no varying-axes type; shard_map then psums the replicated weights' gradients
    over the axes they are not split on, as check_vma's types would.
    mark(a) -> a: applied to each integer result of the dispatch (which assignments
    are kept, the buffer slots and their inverses, the group sizes): the model names
    them for its remat policy to save. count(ids, n) -> (n,) int32: how many ids
    equal each of 0..n-1 (default a compare and a sum).
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
    seq = _names(self.length) if capped else ()
    parts = math.prod(self.mesh.shape[a] for a in seq) if seq else 1

    split = bool(_names(hidden))

    def local(x, experts, weights, up, down):
      if parts > 1:
        y, keep = self._pooled(mlp, x, experts, weights, up, down, cd, n, cap, within, seq, parts, mark, count,
                               split)
      else:
        shape = x.shape
        keep = mark(within(experts, cap, None)) if capped else None
        x, experts, weights = (a.reshape(-1, a.shape[-1]) for a in (x, experts, weights))
        y = self._local(mlp, x, experts, weights, up, down, cd, n,
                        None if keep is None else keep.reshape(experts.shape), shape[:-1], cap, mark, count,
                        split_hidden=split)
        y = y.reshape(shape[:-1] + y.shape[-1:])
      if _names(hidden):
        y = jax.lax.psum(y, hidden)
      return (y, keep) if capped else y

    out_specs = (tok, tok) if capped else tok
    out = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=out_specs,
                        check_vma=check_vma)(x, experts, weights, up, down)
    return out if capped else (out, None)

  def _pooled(self, mlp, x, experts, weights, up, down, cd, n, cap, within, seq, parts, mark, count,
              split_hidden=False):
    """A capacity under a sequence split over `parts` devices: the devices of a row
    pool it (the module's docstring). x (b, l, w), experts and weights (b, l, k): this
    device's part of its rows. Returns y (b, l, w) float32 and keep (b, l, k)."""
    b, l, _ = x.shape
    whole = lambda a: jax.lax.all_gather(a, seq, axis=1, tiled=True)  # (b, parts l, ...), in row order
    x, experts, weights = whole(x), whole(experts), whole(weights)
    keep = mark(within(experts, cap, None))  # the rows' capacity, counted alike on each device
    me = jax.lax.axis_index(seq)
    k = experts.shape[-1]
    y = self._local(mlp, x.reshape(-1, x.shape[-1]), experts.reshape(-1, k), weights.reshape(-1, k), up, down,
                    cd, n, keep.reshape(-1, k), (b, parts * l), cap, mark, count, part=(me, parts),
                    split_hidden=split_hidden)
    # each assignment was sent by one device of the row: their sums add up to the row's
    y = jax.lax.psum_scatter(y.reshape(b, parts * l, -1), seq, scatter_dimension=1, tiled=True)
    return y, jax.lax.dynamic_slice_in_dim(keep, me * l, l, axis=1)

  def _local(self, mlp, x, experts, weights, up, down, cd, n, keep=None, lead=(), seq_cap=None,
             mark: Callable = lambda a: a, count: Callable | None = None, part=(0, 1),
             split_hidden: bool = False):
    """The dispatch of t tokens' assignments, their experts and back. part (i, parts):
    this device sends the i-th of `parts` equal shares of each destination's block
    (`_pooled`); the rows of the other shares come back zero. split_hidden: the experts'
    hidden units are split (the rows come back as partial sums)."""
    t, k = experts.shape
    e_local = down.shape[0]
    m = t * k
    cap = m
    if keep is not None:  # kept: at most min(capacity, tokens a row) per row and expert
      cap = min(m, e_local * lead[0] * min(seq_cap, lead[1]))
    flat = experts.reshape(-1)
    if keep is not None:
      flat = jnp.where(keep.reshape(-1), flat, n * e_local)  # dropped: past every device
    # Each assignment's row in the (n, cap) send buffer (by device, then expert, then
    # token order: what a stable sort by expert gives) and each row's assignment, and
    # the row's expert on its device; no sort (docs/bench/compile_depth.md).
    i, parts = part
    # A whole number of bfloat16's 16-row tiles a destination: XLA:TPU lays the exchanged
    # buffers out as (n, share, w), a copy each way where share is not (the Nano recipe's
    # share of 60 at expert 128 on v6e-256; docs/bench/moe.md); the extra rows are empty.
    share = -(-cap // (parts * 16)) * 16
    slot, src, ids = assignment_slots(flat, n, e_local, share * parts)
    if parts > 1:  # this device's share of each block: rows i share .. (i + 1) share
      row, lo = slot % (share * parts), i * share
      mine = (slot < n * share * parts) & (row >= lo) & (row < lo + share)
      slot = jnp.where(mine, (slot // (share * parts)) * share + row - lo, n * share)
      src, ids = (jax.lax.dynamic_slice_in_dim(a.reshape(n, -1), lo, share, axis=1).reshape(-1) for a in (src, ids))
    cap = share
    slot, src, ids = (mark(a) for a in (slot, src, ids))
    # Rows no one reads are left as the gathers give them, not zeroed (a pass each over the
    # buffer on TPUs: `take_rows`): the send buffer's empty rows (the grouping reads only
    # rows with an expert) and their gradients, the returned buffer's empty rows (the
    # weighted sum reads only kept assignments) and their gradients. The rows the experts'
    # kernels get past their groups, and a dropped or other-share assignment's row (and
    # gradient) in the weighted sum, stay zero.
    rows = take_rows(x.astype(cd), src, slot, k, zero=False)
    if n > 1:  # rows (and their local expert ids) to the devices of their experts
      rows = jax.lax.all_to_all(rows, self.expert, 0, 0, tiled=True)
      ids = jax.lax.all_to_all(ids, self.expert, 0, 0, tiled=True)
    # Rows grouped by local expert for the grouped matmuls, and back, by gathers. The
    # rows come back in the dtype mlp gives them (the compute dtype for tokamax's
    # kernels) and stay in it to the weighted sum, which widens them to float32.
    pos, by_expert, sizes = (mark(a) for a in group_by_expert(ids, n, e_local, count))
    out = mlp(take_rows(rows, by_expert, pos, zero_grad=False), up, down, sizes, cd)
    out = take_rows(out, pos, by_expert, zero=False)
    if n > 1:  # and back to the devices of their tokens, in the order they were sent
      out = jax.lax.all_to_all(out, self.expert, 0, 0, tiled=True)
    # each assignment's row (dropped ones zero), weighted and summed onto its token. With
    # the hidden units split the rows are partial sums (varying over those axes, the
    # weights not): autodiff's form, whose transpose sums the weights' gradient over them.
    got = take_rows(out, *by_choice(slot, src, k), zero_grad=False).reshape(k, t, -1)  # choice-major
    if split_hidden:
      return jnp.sum(got * weights.T[..., None], axis=0)
    return combine(got, weights.T.astype(F32))
