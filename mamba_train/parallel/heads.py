"""A Pallas kernel over a mesh: the batch and heads of activations split over devices.

XLA cannot partition a Pallas call itself, so under a mesh the kernel runs in
`jax.shard_map` on each device's part of the batch and heads. The SSD is
independent per sequence and head, so no device needs another's part: B and C
are split with the heads when their groups divide evenly over the heads' devices,
and replicated when there is one group. The length stays whole here: a split
sequence (`parallel/sequence.py`) shard_maps over its own axis first and calls this
map inside, per slice.

As in `parallel/sequence.py`, the functions here take the math as a function (the
kernel) and the mesh axes, and import nothing of the package; the model reaches
them through `parallel.sharding` (`sharding.head_split()`), which knows the active
mesh and rules.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

# A PartitionSpec entry: no mesh axis, one, or several.
Axes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class HeadSplit:
  """Activations' batch split over the mesh axes `batch` and their heads over
  `heads` (`head_devices` devices in all), the length whole."""
  mesh: Mesh
  batch: Axes
  heads: Axes
  head_devices: int

  def ssd(self, kernel: Callable, x, dt, A, B, C, chunk_size: int, *, D=None, initial_state=None,
          seq_idx=None):
    """`kernel(x, dt, A, B, C, chunk_size, D=..., initial_state=..., seq_idx=...)`
    (`ssd_tpu.ssd_fused` or `ssd_gpu.ssd_gpu` with its options) on each device's part of the batch and
    heads, with the same arguments and results as `ssd.ssd_chunked`."""
    g = B.shape[2]
    if g > 1 and g % self.head_devices:
      raise ValueError(f"the Pallas SSD splits heads over {self.head_devices} devices but ngroups={g} "
                       f"does not divide evenly over them: use a tensor axis dividing ngroups, or "
                       f"runtime.ssd_impl='xla'")
    bt, hd = self.batch, self.heads
    bc = P(bt, None, hd if g > 1 else None, None)
    specs = (P(bt, None, hd, None), P(bt, None, hd), P(hd), bc, bc, P(hd), P(bt, hd, None, None))
    if initial_state is None:
      initial_state = jnp.zeros(x.shape[:1] + x.shape[2:] + B.shape[-1:], jnp.float32)
    args = (x, dt, A, B, C, D if D is not None else jnp.zeros(A.shape, jnp.float32), initial_state)
    if seq_idx is not None:
      specs, args = specs + (P(bt, None),), args + (seq_idx,)

    def local(x, dt, A, B, C, D, h0, seq=None):
      return kernel(x, dt, A, B, C, chunk_size, D=D, initial_state=h0, seq_idx=seq)

    return self._map(local, specs, (specs[0], specs[6]), *args)

  def ssd3(self, kernel: Callable, x, dt, A, lam, B, C, chunk_size: int, *, D=None, x_proj=None, initial=None,
           seq_idx=None):
    """`kernel(...)` (`ssd3_tpu.ssd3_fused`, Mamba-3's scan) on each device's part of
    the batch and heads, with `ssd3.ssd3_chunked`'s arguments and results. B and C
    (b, l, [R,] g, n) split with the heads, or whole with one group."""
    g, siso = B.shape[-2], B.ndim == 4
    if g > 1 and g % self.head_devices:
      raise ValueError(f"the Pallas Mamba-3 scan splits heads over {self.head_devices} devices but its "
                       f"{g} groups do not divide evenly over them: runtime.ssd_impl='xla'")
    bt, hd = self.batch, self.heads
    gs = hd if g > 1 else None
    b, _, h, p = x.shape
    rank = () if siso else (None,)
    bc, heads, k = P(bt, None, *rank, gs, None), P(bt, None, hd), P(bt, *rank, gs, None)
    state, last_x = P(bt, hd, None, None), P(bt, hd, None)
    if initial is None:
      initial = (jnp.zeros((b, h, p, B.shape[-1]), jnp.float32), jnp.zeros(B.shape[:1] + B.shape[2:], B.dtype),
                 jnp.zeros((b, h, p), x.dtype))
    specs = [P(bt, None, hd, None), heads, heads, heads, bc, bc, P(hd), (state, k, last_x)]
    args = [x, dt, A, lam, B, C, jnp.zeros((h,), jnp.float32) if D is None else D, initial]
    if x_proj is not None:
      specs, args = specs + [P(hd, None, None)], args + [x_proj]
    if seq_idx is not None:
      specs, args = specs + [P(bt, None)], args + [seq_idx]

    def local(x, dt, A, lam, B, C, D, init, *rest):
      xp = rest[0] if x_proj is not None else None
      seq = rest[-1] if seq_idx is not None else None
      return kernel(x, dt, A, lam, B, C, chunk_size, D=D, x_proj=xp, initial=init, seq_idx=seq)

    y = P(bt, None, *rank, hd, None)
    return self._map(local, tuple(specs), (y, (state, k, last_x)), *args)

  def mixer(self, kernel: Callable, zx, bc, dt_raw, w, chunk_size: int, *, ngroups: int, dt_limit,
            front_x, front_bc, initial_state, seq_idx=None):
    """`kernel(...)` (`layer_fused_tpu.mixer_core_tpu`: the layer between in_proj and
    out_proj) on each device's part of the batch and heads, whole groups on each
    device (the caller checks that they divide), with `layer_math.mixer_core`'s
    arguments and results. w: the layer's conv, dt, A and D parameters by name."""
    bt, hd = self.batch, self.heads
    gs = hd if ngroups > 1 else None  # one group: B|C whole on every device
    inner = P(bt, None, hd)
    wspecs = {"conv_x": P(None, hd), "conv_x_bias": P(hd), "conv_bc": P(None, None, gs),
              "conv_bc_bias": P(None, gs), "dt_bias": P(hd), "A_log": P(hd), "D": P(hd)}
    w = {k: w[k] for k in wspecs}
    bcs = P(bt, None, None, gs)
    split = self.head_devices > 1
    if split:
      # A device's heads are a part of z's columns and a part of x's, not one block of
      # z|x: split as (b, l, 2, i) and joined again per device (copies; no recipe
      # splits heads over devices).
      zx = zx.reshape(*zx.shape[:2], 2, -1)
    specs = (P(bt, None, None, hd) if split else P(bt, None, None), bcs, inner, wspecs, inner, bcs,
             P(bt, hd, None, None))
    args = (zx, bc, dt_raw, w, front_x, front_bc, initial_state)
    if seq_idx is not None:
      specs, args = specs + (P(bt, None),), args + (seq_idx,)
    local_groups = ngroups // self.head_devices if ngroups > 1 else 1

    def local(zx, bc, dt_raw, w, fx, fbc, h0, seq=None):
      zx = zx.reshape(*zx.shape[:2], -1)
      return kernel(zx, bc, dt_raw, w, chunk_size, ngroups=local_groups, dt_limit=dt_limit,
                    front_x=fx, front_bc=fbc, initial_state=h0, seq_idx=seq)
    return self._map(local, specs, (inner, P(bt, None, gs), specs[6]), *args)

  def _map(self, local, in_specs, out_specs, *args):
    # Inside another map (a split sequence's, manual over its axis) the kernel's map
    # takes the context's mesh, which says which axes are manual already.
    context = jax.sharding.get_abstract_mesh()
    mesh = context if not context.empty and context.manual_axes else self.mesh
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

  def conv(self, kernel: Callable, x, w, bias, front, seq_idx=None, front_idx=None):
    """`kernel(x, w, bias, front, seq_idx, front_idx)` (the model's conv + SiLU, a
    Pallas kernel) on each device's part of the batch, and of the channels when x's
    last axis is the heads' (d_inner: x; B|C stay whole over the heads' devices,
    as the SSD keeps them with one group). x: (b, l, *c); w: (k, *c)."""
    inner = self.heads if x.ndim == 3 and x.shape[-1] % self.head_devices == 0 else None
    lead = (None,) * (x.ndim - 3)
    xs = P(self.batch, None, *lead, inner)
    specs = [xs, P(None, *lead, inner), P(*lead, inner), xs]
    args = [x, w, bias, front]
    if seq_idx is not None:
      specs.append(P(self.batch, None))
      args.append(seq_idx)
      if front_idx is not None:
        specs.append(P(self.batch, None))
        args.append(front_idx)
    return self._map(lambda *a: kernel(*a), tuple(specs), (xs, xs), *args)

  def norm(self, kernel: Callable, y, z, weight, groups: int, eps: float):
    """`kernel(y, z, weight, groups, eps)` (the gated RMSNorm, a Pallas kernel) on
    each device's part of the batch and of the groups (whole groups: the caller
    checks that they divide over the heads' devices). y, z: (b, l, i); z wider (in_proj's
    joined output, its first i channels the gate) only with the heads on one device."""
    s = P(self.batch, None, self.heads)
    zs = s
    if z.shape[-1] != y.shape[-1]:
      if self.head_devices > 1:  # the joined channels do not split as the gate's do
        z = z[..., :y.shape[-1]]
      else:
        zs = P(self.batch, None, None)
    local = lambda y, z, w: kernel(y, z, w, groups // self.head_devices, eps)
    return self._map(local, (s, zs, P(self.heads)), s, y, z, weight)
