"""The Mamba-2 layer between in_proj and out_proj as Pallas Triton kernels (NVIDIA GPUs).

Same arguments and results as the plain form `layer_math.mixer_core` (the reference,
and what CPUs run) and the TPU kernel `layer_fused_tpu.mixer_core_tpu`: from in_proj's
outputs z|x (joined, as one GEMM writes them), B|C (before the conv) and dt (before
its softplus) to the gated SSD output y * silu(z) and each row's sums of squares per
norm group, which the model folds into the norm and out_proj (`mamba2._mixer_fused`).

Why: the separate GPU kernels (`layer_gpu`'s conv and norm, `ssd_gpu`'s SSD) write
their operands to HBM at each of the layer's boundaries, the conv's activation, the
SSD's y and the gate's z slice, and read them again, in the forward pass and in the
backward pass's recompute (docs/bench/gpu.md, "A fused GPU layer: does it pay?"). Here
one forward kernel, on `ssd_gpu`'s grid (b, h), one head of one sequence a program
walking its chunks in order with the (p, n) float32 state in registers, does per chunk:

- prologue: x's causal depthwise conv + bias + SiLU from in_proj's raw x, read in
  place out of z|x: each of the k taps a gather of the chunk's rows shifted back
  (reading the previous chunk's last rows, or the conv's front of earlier inputs
  before position 0; an input of another document contributes nothing);
- `ssd_gpu`'s per-chunk SSD with the D skip;
- epilogue: the gate y * silu(z), z read in place out of z|x, written once in the
  compute dtype, and the per-head sum of its squares (float32), summed per group in XLA.

Between z|x and out_proj's input only the gated y crosses HBM (and, under
differentiation, the state entering each chunk, the backward's residual as in
`ssd_gpu`). The backward is two kernels: one on the same grid walking the chunks in
reverse recomputes each chunk's conv, SSD and gate, and takes the gate's, the SSD's
(as `ssd_gpu`'s backward) and SiLU's gradients, writing dz into the joined cotangent
of z|x and the conv's pre-activation cotangent (float32), with the conv weight's and
bias's per-program sums; a second walks the positions and applies the conv's
transpose (each input's gradient from the pre-activation cotangents up to k - 1
positions after it, which a reverse walk has not got in registers: Triton slices no
register tensor, so the shifted reads go through memory) into dx, in place in the
same joined cotangent. B|C's conv + SiLU (2 g n channels, 1/16 of x's at the
released sizes) and dt's softplus run in XLA before the kernels, their gradients
by XLA's autodiff.

Triton's rules as `ssd_gpu`'s: the head size p and the state size n powers of two,
at least 16 (every released size: p 64, n 128), the chunk a power of two up to 64;
other sizes (and a conv longer than a chunk) run the plain form over `ssd_gpu`'s
kernels (`joins`). Lengths are padded to whole chunks with dt = 0 (a copy of z|x only
then).

`interpret=True` runs the kernels in Pallas' interpreter (the CPU tests). Imports of
the package: the plain forms and `ssd_gpu`'s per-chunk math.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mamba_train.ops import layer_math, ssd_gpu
from mamba_train.ops.ssd_gpu import _TN, _bwd_doc_in, _chunk_terms, _doc_in, _masks, _params

_F32 = jnp.float32

# Names a remat policy can save ('save_in_proj_ssd', and 'save_matmuls' with the layers
# unrolled: `table.build`): with the gated y, its squares and the entering states kept,
# the backward pass runs no forward kernel again.
SAVE_NAMES = ("mixer_fused_gpu_gated", "mixer_fused_gpu_ssq", "mixer_fused_gpu_states", "mixer_fused_gpu_final")


def joins(d_inner: int, nheads: int, ngroups: int, d_state: int) -> bool:
  """Whether the kernels take this layer: the head size and the state size powers of
  two, at least Triton's smallest dot (16), and whole heads a group."""
  p = d_inner // nheads
  pow2 = lambda v: v >= ssd_gpu.MIN_DIM and v & (v - 1) == 0
  return d_inner % nheads == 0 and nheads % ngroups == 0 and pow2(p) and pow2(d_state)


def _silu(v):
  sig = jax.nn.sigmoid(v)
  return v * sig, sig


