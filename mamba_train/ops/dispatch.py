"""The dispatch of a mixture-of-experts layer without a sort: where each (token,
expert) assignment's row goes in the buffer the experts read (grouped by expert,
ties in token order: the layout a stable sort by expert gives), and the rows moved
there and back by gathers.

libtpu compiles each sort of the t k assignments (and each scatter whose indices it
does not know to be sorted, which it compiles as a sort and a scatter) as its own
large piece of straight-line program: with the dispatch's sorts, an MoE layer was
most of the Nemotron-3-Nano train step's TPU program and compile time
(docs/bench/compile_depth.md). Here the ranks come from running counts of a
one-hot, a permutation's inverse from a scatter of integers (small), and the rows
move by gathers whose gradients are gathers by the inverse permutation
(`take_rows`' custom VJP), not scatter-adds.

Shapes: m assignments (t tokens times k), n devices along the expert axis (1
without one), e_local experts a device, cap rows of the buffer a device.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp


def _counts(ids, n: int):
  """(n,) int32: how many of `ids` equal each of 0..n-1, by a compare and a sum."""
  return jnp.sum(ids.reshape(-1, 1) == jnp.arange(n, dtype=ids.dtype), axis=0, dtype=jnp.int32)


def assignment_slots(flat, n: int, e_local: int, cap: int):
  """The send buffer of the dispatch without a sort. flat (m,) each assignment's
  expert (n e_local experts, e_local on each of n devices; n e_local: dropped) ->
  slot (m,): its row in the (n cap) buffer: device block d = expert // e_local,
  inside it the experts in turn and each expert's assignments in their order (the
  rows a stable sort by expert gives), n cap where dropped; src (n cap,): each
  row's assignment (m where empty), slot's inverse; ids (n cap,): each row's
  expert on its device (e_local where empty). Ranks by a running count of a one-hot
  (m, n e_local) (libtpu compiles a sort of m as a large piece of program);
  the inverse by a scatter of integers (small). Needs at most cap kept a device."""
  m = flat.shape[0]
  e = n * e_local
  hot = (flat[:, None] == jnp.arange(e, dtype=flat.dtype)).astype(jnp.int32)  # dropped: nowhere
  run = jnp.cumsum(hot, axis=0)
  rank = jnp.sum((run - hot) * hot, axis=1)  # earlier assignments to the same expert
  per = run[-1].reshape(n, e_local)  # kept assignments to each expert
  before = (jnp.cumsum(per, axis=1) - per).reshape(-1)  # to lower experts of the same device
  kept = flat < e
  slot = (flat // e_local) * cap + jnp.take(before, jnp.minimum(flat, e - 1)) + rank
  slot = jnp.where(kept, slot, n * cap).astype(jnp.int32)
  src = jnp.full((n * cap,), m, jnp.int32).at[slot].set(jnp.arange(m, dtype=jnp.int32), mode="drop",
                                                         unique_indices=True)
  upto = jnp.cumsum(per, axis=1)  # (n, e_local): rows of a device block up to each expert
  ids = jnp.sum(upto[:, None, :] <= jnp.arange(cap)[None, :, None], axis=-1, dtype=jnp.int32)
  return slot, src, ids.reshape(-1)


def group_by_expert(ids, n: int, e_local: int, count: Callable | None = None):
  """Received rows (n blocks of cap, each block's rows by expert, then empty ones:
  `assignment_slots`' layout) -> pos (n cap,): each row's place when grouped by
  expert (the order of a stable sort of ids; n cap where empty), by_expert: its
  inverse (n cap past the rows there are), and sizes (e_local,): rows per expert,
  by count(ids, e_local) -> (e_local,) int32. No sort: from the (n, e_local) table of
  rows each block holds for each expert."""
  count = count or _counts
  cap = ids.shape[0] // n
  blocks = ids.reshape(n, cap)
  per = jax.vmap(lambda b: count(b, e_local))(blocks)  # (n, e_local)
  sizes = jnp.sum(per, axis=0, dtype=jnp.int32)
  first = jnp.cumsum(sizes) - sizes  # each expert's group's first row
  earlier = jnp.cumsum(per, axis=0) - per  # the expert's rows in earlier blocks
  inside = jnp.cumsum(per, axis=1) - per  # the expert's first row inside its block
  g = jnp.minimum(blocks, e_local - 1)
  at = lambda table: jnp.take_along_axis(table, g, axis=1)
  pos = first[g] + at(earlier) + jnp.arange(cap)[None, :] - at(inside)
  pos = jnp.where(blocks < e_local, pos, n * cap).reshape(-1).astype(jnp.int32)
  by_expert = jnp.full((n * cap,), n * cap, jnp.int32).at[pos].set(jnp.arange(n * cap, dtype=jnp.int32),
                                                                   mode="drop", unique_indices=True)
  return pos, by_expert, sizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def take_rows(x, index, inverse, group: int = 1, zero: bool = True, zero_grad: bool = True):
  """x[index // group] along the first axis (rows of index out of range, past
  len(x) group, zero), where index is a one-to-one map (each i hit at most once) and
  inverse its inverse (index[inverse[i]] == i wherever inverse[i] is in range).
  Its gradient is a gather too: dx[r] = sum over g < group of dy[inverse[r group +
  g]], where plain autodiff would scatter-add by index, which libtpu compiles as a
  sort of the indices and a scatter (docs/bench/compile_depth.md).

  zero False: the rows of out-of-range indices are left as the clamped gather gives
  them (copies of x's last row), for a caller that never reads them; zero_grad False:
  the same for the gradient (a row of dx that takes any out-of-range inverse entry is
  left unspecified). Zero fill is a select after the gather that XLA:TPU cannot fuse
  into its SparseCore gathers, a pass over the whole buffer (docs/bench/moe.md)."""
  return _take(x, index // group, zero)


def _take(x, index, zero: bool):
  if zero:
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)
  return jnp.take(x, index, axis=0, mode="clip")


def _take_rows_fwd(x, index, inverse, group, zero, zero_grad):
  return take_rows(x, index, inverse, group, zero, zero_grad), (inverse, x.shape[0])


def _take_rows_bwd(group, zero, zero_grad, res, dy):
  inverse, rows = res
  if group == 1:
    return _take(dy, inverse[:rows], zero_grad), None, None
  # Gathered choice-major, (group, rows, ...): its reshape is free where rows is a multiple
  # of the 16-row tile, where (rows, group, ...) with group 6 was a relayout (a copy)
  # on TPUs (docs/bench/moe.md).
  index = inverse[:rows * group].reshape(rows, group).T.reshape(-1)
  dx = _take(dy, index, zero_grad)
  return jnp.sum(dx.reshape(group, rows, *dy.shape[1:]), axis=0), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def by_choice(slot, src, k: int):
  """The combine's gather in choice-major order: slot (t k,) each assignment's row
  (token-major, a token's k choices in turn) and src its inverse (`assignment_slots`)
  -> index (k t,) the same rows choice by choice, and its inverse, for `take_rows`. The
  rows then reshape to (k, t, w) in place where t is a multiple of the 16-row tile; as
  (t, k, w), k 6, each reshape was a relayout (a copy) on TPUs (docs/bench/moe.md)."""
  m = slot.shape[0]
  t = m // k
  index = slot.reshape(t, k).T.reshape(-1)
  inverse = jnp.where(src < m, (src % k) * t + src // k, m).astype(src.dtype)
  return index, inverse


@jax.custom_vjp
def combine(rows, weights):
  """rows (k, t, w) in any float dtype (the experts' results, bfloat16 from the
  kernels, choice-major: `by_choice`), weights (k, t) float32 -> (t, w) float32:
  sum_j weights[j] rows[j]. Autodiff's own arithmetic, in a form XLA fuses: plain
  autodiff of the float32 product keeps its (k, t, w) float32 cotangent (a broadcast
  and a reduce over it, written to memory), where here the rows' cotangent is written
  once in their dtype (the rounding autodiff's convert does) and the weights' is one
  reduce over the rows and the incoming cotangent."""
  return jnp.sum(rows.astype(jnp.float32) * weights[..., None], axis=0)


def _combine_fwd(rows, weights):
  return combine(rows, weights), (rows, weights)


def _combine_bwd(res, dy):
  rows, weights = res
  d_rows = (dy[None] * weights[..., None]).astype(rows.dtype)
  d_weights = jnp.sum(rows.astype(jnp.float32) * dy[None], axis=-1)
  return d_rows, d_weights.astype(weights.dtype)


combine.defvjp(_combine_fwd, _combine_bwd)
