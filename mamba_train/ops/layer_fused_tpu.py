"""The Mamba-2 layer between in_proj and out_proj as one Pallas TPU kernel (Mosaic).

Same arguments and results as the plain form `layer_math.mixer_core` (the
reference, and what CPUs run): from in_proj's outputs z|x (joined, as one GEMM writes
them), B|C (before the conv) and dt (before its softplus) to the gated SSD output
y * silu(z) and each row's
sums of squares per norm group, which the model folds into the norm and out_proj
(`mamba2.mixer`: out = (g * rsqrt(ssq / width + eps) * w) @ W_out, XLA fusing the
row scaling into out_proj's operand).

Why one kernel: separate kernels at the layer's natural boundaries (conv | SSD |
norm) materialise their operands in HBM, and under remat their recomputed forward
needs them again (docs/bench/tpu_ssd.md). Here, per chunk and head block, on chip:

- prologue: the causal depthwise conv + bias + SiLU of x and of B and C, from their
  raw in_proj values; the k - 1 positions before a chunk come from the previous
  chunk's raw block, kept in VMEM (the grid walks each head block's chunks in
  order, as the one-pass SSD does), shifted in by lane (x, positions on lanes) or
  sublane (B, C) rotations; dt = clip(softplus(dt_raw + dt_bias)) and a = dt A;
- the one-pass SSD of `ssd_tpu` (its per-chunk math, the state carried in VMEM),
  y + D x;
- epilogue: the gate y * silu(z), written once in the compute dtype, and the
  per-head sums of its squares over p (float32, (c, b, h, q): 1/p of y's elements),
  summed per group in XLA.

Between in_proj's output and out_proj's input only the gated y is written (and the
final state). The (l, d_inner)-sized operands and results (z|x and the gated y; in
the backward the gated y's cotangent and dz|dx) stay as the GEMMs write and read
them, row-major: z|x is in_proj's one (b, l, 2i) output, passed twice and read
through two BlockSpecs, z's blocks from column 0 and x's from column i; each program
reads and writes a chunk's (q, hb p) block, channels on lanes, and turns it to the
per-head math's (hb, p, q) orientation (positions on lanes) and back with one
transpose on chip, so XLA adds no slice, stack or relayout copies around the kernels
(docs/bench/fused_layer.md). Mosaic then needs a head block's channels, hb p, to be a
multiple of 128 (p 64: 8 heads; every released size: 512, `tiny` 256), x's offset i
being a whole number of blocks only then; where they are not, `mixer_core_tpu` runs
the plain form over the SSD kernel (`joins`).

The backward (the forward's `jax.custom_vjp`) is one kernel too, `_bwd_call`, on the
forward's grid with the chunks innermost, sequential and in reverse. It needs each
chunk's entering state. Where a head block's states fit VMEM (`merged`: l 2048 and
4096 at the released sizes), the kernel first walks the chunks in order and passes
the states as the forward kernel does, keeping them in VMEM, then walks back: no
states cross HBM, and nothing of the forward is saved but its outputs. Else the
forward kernel writes them, (b, g, r, c, p, n) float32 (`mixer_fused_save`, as
`ssd_tpu`'s one-pass kernel does; under remat only the backward pass's rerun,
`optimize_remat`). The norm's and out_proj's backward read the gated y and its
squares (`SAVE_NAMES`): `save_in_proj_ssd` keeps them, so the backward pass runs no
forward kernel again; `save_in_proj` reruns the forward kernel for them.
Per chunk and head block the backward kernel recomputes, from in_proj's raw outputs,
the conv + SiLU of x, B and C (reading the previous chunk's raw block, or the front,
for the conv's reach back), dt, the chunk's SSD output and the gate; then takes the
gate's gradient (the gated y's cotangent plus 2 gated times its sum of squares'), the
SSD chunk's (`ssd_tpu._outputs_head_bwd`, `_states_head_bwd`, the state's cotangent
carried in VMEM from the final state's back to the initial state's), SiLU's and the
conv's. Walking in reverse, an input's conv gradient needs the pre-activation
cotangents of the k - 1 positions after it, which may sit in the next chunk: that
chunk's are kept in VMEM (the halo). It writes the gradients of in_proj's outputs (z|x
joined, as in_proj's weight- and input-gradient GEMMs read them: a step's dz and dx
blocks sit i columns apart, more than one BlockSpec writes, so the kernel copies them
to HBM itself, overlapped with the next step; dt; B and C as per-head-block float32
partials, B and C being shared by a group's heads across blocks, summed outside;
everything after dB, dC is linear in them), and
the small ones: the conv weights and biases per sequence (and head block), rows of
A's and D's to sum, the initial state's and the fronts'. Nothing (l, d_inner)-sized
crosses HBM but its inputs (z|x, the gated y's cotangent and the previous chunk's x)
and its output (dz|dx); docs/bench/fused_layer.md has the counts, predicted and
measured.

Supported: documents (seq_idx), initial states (the SSM state, and the conv's front
of earlier inputs, which the first chunk reads as its previous chunk), any length
(padded to whole chunks, dt 0 on the padding), ngroups dividing the heads. Not: a
padding mask, a window, a split sequence; those run the plain forms (`table.build`,
`mamba2.mixer`).

`interpret=True` runs the kernels in Pallas' interpreter (the CPU tests). This module
is the entry (`mixer_core_tpu` and its custom VJP); the forward kernel and what both
kernels share are in `layer_fused_fwd_tpu`, the backward kernel in
`layer_fused_bwd_tpu`. They import of the package SiLU's derivative of the plain forms
and the one-pass SSD's per-chunk math, forward and backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mamba_train.ops import layer_math, ssd_tpu
from mamba_train.ops.layer_fused_bwd_tpu import _bwd_call, merged
from mamba_train.ops.layer_fused_fwd_tpu import _F32, _call, _chunks, _prep, head_block


def _outputs(d, gated, ssq, final):
  """The forward kernel's outputs back to (b, l, ...): the gated y channels-minor
  (out_proj's operand), the squares per group, the final state (b, h, p, n)."""
  b, c, q, l = d.b, d.c, d.q, d.l
  gated = gated[:, :l]  # already row-major
  ssq = ssq.transpose(1, 0, 4, 2, 3).reshape(b, c * q, d.g, d.r).sum(-1)[:, :l]
  return gated, ssq, final.reshape(b, d.h, d.p, d.n)


# zero_start: the caller gave no initial state and no fronts (the zeros passed for them
# are what the backward kernel reads); the forward kernel makes them on chip.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 11, 12))
def _fused(zx, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx, interpret,
           zero_start):
  d, args = _prep(zx, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, initial_state, seq_idx)
  return _outputs(d, *_call(d, args, dt_limit, interpret, zero_start=zero_start))


def _fused_fwd(zx, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, dt_limit, initial_state, seq_idx, interpret,
               zero_start):
  d, args = _prep(zx, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, initial_state, seq_idx)
  if merged(d):  # the backward kernel passes the states itself, in VMEM: none saved
    gated, ssq, final = _call(d, args, dt_limit, interpret, zero_start=zero_start)
    states = None
  else:
    gated, ssq, final, states = _call(d, args, dt_limit, interpret, save=True, zero_start=zero_start)
  return _outputs(d, gated, ssq, final), (zx, bc, dt_raw, w, front_x, front_bc, initial_state, seq_idx, states)


def _fused_bwd(chunk, ngroups, dt_limit, interpret, zero_start, res, ct):  # pylint: disable=unused-argument
  zx, bc, dt_raw, w, front_x, front_bc, initial_state, seq_idx, states = res
  d, args = _prep(zx, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, initial_state, seq_idx)
  b, l, c, q, g, r, k, n = d.b, d.l, d.c, d.q, d.g, d.r, d.k, d.n
  dgated, dssq, dfinal = ct
  dg = dgated.astype(zx.dtype)
  dg = jnp.pad(dg, [(0, 0), (0, d.pad), (0, 0)]) if d.pad else dg
  dssq = _chunks(dssq.astype(_F32)[..., None], q, d.pad, (b, c, q, g, 1), (1, 0, 3, 4, 2))
  (dzx, dbp, dcp, ddtr, da, dd, dinit, dwx, dbx, dwb, dbb, dwc, dbcb, dfx, dfb, dfc) = _bwd_call(
      d, args, states, dg, dssq, dfinal.astype(_F32).reshape(b, g, r, d.p, n), dt_limit, interpret)
  back = lambda v: v[:, :l]  # dz|dx row-major, as in_proj's GEMMs read it
  dbc = jnp.stack([dbp.sum(1), dcp.sum(1)], 2)[:, :l]  # (b, l, 2, g n)
  ddtr = ddtr.transpose(1, 0, 4, 2, 3).reshape(b, c * q, d.h)[:, :l]
  A = -jnp.exp(w["A_log"].astype(_F32))
  dw = dict(conv_x=dwx.sum(0).reshape(k, d.i), conv_x_bias=dbx.sum(0).reshape(d.i),
            conv_bc=jnp.stack([dwb.sum((0, 2)), dwc.sum((0, 2))], 1).transpose(2, 1, 0, 3).reshape(k, 2, g * n),
            conv_bc_bias=jnp.stack([dbb.sum((0, 2)), dbcb.sum((0, 2))]).reshape(2, g * n),
            dt_bias=ddtr.sum((0, 1)), A_log=da.sum((0, 1, 4)).reshape(d.h) * A,
            D=dd.sum((0, 1, 4)).reshape(d.h) if w.get("D") is not None else None)
  dw = {name: (None if dw[name] is None else dw[name].astype(v.dtype)) for name, v in w.items()}
  # The fronts' gradients sit at the end of their chunk-sized blocks.
  dfx = dfx[..., q - (k - 1):].transpose(0, 4, 1, 2, 3).reshape(b, k - 1, d.i)
  dfbc = jnp.stack([dfb.sum(2), dfc.sum(2)], 2)[:, :, :, q - (k - 1):]  # (b, g, 2, k-1, n)
  dfbc = dfbc.transpose(0, 3, 2, 1, 4).reshape(b, k - 1, 2, g * n)
  like = lambda v, ref: v.astype(ref.dtype)
  return (like(back(dzx), zx), like(dbc, bc), like(ddtr, dt_raw), dw, like(dfx, front_x), like(dfbc, front_bc),
          like(dinit.reshape(initial_state.shape), initial_state), None)


_fused.defvjp(_fused_fwd, _fused_bwd, optimize_remat=True)


# The forward's results the norm and out_proj's backward read, named for the remat
# policies (`save_in_proj_ssd` keeps them: then the backward pass runs no forward
# kernel again where the backward kernel passes the states itself, `merged`).
SAVE_NAMES = ("mixer_fused_gated", "mixer_fused_ssq")


def joins(d_inner: int, nheads: int, ngroups: int, d_state: int) -> bool:
  """Whether the kernels take this layer (per device's heads): a head block's channels
  (hb p: 16 or 8 heads, or all of a group's) fill whole 128-lane vregs, as Mosaic's blocks
  must, x's blocks sitting i columns into the joined z|x (a block-aligned offset only
  then); and a group's B (C) channels are whole vregs of lanes too, or all of B's (one
  group), read in place from B|C. Every released size has hb p = 1024 (512 at `tiny`)
  and n = 128 or one group."""
  lanes = head_block(nheads // ngroups) * (d_inner // nheads) % 128 == 0
  return lanes and (ngroups == 1 or d_state % 128 == 0)


def mixer_core_tpu(zx, bc, dt_raw, w, chunk: int, *, ngroups: int, dt_limit=(0.0, float("inf")),
                   front_x=None, front_bc=None, initial_state=None, seq_idx=None, interpret: bool = False):
  """`layer_math.mixer_core` as one Pallas TPU kernel, forward and backward (see the module doc)."""
  b, h, k = zx.shape[0], dt_raw.shape[-1], w["conv_x"].shape[0]
  i = zx.shape[-1] // 2
  if not interpret and not joins(i, h, ngroups, bc.shape[-1] // ngroups):
    # The layer's plain form over the one-pass SSD kernel, the same function (what
    # `table.build` runs where this kernel takes no split sequence).
    ssd = functools.partial(ssd_tpu.ssd_fused, interpret=False)
    return layer_math.mixer_core(zx, bc, dt_raw, w, chunk, ngroups=ngroups, dt_limit=dt_limit, front_x=front_x,
                                 front_bc=front_bc, initial_state=initial_state, seq_idx=seq_idx, ssd=ssd)
  zero_start = initial_state is None and front_x is None and front_bc is None
  if initial_state is None:
    initial_state = jnp.zeros((b, h, i // h, bc.shape[-1] // ngroups), _F32)
  front_x = jnp.zeros((b, k - 1, i), _F32) if front_x is None else front_x
  front_bc = jnp.zeros((b, k - 1, *bc.shape[2:]), _F32) if front_bc is None else front_bc
  gated, ssq, final = _fused(zx, bc, dt_raw, w, front_x, front_bc, chunk, ngroups, tuple(dt_limit), initial_state,
                             seq_idx, interpret, zero_start)
  return checkpoint_name(gated, SAVE_NAMES[0]), checkpoint_name(ssq, SAVE_NAMES[1]), final