def _taps(x_ref, f_ref, sq_ref, z, q, k, ids):
  """x's k conv taps for chunk z, float32 (q, p): tap j at row t is the raw input at
  position z q + t - (k-1-j), the front's before position 0, zero from another
  document (the front counts as position 0's, as `layer_math.causal_conv`'s default)."""
  pos = z * q + jax.lax.broadcasted_iota(jnp.int32, (q,), 0)
  taps = []
  for j in range(k):
    s = k - 1 - j
    src = pos - s
    v = x_ref[jnp.maximum(src, 0), :].astype(_F32)
    if s:
      inside = src >= 0
      front = f_ref[jnp.clip(src + (k - 1), 0, k - 2), :].astype(_F32)
      v = jnp.where(inside[:, None], v, front)
      if ids is not None:
        first = jnp.min(ids)  # position 0's document, where z is 0 (the only chunk reading the front)
        v = jnp.where((jnp.where(inside, sq_ref[jnp.maximum(src, 0)], first) == ids)[:, None], v, 0.0)
    taps.append(v)
  return taps


def _prologue(x_ref, f_ref, w_ref, bias_ref, sq_ref, z, q, k, ids, cdt):
  """The chunk's conv pre-activation, its taps, and the SSD's x (SiLU, in the compute dtype)."""
  taps = _taps(x_ref, f_ref, sq_ref, z, q, k, ids)
  pre = bias_ref[...].astype(_F32)[None, :]
  for j, v in enumerate(taps):
    pre = pre + v * w_ref[j, :].astype(_F32)[None, :]
  xs, sig = _silu(pre)
  return pre, sig, taps, xs.astype(cdt).astype(_F32)


# ----------------------------------------------------------------------------
# Forward: conv + SiLU, the SSD with the state in registers, the gate.


def _fwd_kernel(*refs, q, nc, k, seq, save):
  (z_ref, x_ref, f_ref, w_ref, bias_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, h0_ref), rest = refs[:11], refs[11:]
  sq_ref = rest[0] if seq else None
  rest = rest[1:] if seq else rest
  g_ref, ssq_ref, fin_ref = rest[:3]
  st_ref = rest[3] if save else None
  p = z_ref.shape[-1]
  cdt = z_ref.dtype
  upto, after = _masks(q)
  A = a_ref[...].astype(_F32)
  D = d_ref[...].astype(_F32)

  def body(z, carry):
    state, prev = carry
    rows = pl.ds(z * q, q)
    sq = sq_ref[rows] if seq else None
    doc_in = _doc_in(sq, z, prev) if seq else prev
    if save:
      st_ref[pl.ds(z * p, p), :] = state
    _, _, _, xf = _prologue(x_ref, f_ref, w_ref, bias_ref, sq_ref, z, q, k, sq, cdt)
    dt = dt_ref[rows].astype(_F32)
    lmat, decay_in, w, through, _, _ = _chunk_terms(dt * A, upto, after, sq, doc_in)
    bmat, cmat = b_ref[rows, :], c_ref[rows, :]
    y, xdt, _ = ssd_gpu.chunk_out(xf, dt, bmat, cmat, state, lmat, decay_in, cdt)
    yc = (y + xf * D).astype(cdt).astype(_F32)  # the SSD's output in the compute dtype, as the plain form's
    sz, _ = _silu(z_ref[rows, :].astype(_F32))
    gated = yc * sz
    g_ref[rows, :] = gated.astype(g_ref.dtype)
    ssq_ref[rows] = jnp.sum(gated * gated, axis=1)
    own = jax.lax.dot_general((xdt * w[:, None]).astype(cdt), bmat, _TN, preferred_element_type=_F32)
    return state * through + own, (jnp.max(sq) if seq else prev)

  state, _ = jax.lax.fori_loop(0, nc, body, (h0_ref[...].astype(_F32), jnp.int32(0)))
  fin_ref[...] = state


