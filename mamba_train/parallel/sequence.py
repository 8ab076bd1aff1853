"""One sequence split over devices: the `sequence` mesh axis inside the mixer.

The SSD map is affine in its incoming state, so each device runs the chunked
scan on its slice of the length from a zero state and the devices exchange only
a summary of their slice: the final state from that zero start (b, h, p, n) and
the log decay across the whole slice (b, h). Every device gathers the summaries
(one all-gather over the axis; they are small next to the activations) and
combines those before it into its true incoming state with the same state
passing that joins chunks (`ssd.pass_states`), then adds what that state gives
its outputs (`ssd.state_outputs`, the state-to-output step between chunks). A
document that starts on device k cuts every state from the devices before it,
by the same rule as between chunks (a state reaches a later slot only while the
document is the same). The convolution reads the previous device's last
d_conv - 1 inputs (a halo, by one ppermute). Gradients flow through the
all-gather and the ppermute (their transposes are a reduce-scatter and the
reverse ppermute).

The functions here are pure: they take the SSD math and the convolution as
functions (so a fused kernel drops in), the mesh and the axis name, and import
nothing of the package (parallelism knows no model). The model reaches them through
`parallel.sharding` (`sharding.sequence_split()`), the one module that knows the
active mesh and rules, so the model never asks which mesh it runs on and its
imports stay within model/ and parallel.sharding.

shard_map is manual over the sequence axis only (`axis_names`); the data, fsdp
and tensor axes stay automatic, so the rules table shards batch and heads inside
as everywhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
  """The length dimension of activations split over `axis` of `mesh` (size > 1)."""
  mesh: Mesh
  axis: str

  @property
  def size(self) -> int:
    return self.mesh.shape[self.axis]

  def _map(self, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=frozenset({self.axis}))

  def _check_length(self, l: int, least: int = 1):
    if l % self.size or l // self.size < least:
      raise ValueError(f"length {l} must split over the {self.size} devices of mesh axis "
                       f"'{self.axis}' into equal slices of at least {least} positions")

  def conv(self, conv: Callable, x, w, bias, front, seq_idx=None):
    """`conv(x, w, bias, front, seq_idx, front_idx)` (the model's causal conv) on a
    sequence split over the axis: each device's front is the previous device's last
    k-1 inputs (and their document ids); device 0's is `front`.
    x: (b, l, *c); front: (b, k-1, *c). Returns (b, l, *c) and the last k-1 inputs."""
    k1 = front.shape[1]
    self._check_length(x.shape[1], k1)
    ax, n = self.axis, self.size
    shift = [(i, i + 1) for i in range(n - 1)]
    if seq_idx is None:
      seq_idx = jnp.zeros(x.shape[:2], jnp.int32)

    def local(x, w, bias, front, ids):
      first = jax.lax.axis_index(ax) == 0
      halo = jax.lax.ppermute(x[:, -k1:].astype(front.dtype), ax, shift)
      halo_ids = jax.lax.ppermute(ids[:, -k1:], ax, shift)
      front = jnp.where(first, front, halo)
      front_ids = jnp.where(first, jnp.broadcast_to(ids[:, :1], halo_ids.shape), halo_ids)
      y, last = conv(x, w, bias, front, ids, front_ids)
      return y, last[None]

    y, last = self._map(local, in_specs=(P(None, ax), P(), P(), P(), P(None, ax)),
                        out_specs=(P(None, ax), P(ax)))(x, w, bias, front, seq_idx)
    return y, last[-1]

  def ssd(self, scan: Callable, pass_states: Callable, state_outputs: Callable, x, dt, A, B, C,
          *args, D=None, initial_state=None, seq_idx=None, **kw):
    """`scan(x, dt, A, B, C, *args, D=..., initial_state=..., seq_idx=..., **kw)`
    (`ssd.ssd_chunked`, or a kernel with its arguments) on a sequence split over
    the axis, with the same arguments and results. `pass_states` and
    `state_outputs` are the SSD's (`ssd.pass_states`, `ssd.state_outputs`): the
    summaries are combined and the outputs corrected by the same math as between
    chunks (see the module doc)."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    self._check_length(l)
    ax = self.axis
    if initial_state is None:
      initial_state = jnp.zeros((b, h, p, n), jnp.float32)
    if seq_idx is None:
      seq_idx = jnp.zeros((b, l), jnp.int32)
    if D is None:
      D = jnp.zeros((h,), jnp.float32)

    def local(x, dt, B, C, ids, A, D, init):
      # From a zero state, typed as varying over the axis like the slice it scans.
      zero = jax.lax.pcast(jnp.zeros_like(init), (ax,), to="varying")
      y, own = scan(x, dt, A, B, C, *args, D=D, initial_state=zero, seq_idx=ids, **kw)
      total = jnp.sum(dt.astype(jnp.float32) * A.astype(jnp.float32), axis=1)  # (b, h)
      gather = lambda t: jax.lax.all_gather(t, ax)  # (devices, ...)
      first_ids, last_ids = gather(ids[:, 0]), gather(ids[:, -1])
      doc_end = jnp.concatenate([first_ids[:1], last_ids], axis=0)  # (devices + 1, b)
      entering, final = pass_states(init, gather(own), gather(total), doc_end)
      i = jax.lax.axis_index(ax)
      keep_in = ids == doc_end[i][:, None]
      # In bfloat16 compute, y was rounded once before this float32 sum (on one
      # device the entering state's term joins before rounding): one more rounding.
      y = y.astype(jnp.float32) + state_outputs(C, entering[i], dt, A, keep_in=keep_in)
      return y.astype(x.dtype), final[None]

    seq = P(None, ax)
    # Every device computes the same final state; the type system cannot see that
    # through all_gather, so each returns its copy and the last one is taken.
    y, final = self._map(local, in_specs=(seq, seq, seq, seq, seq, P(), P(), P()),
                         out_specs=(seq, P(ax)))(x, dt, B, C, seq_idx, A, D, initial_state)
    return y, final[-1]
