"""The embedding's lookup under a mesh: each device reads its own columns of the table.

The table (vocab, d) is split on d over the fsdp axes (and on its rows over tensor),
and the tokens over the batch's axes. Where the tokens are split over other devices
than the columns (data x fsdp), XLA partitions `take` by gathering the whole float32
table on every device (at 1.3b 412 MB a step), and its gradient is a scatter into a
whole table of zeros, reduced whole over every device (docs/bench/fused_layer.md, "The
embedding's lookup by columns"). Instead each device:

- gathers the token ids of the devices that share its d columns (4 bytes a token,
  against d x 4 for the row each selects),
- looks those tokens up in its own columns (a row outside its share of the vocabulary,
  under tensor, reads zeros, and the tensor axis sums the parts),
- and trades the rows back by all-to-all, so it holds every column of its own tokens.

The gradient runs the same way back: an all-to-all, a scatter into the device's own
piece of the table, and the reduction over the devices that hold that piece alike
(shard_map's transpose of a replicated input). Exact: gathers and a sum over zeros.

As `parallel/heads.py`, it imports nothing of the package; the model reaches it
through `parallel.sharding` (`sharding.embedding_split()`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

Axes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class EmbeddingSplit:
  """The table's rows split over `vocab`, its columns over `columns` (more than one
  device), and the token ids' dimensions over `tokens` (one entry per dimension)."""
  mesh: Mesh
  vocab: Axes
  columns: Axes
  tokens: tuple[Axes, ...]

  def lookup(self, table, ids):
    """table[ids]: (*ids.shape, d), split over the mesh like the ids, d whole."""
    vocab, columns = self.vocab, self.columns

    def local(t, i):
      shape = i.shape
      i = jax.lax.all_gather(i.reshape(-1), columns, tiled=True)
      # mode clip: no select of NaN rows for ids past the table (take's default), which
      # XLA writes as one more pass over the rows; a valid id reads the same row.
      if vocab is None:
        rows = jnp.take(t, i, axis=0, mode="clip")
      else:
        j = i - jax.lax.axis_index(vocab) * t.shape[0]
        mine = (j >= 0) & (j < t.shape[0])
        rows = jnp.where(mine[:, None], jnp.take(t, jnp.where(mine, j, 0), axis=0, mode="clip"), 0)
        rows = jax.lax.psum(rows, vocab)
      rows = jax.lax.all_to_all(rows, columns, 0, 1, tiled=True)
      return rows.reshape(*shape, -1)

    # check_vma off: the ids may be replicated over axes the rows are not (a batch the
    # devices do not divide), which the varying-axes check cannot infer; the gradient's
    # reduction over the table's replicated axes is shard_map's either way.
    return jax.shard_map(local, mesh=self.mesh, in_specs=(P(vocab, columns), P(*self.tokens)),
                         out_specs=P(*self.tokens, None), check_vma=False)(table, ids)