def _specs(b, L, h, g, p, n, k):
  r = h // g
  head = lambda off: pl.BlockSpec((None, L, p), lambda bi, hi: (bi, 0, hi + off))  # a head's (L, p) of z|x or y
  rows = pl.BlockSpec((None, L, None), lambda bi, hi: (bi, 0, hi))  # (b, L, h) per-position rows: (L,)
  scalar = pl.BlockSpec((1,), lambda bi, hi: (hi,))
  group = pl.BlockSpec((None, L, None, n), lambda bi, hi: (bi, 0, hi // r, 0))  # B, C: (L, n)
  state = pl.BlockSpec((None, None, p, n), lambda bi, hi: (bi, hi, 0, 0))
  front = pl.BlockSpec((None, k - 1, p), lambda bi, hi: (bi, 0, hi))
  taps = pl.BlockSpec((k, p), lambda bi, hi: (0, hi))  # the conv's (k, i) weight
  chan = pl.BlockSpec((p,), lambda bi, hi: (hi,))  # the conv's (i,) bias
  seq = pl.BlockSpec((None, L), lambda bi, hi: (bi, 0))
  return dict(head=head, rows=rows, scalar=scalar, group=group, state=state, front=front, taps=taps,
              chan=chan, seq=seq)


def _fwd_call(zx, fx, wx, bx, dt, A, B, C, D, h0, sq, q, interpret, save=False):
  b, L, two_i = zx.shape
  h, p, n = h0.shape[1], h0.shape[2], h0.shape[3]
  g, k = B.shape[2], wx.shape[0]
  nc = L // q
  s = _specs(b, L, h, g, p, n, k)
  in_specs = [s["head"](0), s["head"](h), s["front"], s["taps"], s["chan"], s["rows"], s["scalar"], s["group"],
              s["group"], s["scalar"], s["state"]]
  args = [zx, zx, fx, wx, bx, dt, A, B, C, D, h0]
  if sq is not None:
    in_specs.append(s["seq"])
    args.append(sq)
  cdt = zx.dtype
  isz = jnp.dtype(cdt).itemsize
  i = two_i // 2
  out_shape = [jax.ShapeDtypeStruct((b, L, i), cdt), jax.ShapeDtypeStruct((b, L, h), _F32),
               jax.ShapeDtypeStruct((b, h, p, n), _F32)]
  out_specs = [s["head"](0), s["rows"], s["state"]]
  if save:
    out_shape.append(jax.ShapeDtypeStruct((b, h, nc * p, n), _F32))
    out_specs.append(pl.BlockSpec((None, None, nc * p, n), lambda bi, hi: (bi, hi, 0, 0)))
  cost = pl.CostEstimate(
      # per head and chunk: `ssd_gpu`'s forward, the conv's k taps and SiLU, the gate
      # and its squares (~8 (q, p) ops more).
      flops=int(b * h * nc * (2 * q * q * n + 2 * q ** 3 + 2 * q * q * p + 4 * q * n * p + 3 * p * n
                              + 16 * q * q + 16 * q * p + 2 * k * q * p)),
      transcendentals=int(b * h * nc * (q * q + 2 * q + 1 + 2 * q * p)),
      # z and x read once (a tap's shifted rows are the chunk's and the previous
      # chunk's, from L1/L2), the gated y written once, its squares and dt's rows;
      # B and C once per sequence and group (adjacent programs, from L2, as in
      # `ssd_gpu`); the states and the small weights.
      bytes_accessed=int(2 * b * L * i * isz + b * L * i * isz + b * L * h * 8 + 2 * B.size * isz
                         + 2 * h0.size * 4 + fx.size * isz + wx.size * 4 + bx.size * 4
                         + (b * L * h * 4 if sq is not None else 0)
                         + (b * h * nc * p * n * 4 if save else 0)))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, q=q, nc=nc, k=k, seq=sq is not None, save=save),
      out_shape=tuple(out_shape), grid=(b, h), in_specs=in_specs, out_specs=tuple(out_specs),
      compiler_params=_params(), cost_estimate=cost, interpret=interpret,
      name="mixer_fused_gpu_save" if save else "mixer_fused_gpu")(*args)


# ----------------------------------------------------------------------------
# Backward, first kernel: the chunks in reverse; gate, SSD and SiLU gradients.


