"""One sequence split over devices: the `sequence` mesh axis inside the mixer.

The SSD map is affine in its incoming state, so each device runs the chunked
scan on its slice of the length from a zero state and the devices exchange only
a summary of their slice: the final state from that zero start (b, h, p, n), the
log decay across the whole slice (b, h), and whether a document starts in it.
Summaries compose like affine maps, so the state entering each slice is a prefix
composition over the devices, done as a tree in ceil(log2(devices)) ppermute
rounds (`_scan_over_devices`) in float32: each device sends log2 summaries
rather than gathering and folding every earlier one. It then adds what that state
gives its outputs (`ssd.state_outputs`, the state-to-output step between chunks).
A document that starts on device k cuts every state from the devices before it,
by the same rule as between chunks. With a window (`ssd_window`) no state
crosses: each device takes the inputs of the `window` positions before its slice
from its left neighbour (a ppermute) and recomputes their reach (`_windowed`).
The convolution reads the previous device's last d_conv - 1 inputs (a halo, by
one ppermute). Gradients flow through the ppermutes (their transposes are the
reverse ppermutes).

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

  def _map(self, fn, in_specs, out_specs, check_vma=True):
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=frozenset({self.axis}), check_vma=check_vma)

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

  def ssd(self, scan: Callable, state_outputs: Callable, x, dt, A, B, C, *args, D=None,
          initial_state=None, seq_idx=None, window: int = 0, kernel: bool = False, **kw):
    """`scan(x, dt, A, B, C, *args, D=..., initial_state=..., seq_idx=..., **kw)`
    (`ssd.ssd_chunked`, or a kernel with its arguments) on a sequence split over
    the axis, with the same arguments and results. `state_outputs` is the SSD's
    (`ssd.state_outputs`): what the entering state adds, by the same math as
    between chunks. With a `window`, the slices exchange the inputs the window
    reaches back to instead (`_windowed`). `kernel`: `scan` is a Pallas kernel (in
    its own map over batch and heads, `parallel/heads.py`), whose results carry
    no varying-axes types, so this map runs with check_vma off."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    self._check_length(l)
    ax, size = self.axis, self.size
    if seq_idx is None:
      seq_idx = jnp.zeros((b, l), jnp.int32)
    if D is None:
      D = jnp.zeros((h,), jnp.float32)
    if window:
      if initial_state is not None:
        raise ValueError("a windowed SSD takes no initial_state: its state is the last `window` "
                         "positions' inputs; run those positions too (or window=0)")
      return self._windowed(scan, x, dt, A, B, C, *args, D=D, seq_idx=seq_idx, window=window, **kw)
    if initial_state is None:
      initial_state = jnp.zeros((b, h, p, n), jnp.float32)

    def local(x, dt, B, C, ids, A, D, init):
      # From a zero state, typed as varying over the axis like the slice it scans.
      zero = jnp.zeros_like(init) if kernel else jax.lax.pcast(jnp.zeros_like(init), (ax,), to="varying")
      y, own = scan(x, dt, A, B, C, *args, D=D, initial_state=zero, seq_idx=ids, **kw)
      total = jnp.sum(dt.astype(jnp.float32) * A.astype(jnp.float32), axis=1)  # (b, h)
      i = jax.lax.axis_index(ax)
      first = i == 0
      # The document entering this slice: the previous slice's last, or (device 0)
      # the first position's, to which the initial state belongs.
      doc_in = jnp.where(first, ids[:, 0], _shift(ids[:, -1], ax, size, 1))
      entering, final = _enter(total, own, ids, doc_in, init, ax, size, i)
      keep_in = ids == doc_in[:, None]
      # In bfloat16 compute, y was rounded once before this float32 sum (on one
      # device the entering state's term joins before rounding): one more rounding.
      y = y.astype(jnp.float32) + state_outputs(C, entering[1], dt, A, keep_in=keep_in)
      return y.astype(x.dtype), final[None]

    seq = P(None, ax)
    # The last device's final state is the sequence's.
    y, final = self._map(local, in_specs=(seq, seq, seq, seq, seq, P(), P(), P()),
                         out_specs=(seq, P(ax)), check_vma=not kernel)(x, dt, B, C, seq_idx, A, D, initial_state)
    return y, final[-1]

  def ssd3(self, scan: Callable, state_outputs: Callable, x, dt, A, lam, B, C, chunk_size: int, *, D=None,
           x_proj=None, initial=None, seq_idx=None):
    """Mamba-3's scan (`ssd3.ssd3_chunked`'s arguments and results) on a sequence split
    over the axis. Each device scans its slice from a zero state, its first position's
    carried term taken from the previous device's last key and input (a ppermute; device
    0's from `initial`; none where a document starts there); the entering states are
    composed over the devices as for Mamba-2 (`_scan_over_devices`), and what each adds
    to the outputs is `state_outputs` (`ssd3.state_outputs3`). B and C come rotated by
    the caller (the angle is a prefix over the whole length, which XLA partitions)."""
    b, l, h, p = x.shape
    self._check_length(l)
    ax, size = self.axis, self.size
    if seq_idx is None:
      seq_idx = jnp.zeros((b, l), jnp.int32)
    if initial is None:
      initial = (jnp.zeros((b, h, p, B.shape[-1]), jnp.float32), jnp.zeros(B.shape[:1] + B.shape[2:], B.dtype),
                 jnp.zeros((b, h, p), x.dtype))
    xp = x_proj

    def local(x, dt, A, lam, B, C, ids, D, xp, init):
      state0, k0, v0 = init
      i = jax.lax.axis_index(ax)
      first = i == 0
      prev_ids = _shift(ids[:, -1], ax, size, 1)
      doc_in = jnp.where(first, ids[:, 0], prev_ids)
      # The carried (k, x) of the position before the slice: the previous device's last.
      k_prev, v_prev = _shift((B[:, -1], x[:, -1]), ax, size, 1)
      k_prev = jnp.where(_bcast(first, k_prev), k0.astype(B.dtype), k_prev)
      v_prev = jnp.where(_bcast(first, v_prev), v0.astype(x.dtype), v_prev)
      cont = ids[:, 0] == doc_in  # the slice's first position continues that document
      k_prev = jnp.where(_bcast(cont, k_prev), k_prev, 0)
      v_prev = jnp.where(_bcast(cont, v_prev), v_prev, 0)
      zero = jax.lax.pcast(jnp.zeros_like(state0, jnp.float32), (ax,), to="varying")
      y, (own, k_last, v_last) = scan(x, dt, A, lam, B, C, chunk_size, D=D, x_proj=xp,
                                      initial=(zero, k_prev, v_prev), seq_idx=ids)
      total = jnp.sum(dt.astype(jnp.float32) * A.astype(jnp.float32), axis=1)  # (b, h)
      entering, final = _enter(total, own, ids, doc_in, state0, ax, size, i)
      y = y.astype(jnp.float32) + state_outputs(C, entering[1], dt, A, keep_in=ids == doc_in[:, None])
      return y.astype(x.dtype), final[None], k_last[None], v_last[None]

    seq = P(None, ax)
    xp_arg = jnp.zeros((h, 1, p), x.dtype) if xp is None else xp
    run = lambda x, dt, A, lam, B, C, ids, D, xpa, init: local(x, dt, A, lam, B, C, ids, D,
                                                              None if xp is None else xpa, init)
    y, final, k_last, v_last = self._map(
        run, in_specs=(seq, seq, seq, seq, seq, seq, seq, P(), P(), P()),
        out_specs=(seq, P(ax), P(ax), P(ax)))(x, dt, A, lam, B, C, seq_idx,
                                              jnp.zeros((h,), x.dtype) if D is None else D, xp_arg, initial)
    return y, (final[-1], k_last[-1], v_last[-1])

  def _windowed(self, scan, x, dt, A, B, C, *args, D, seq_idx, window, **kw):
    """The windowed SSD on a split sequence: each device prepends the `window`
    positions before its slice (from its left neighbour when the slice is at least
    `window` long, else from as many neighbours as the window reaches, one
    ppermute each) with C = 0, runs the windowed scan, and drops their outputs.
    Nothing else crosses devices: no state, no gather. Device 0's prefix is
    zeros (dt = 0 and x = 0 add nothing)."""
    b, l, h, p = x.shape
    ax, size = self.axis, self.size
    piece = l // size
    reach = -(-window // piece)  # slices the window reaches back into

    def local(x, dt, B, C, ids, A, D):
      i = jax.lax.axis_index(ax)
      parts = []
      for j in range(reach, 0, -1):  # oldest first; the farthest needs only its tail
        need = window - (reach - 1) * piece if j == reach else piece
        got = _shift((x[:, -need:], dt[:, -need:], B[:, -need:], ids[:, -need:]), ax, size, j)
        # Before device 0 there is nothing; its ids stay the slice's first, in order.
        got = got[:3] + (jnp.where(i >= j, got[3], ids[:, :1]),)
        parts.append(got)
      cat = lambda k, own: jnp.concatenate([pt[k] for pt in parts] + [own], axis=1)
      Cz = jnp.zeros((b, window) + C.shape[2:], C.dtype)
      y, final = scan(cat(0, x), cat(1, dt), A, cat(2, B), jnp.concatenate([Cz, C], axis=1), *args,
                      D=D, seq_idx=cat(3, ids), window=window, **kw)
      return y[:, window:], final[None]

    seq = P(None, ax)
    y, final = self._map(local, in_specs=(seq, seq, seq, seq, seq, P(), P()),
                         out_specs=(seq, P(ax)))(x, dt, B, C, seq_idx, A, D)
    return y, final[-1]


def _enter(total, own, ids, doc_in, init, ax: str, size: int, i):
  """The state entering this device's slice and the one leaving it (the sequence's
  final state on the last device), Mamba-2's and Mamba-3's split alike. Each slice's
  summary is its total decay, its own final state (from a zero state) and whether its
  last position continues the document it entered with; element i of the scan over
  devices is the previous slice's summary, device 0's the initial state."""
  summary = (total, own, ids[:, -1] == doc_in)
  prev = _shift(summary, ax, size, 1)
  start = (jnp.zeros_like(total), init.astype(jnp.float32), jnp.ones_like(doc_in, bool))
  elem = jax.tree.map(lambda s, p: jnp.where(_bcast(i == 0, p), s, p), start, prev)
  entering = _scan_over_devices(elem, ax, size, i)
  return entering, _compose(entering, summary)[1]


def _shift(tree, ax: str, size: int, by: int):
  """Every leaf moved `by` devices right along `ax` (device i gets device i - by's;
  the first `by` devices get zeros): one ppermute per leaf."""
  perm = [(k, k + by) for k in range(size - by)]
  return jax.tree.map(lambda t: jax.lax.ppermute(t, ax, perm), tree)


def _bcast(flag, like):
  return flag.reshape(flag.shape + (1,) * (like.ndim - flag.ndim)) if hasattr(flag, "ndim") else flag


def _compose(first, second):
  """Two consecutive segments' summaries (log decay (b, h), state (b, h, p, n),
  carries (b,): the state entering reaches the segment's end) as one: the SSD's
  map of a segment is affine in its entering state, and affine maps compose.
  float32; the decays add in log space."""
  (l1, s1, k1), (l2, s2, k2) = first, second
  w = jnp.where(_bcast(k2, l2), jnp.exp(l2), 0.0)
  return l1 + l2, s2 + w[..., None, None] * s1, k1 & k2


def _scan_over_devices(elem, ax: str, size: int, i):
  """The inclusive prefix composition of `elem` over the devices of `ax` in
  ceil(log2(size)) ppermute rounds (Hillis-Steele): after round r each device holds
  the composition of the 2^(r+1) elements ending at its own. Each round sends one
  summary per device, so a device sends log2(size) states, not the size - 1 of an
  all-gather, and folds log2(size) of them."""
  step = 1
  while step < size:
    got = _shift(elem, ax, size, step)
    both = _compose(got, elem)
    elem = jax.tree.map(lambda c, e: jnp.where(_bcast(i >= step, e), c, e), both, elem)
    step *= 2
  return elem