def _bwd_kernel(*refs, q, nc, k, seq):
  (z_ref, x_ref, f_ref, w_ref, bias_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, st_ref, dg_ref, dssq_ref,
   dfin_ref), rest = refs[:14], refs[14:]
  sq_ref = rest[0] if seq else None
  rest = rest[1:] if seq else rest
  rest = rest[2:]  # the zero-filled dB and dC inputs, aliased to their outputs
  dzx_ref, dpre_ref, ddt_ref, da_ref, dd_ref, db_ref, dc_ref, dinit_ref, dw_ref, dbias_ref = rest
  p = z_ref.shape[-1]
  cdt = z_ref.dtype
  masks = _masks(q)
  A = a_ref[...].astype(_F32)
  D = d_ref[...].astype(_F32)

  def body(i, carry):
    dstate, dws, dbias = carry
    z = nc - 1 - i
    rows = pl.ds(z * q, q)
    sq = sq_ref[rows] if seq else None
    doc_in = _bwd_doc_in(sq_ref, sq, z, q) if seq else 0
    pre, sig_pre, taps, xf = _prologue(x_ref, f_ref, w_ref, bias_ref, sq_ref, z, q, k, sq, cdt)
    dt = dt_ref[rows].astype(_F32)
    lmat, decay_in, w, through, _, _ = _chunk_terms(dt * A, *masks, sq, doc_in)
    bmat, cmat = b_ref[rows, :], c_ref[rows, :]
    state = st_ref[pl.ds(z * p, p), :]
    y, xdt, cb = ssd_gpu.chunk_out(xf, dt, bmat, cmat, state, lmat, decay_in, cdt)
    yc = (y + xf * D).astype(cdt).astype(_F32)
    zf = z_ref[rows, :].astype(_F32)
    sz, sig_z = _silu(zf)
    gated = yc * sz
    # The gate: gated = y silu(z), its squares' sum per row's group.
    dgat = dg_ref[rows, :].astype(_F32) + 2.0 * gated * dssq_ref[rows][:, None]
    dzx_ref[rows, :] = (dgat * yc * layer_math.dsilu(zf, sig_z)).astype(dzx_ref.dtype)
    dy = (dgat * sz).astype(cdt)
    dxdt, dd, da, db, dc, dstate_in = ssd_gpu.chunk_bwd(xf, dt, dy, bmat, cmat, state, dstate, xdt, cb,
                                                        (lmat, decay_in, w, through), masks, cdt)
    # The SSD's x in the compute dtype, so its cotangent is rounded there, as the plain form's.
    dxs = (dxdt * dt[:, None] + dy.astype(_F32) * D).astype(cdt).astype(_F32)
    dpre = dxs * layer_math.dsilu(pre, sig_pre)
    dpre_ref[rows, :] = dpre
    ddt_ref[rows] = jnp.sum(dxdt * xf, axis=1)
    da_ref[rows] = da
    dd_ref[rows] = dd
    pltriton.atomic_add(db_ref, (rows, slice(None)), db)
    pltriton.atomic_add(dc_ref, (rows, slice(None)), dc)
    dws = tuple(acc + jnp.sum(dpre * v, axis=0) for acc, v in zip(dws, taps))
    return dstate_in, dws, dbias + jnp.sum(dpre, axis=0)

  zero = jnp.zeros((p,), _F32)
  dstate, dws, dbias = jax.lax.fori_loop(0, nc, body, (dfin_ref[...].astype(_F32), (zero,) * k, zero))
  dinit_ref[...] = dstate
  for j in range(k):
    dw_ref[j, :] = dws[j]
  dbias_ref[...] = dbias


def _bwd_call(zx, fx, wx, bx, dt, A, B, C, D, st, dg, dssq, dfin, sq, q, interpret):
  b, L, two_i = zx.shape
  i = two_i // 2
  h, p, n = dfin.shape[1], dfin.shape[2], dfin.shape[3]
  g, k = B.shape[2], wx.shape[0]
  nc = L // q
  s = _specs(b, L, h, g, p, n, k)
  in_specs = [s["head"](0), s["head"](h), s["front"], s["taps"], s["chan"], s["rows"], s["scalar"], s["group"],
              s["group"], s["scalar"], pl.BlockSpec((None, None, nc * p, n), lambda bi, hi: (bi, hi, 0, 0)),
              s["head"](0), s["rows"], s["state"]]
  args = [zx, zx, fx, wx, bx, dt, A, B, C, D, st, dg, dssq, dfin]
  if sq is not None:
    in_specs.append(s["seq"])
    args.append(sq)
  zeros = jnp.zeros(B.shape, _F32)
  in_specs += [s["group"], s["group"]]
  args += [zeros, zeros]
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, _F32)
  out_shape = [jax.ShapeDtypeStruct(zx.shape, zx.dtype), f32((b, L, i)), f32(dt.shape), f32(dt.shape),
               f32(dt.shape), f32(B.shape), f32(B.shape), f32(dfin.shape), f32((b, h, k, p)), f32((b, h, p))]
  out_specs = [s["head"](0), s["head"](0), s["rows"], s["rows"], s["rows"], s["group"], s["group"], s["state"],
               pl.BlockSpec((None, None, k, p), lambda bi, hi: (bi, hi, 0, 0)),
               pl.BlockSpec((None, None, p), lambda bi, hi: (bi, hi, 0))]
  isz = jnp.dtype(zx.dtype).itemsize
  cost = pl.CostEstimate(
      # per head and chunk: `ssd_gpu`'s backward and its forward's recompute, the
      # conv's taps (recomputed) and weight sums, SiLU's and the gate's gradients.
      flops=int(b * h * nc * (4 * q ** 3 + 8 * q * q * n + 6 * q * q * p + 12 * q * n * p + 4 * p * n
                              + 40 * q * q + 40 * q * p + 4 * k * q * p)),
      transcendentals=int(b * h * nc * (q * q + 2 * q + 1 + 4 * q * p)),
      # z, x and the gated y's cotangent read, dz (compute dtype) and the conv's
      # pre-activation cotangent (float32) written; dt read and three rows written, the
      # squares' cotangent; B and C once per sequence and group, dB and dC's zeros read
      # and sums written once (as in `ssd_gpu`); the entering states read once.
      bytes_accessed=int(3 * b * L * i * isz + b * L * i * isz + 4 * b * L * i + 4 * dt.size * 4 + dssq.size * 4
                         + 2 * B.size * isz + 4 * B.size * 4 + st.size * 4 + 2 * dfin.size * 4
                         + fx.size * isz + 2 * (b * h * (k + 1) * p * 4) + (b * L * h * 4 if sq is not None else 0)))
  n_in = len(args)
  return pl.pallas_call(
      functools.partial(_bwd_kernel, q=q, nc=nc, k=k, seq=sq is not None),
      out_shape=tuple(out_shape), grid=(b, h), in_specs=in_specs, out_specs=tuple(out_specs),
      input_output_aliases={n_in - 2: 5, n_in - 1: 6}, compiler_params=_params(),
      cost_estimate=cost, interpret=interpret, name="mixer_fused_gpu_bwd")(*args)


# ----------------------------------------------------------------------------
# Backward, second kernel: the conv's transpose, into x's columns of dz|dx.


def _conv_t_kernel(*refs, q, nc, k, seq):
  dpre_ref, w_ref = refs[:2]
  sq_ref = refs[2] if seq else None
  out_ref = refs[-1]  # x's columns of dz|dx (aliased: the first kernel wrote z's)
  L = dpre_ref.shape[0]

  def body(z, carry):
    pos = z * q + jax.lax.broadcasted_iota(jnp.int32, (q,), 0)
    ids = sq_ref[pl.ds(z * q, q)] if seq else None
    acc = jnp.zeros((q, out_ref.shape[-1]), _F32)
    for j in range(k):  # tap j of the output at position t + s read this input
      s = k - 1 - j
      dst = pos + s
      v = dpre_ref[jnp.minimum(dst, L - 1), :]
      if s:
        ok = dst < L
        if seq:
          ok = ok & (sq_ref[jnp.minimum(dst, L - 1)] == ids)
        v = jnp.where(ok[:, None], v, 0.0)
      acc = acc + v * w_ref[j, :].astype(_F32)[None, :]
    out_ref[pl.ds(z * q, q), :] = acc.astype(out_ref.dtype)
    return carry

  jax.lax.fori_loop(0, nc, body, 0)


def _conv_t_call(dpre, wx, dzx, sq, q, interpret):
  b, L, i = dpre.shape
  k = wx.shape[0]
  p = min(i & -i, 64)  # the channels a program owns: a power of two dividing i
  nc = L // q
  chan = pl.BlockSpec((None, L, p), lambda bi, ci: (bi, 0, ci))
  in_specs = [chan, pl.BlockSpec((k, p), lambda bi, ci: (0, ci))]
  args = [dpre, wx]
  if sq is not None:
    in_specs.append(pl.BlockSpec((None, L), lambda bi, ci: (bi, 0)))
    args.append(sq)
  xcols = pl.BlockSpec((None, L, p), lambda bi, ci: (bi, 0, i // p + ci))
  in_specs.append(xcols)
  args.append(dzx)
  isz = jnp.dtype(dzx.dtype).itemsize
  cost = pl.CostEstimate(flops=int(3 * k * b * L * i), transcendentals=0,
                         bytes_accessed=int(4 * b * L * i + b * L * i * isz + wx.size * 4
                                            + (b * L * 4 * (i // p) if sq is not None else 0)))
  return pl.pallas_call(
      functools.partial(_conv_t_kernel, q=q, nc=nc, k=k, seq=sq is not None),
      out_shape=jax.ShapeDtypeStruct(dzx.shape, dzx.dtype), grid=(b, i // p), in_specs=in_specs,
      out_specs=xcols, input_output_aliases={len(args) - 1: 0}, compiler_params=_params(),
      cost_estimate=cost, interpret=interpret, name="mixer_fused_gpu_conv_t")(*args)


# ----------------------------------------------------------------------------
# The kernels' VJP, and the function with `mixer_core`'s signature.


def _primal(zx, fx, wx, bx, dt, A, bcs, D, h0, sq, q, interpret):
  B, C = _bc(bcs, zx.dtype)
  gated, ssq, fin = _fwd_call(zx, fx.astype(zx.dtype), wx, bx, dt, A, B, C, D, h0, sq, q, interpret)
  return gated, ssq, fin


def _bc(bcs, cdt):
  """B and C (b, L, g, n) in the compute dtype from the conv's (b, L, 2, g, n) float32 output."""
  return bcs[:, :, 0].astype(cdt), bcs[:, :, 1].astype(cdt)


def _core_fwd(zx, fx, wx, bx, dt, A, bcs, D, h0, sq, q, interpret):
  B, C = _bc(bcs, zx.dtype)
  gated, ssq, fin, st = _fwd_call(zx, fx.astype(zx.dtype), wx, bx, dt, A, B, C, D, h0, sq, q, interpret, save=True)
  gated, ssq = checkpoint_name(gated, SAVE_NAMES[0]), checkpoint_name(ssq, SAVE_NAMES[1])
  st, fin = checkpoint_name(st, SAVE_NAMES[2]), checkpoint_name(fin, SAVE_NAMES[3])
  return (gated, ssq, fin), (zx, fx, wx, bx, dt, A, bcs, D, st, sq)


def _core_bwd(q, interpret, res, ct):
  zx, fx, wx, bx, dt, A, bcs, D, st, sq = res
  dgated, dssq, dfin = ct
  B, C = _bc(bcs, zx.dtype)
  (dzx, dpre, ddt, da, dd, dB, dC, dinit, dw, dbias) = _bwd_call(
      zx, fx.astype(zx.dtype), wx, bx, dt, A, B, C, D, st, dgated.astype(zx.dtype), dssq.astype(_F32),
      dfin.astype(_F32), sq, q, interpret)
  dzx = _conv_t_call(dpre, wx, dzx, sq, q, interpret)
  b, k = zx.shape[0], wx.shape[0]
  i = zx.shape[2] // 2
  # The front's gradient: the taps of the first k - 1 outputs that read it.
  head = dpre[:, :k - 1]  # (b, k-1, i)
  ok = None if sq is None else (sq[:, :k - 1] == sq[:, :1])[..., None]
  dfx = []
  for r in range(k - 1):  # front row r is position r - (k-1); output t reads it through tap j = r - t + ... (t = r - j)
    acc = jnp.zeros((b, i), _F32)
    for j in range(r + 1):
      term = head[:, r - j] * wx[j]
      acc = acc + (term if ok is None else jnp.where(ok[:, r - j], term, 0.0))
    dfx.append(acc)
  dfx = jnp.stack(dfx, 1)
  ddt = ddt + da * A
  dA = jnp.sum(da * dt, axis=(0, 1))
  dbcs = jnp.stack([dB, dC], 2)
  return (dzx, dfx.astype(fx.dtype), dw.sum(0).transpose(1, 0, 2).reshape(k, i), dbias.sum(0).reshape(i), ddt, dA,
          dbcs, jnp.sum(dd, axis=(0, 1)), dinit, None)


# Two VJPs of the same rules. Under a remat that keeps none of the kernel's outputs
# (`keep_states` false), `optimize_remat`: the forward pass runs the kernel that writes no
# states, and the backward pass reruns the saving one. Where the remat keeps the states
# (or there is no remat), the forward pass runs the saving kernel once, and the
# backward pass no forward kernel.
_core = jax.custom_vjp(_primal, nondiff_argnums=(10, 11))
_core.defvjp(_core_fwd, _core_bwd, optimize_remat=True)
_core_kept = jax.custom_vjp(_primal, nondiff_argnums=(10, 11))
_core_kept.defvjp(_core_fwd, _core_bwd)


def mixer_core_gpu(zx, bc, dt_raw, w, chunk: int, *, ngroups: int, dt_limit=(0.0, float("inf")),
                   front_x=None, front_bc=None, initial_state=None, seq_idx=None, interpret: bool = False,
                   keep_states: bool = False):
  """`layer_math.mixer_core` as Pallas Triton kernels, forward and backward (see the module doc).
  keep_states: the remat keeps the forward's outputs and states (SAVE_NAMES), or there
  is no remat (`table.build` says): the forward pass then writes them once."""
  b, l, two_i = zx.shape
  i, h, g, k = two_i // 2, dt_raw.shape[-1], ngroups, w["conv_x"].shape[0]
  n = bc.shape[-1] // g
  q = ssd_gpu.kernel_chunk(chunk)
  # Only the first chunk's taps may read the front (whose document is that chunk's first).
  if not joins(i, h, g, n) or not 2 <= k <= q + 1:
    ssd = functools.partial(ssd_gpu.ssd_gpu, interpret=interpret)
    return layer_math.mixer_core(zx, bc, dt_raw, w, chunk, ngroups=ngroups, dt_limit=dt_limit, front_x=front_x,
                                 front_bc=front_bc, initial_state=initial_state, seq_idx=seq_idx, ssd=ssd)
  p, cd = i // h, zx.dtype
  L = -(-l // q) * q
  front_x = jnp.zeros((b, k - 1, i), cd) if front_x is None else front_x
  front_bc = jnp.zeros((b, k - 1, *bc.shape[2:]), cd) if front_bc is None else front_bc
  # B|C's conv + SiLU and dt in XLA (small: (b, l, 2 g n) and (b, l, h)), autodiff's gradients.
  bcs, _ = layer_math.causal_conv_silu(bc, w["conv_bc"], w["conv_bc_bias"], front_bc, seq_idx)
  dt = jax.nn.softplus(dt_raw.astype(_F32) + w["dt_bias"])
  lo, hi = dt_limit
  if lo > 0.0 or hi < float("inf"):
    dt = jnp.clip(dt, lo, hi)
  # Padding to whole chunks (none at the usual lengths): dt 0 there carries nothing.
  pad = lambda v, mode="constant": layer_math.pad_axis(v, 1, L, mode)
  bcs = pad(bcs.reshape(b, l, 2, g, n))
  h0 = jnp.zeros((b, h, p, n), _F32) if initial_state is None else initial_state.astype(_F32)
  D = jnp.zeros((h,), _F32) if w.get("D") is None else w["D"].astype(_F32)
  sq = None if seq_idx is None else pad(seq_idx.astype(jnp.int32), "edge")
  core = _core_kept if keep_states else _core
  gated, ssq, final = core(pad(zx), front_x, w["conv_x"].astype(_F32), w["conv_x_bias"].astype(_F32), pad(dt),
                            -jnp.exp(w["A_log"].astype(_F32)), bcs, D, h0, sq, q, interpret)
  ssq = ssq[:, :l].reshape(b, l, g, h // g).sum(-1)
  return gated[:, :l], ssq, final.astype(_F32)
