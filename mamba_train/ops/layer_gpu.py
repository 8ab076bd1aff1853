"""The Mamba-2 layer's elementwise chain as Pallas kernels for NVIDIA GPUs (Triton).

Two kernels, each with the arguments and results of its plain form in `layer_math`
(the reference, and what CPUs run), forward and backward (`jax.custom_vjp`):

- `causal_conv_silu_gpu`: the depthwise causal conv + bias + SiLU between in_proj and
  the SSD, reading in_proj's x (or B|C) output in its natural (b, l, c) layout;
- `gated_rms_norm_gpu`: y * silu(z), RMS over groups of i / g channels, times the
  weight, between the SSD and out_proj.

Why kernels: XLA splits each chain into several fusions whose float32 intermediates
(the conv's pre-activation, y * silu(z), the normalised rows) and backward reductions
(over rows for the conv's and norm's weights, over channels for the norm's mean)
cross HBM, and keeps some of them for the backward pass. Here each kernel reads its
inputs once and writes its outputs once; the backward recomputes what the forward did
not keep (the pre-activation, the row's RMS) from the same inputs instead of storing
it: fewer bytes a layer in XLA's count, and a much smaller step's memory without remat
(docs/bench/gpu.md). The kernels' boundaries are the
layer's: in_proj | conv + SiLU | SSD | gate + norm | out_proj, the boundaries a Mosaic
TPU lowering would keep (where it might fuse further into the SSD kernel instead).

Numerics as the plain forms: float32 arithmetic inside, the result in the input's
dtype (the compute dtype the SSD and out_proj read: the plain forms' float32 result
is rounded there once too). Reductions over rows (the conv's weight and bias, the
norm's weight) are per-program float32 partial sums added in XLA, so they do not
depend on the order programs run in.

Triton's rules: every block a power of two; the wrappers pad channels and positions
with zeros where the shapes are not (none at the released sizes), as `ssd_gpu` does.
No shifted read starts before a buffer: the conv reads its inputs joined behind the
front (the k-1 positions before), in one XLA fusion with in_proj's output slice,
and its backward reads only forward (positions past the end masked). `interpret=True`
runs the kernels in Pallas' interpreter on any backend (the CPU tests). Imports of
the package: its reference forms only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mamba_train.ops.layer_math import causal_conv_silu, dsilu, pad_axis

_F32 = jnp.float32

# The conv: a program owns CONV_BLOCKS blocks of CONV_ROWS positions of one sequence
# and CONV_CHANNELS channels, and walks them in order, so its weight and bias
# gradients are one partial sum per 256 positions (not per block: 4x fewer partial
# bytes). A (64, 128) float32 tile is 32 registers a thread at 8 warps. Not autotuned
# (no device here): benchmarks/gpu.sh times the kernels on a lent GPU.
CONV_ROWS = 64
CONV_BLOCKS = 4
CONV_CHANNELS = 128
# The norm: a program owns NORM_ROWS rows of one group and walks them one at a time
# (a 1.3b row is 4096 channels: 16 float32 a thread at 8 warps).
NORM_ROWS = 16
NUM_WARPS = 8
# Names a remat policy can save ('save_matmuls' with the layers unrolled: `table.build`):
# the conv's activation (the SSD's input, which its backward kernel reads) and the
# norm's output (out_proj's input, which its weight's gradient reads), so the backward
# pass runs neither forward kernel again (docs/bench/gpu.md).
SAVE_NAMES = ("layer_gpu_conv", "layer_gpu_norm")


def _pow2_ceil(v: int) -> int:
  return 1 << max(v - 1, 0).bit_length()


def _params():
  return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


# ----------------------------------------------------------------------------
# Causal conv + bias + SiLU. xp = [front, x] (b, L + k - 1, C): output position t
# reads xp[t + j] for tap j (position t - (k-1-j) of x); ids = the document ids of
# xp's positions (ok_j[t]: xp[t + j] is in t's document, ids[t + k - 1]).


def _conv_rows(xp_ref, ids_ref, w_ref, b_ref, r0, *, k, t, n_in, seq):
  """The pre-activation a at output positions [r0, r0 + t) (t, bc) float32, and
  the tap masks ok_j (t, 1) (None without documents). Reads past xp's end (only the
  backward's shifted rows ask for them) are masked to zero."""
  iota = r0 + jax.lax.broadcasted_iota(jnp.int32, (t, 1), 0)
  load = lambda ref, j: pltriton.load(ref.at[pl.ds(r0 + j, t), :], mask=iota + j < n_in, other=0)
  a = b_ref[...].astype(_F32)[None, :]
  oks = []
  own = load(ids_ref, k - 1) if seq else None
  for j in range(k):
    tap = load(xp_ref, j).astype(_F32) * w_ref[pl.ds(j, 1), :].astype(_F32)
    if seq and j < k - 1:
      ok = load(ids_ref, j) == own
      oks.append(ok)
      tap = jnp.where(ok, tap, 0.0)
    a = a + tap
  return a, oks


def _with_ids(refs, seq):
  """The refs with None in the document ids' place when there are none."""
  return refs if seq else (refs[0], None, *refs[1:])


def _conv_fwd_kernel(*refs, k, t, nb, n_in, seq):
  xp_ref, ids_ref, w_ref, b_ref, y_ref = _with_ids(refs, seq)
  s = pl.program_id(1)

  def body(i, carry):
    a, _ = _conv_rows(xp_ref, ids_ref, w_ref, b_ref, (s * nb + i) * t, k=k, t=t, n_in=n_in, seq=seq)
    y_ref[pl.ds(i * t, t), :] = (a * jax.nn.sigmoid(a)).astype(y_ref.dtype)
    return carry

  jax.lax.fori_loop(0, nb, body, 0)


def _conv_bwd_kernel(*refs, k, t, nb, n_in, n_out, seq):
  """dx[t] = sum_j w_j ok_j[r] da[r] at r = t + k-1-j (the output positions that read
  x[t]; past the end, none), da = dy silu'(a); dw_j = sum_t da[t] ok_j[t] xp[t + j],
  db = sum_t da[t], over this program's positions."""
  xp_ref, ids_ref, w_ref, b_ref, dy_ref, dx_ref, dw_ref, db_ref = _with_ids(refs, seq)
  s = pl.program_id(1)
  bc = dx_ref.shape[-1]

  def da_at(r0):
    a, oks = _conv_rows(xp_ref, ids_ref, w_ref, b_ref, r0, k=k, t=t, n_in=n_in, seq=seq)
    iota = r0 + jax.lax.broadcasted_iota(jnp.int32, (t, 1), 0)
    dy = pltriton.load(dy_ref.at[pl.ds(r0, t), :], mask=iota < n_out, other=0).astype(_F32)
    return dy * dsilu(a, jax.nn.sigmoid(a)), oks

  def body(i, carry):
    dws, db = carry
    t0 = (s * nb + i) * t
    dx = jnp.zeros((t, bc), _F32)
    for j in range(k):
      da, oks = da_at(t0 + k - 1 - j)
      if seq and j < k - 1:
        da = jnp.where(oks[j], da, 0.0)
      dx = dx + da * w_ref[pl.ds(j, 1), :].astype(_F32)
      if j == k - 1:  # the unshifted rows: this program's share of dw and db
        da0, oks0 = da, oks
    new_dws = []
    for j in range(k):
      tap = xp_ref[pl.ds(t0 + j, t), :].astype(_F32) * da0
      if seq and j < k - 1:
        tap = jnp.where(oks0[j], tap, 0.0)
      new_dws.append(dws[j] + jnp.sum(tap, axis=0, keepdims=True))
    dx_ref[pl.ds(i * t, t), :] = dx.astype(dx_ref.dtype)
    return tuple(new_dws), db + jnp.sum(da0, axis=0, keepdims=True)

  zero = jnp.zeros((1, bc), _F32)
  dws, db = jax.lax.fori_loop(0, nb, body, (tuple(zero for _ in range(k)), zero))
  for j in range(k):
    dw_ref[pl.ds(j, 1), :] = dws[j]
  db_ref[...] = db


def _conv_tiles(l: int, c: int) -> tuple[int, int, int, int]:
  """(positions a block, blocks a program, padded length, channels a block)."""
  t = CONV_ROWS
  nb = min(CONV_BLOCKS, -(-l // t))
  span = t * nb
  return t, nb, -(-l // span) * span, min(CONV_CHANNELS, _pow2_ceil(c))


def _conv_specs(b, L, C, k, t, nb, bc):
  n_in = L + k - 1
  whole = pl.BlockSpec((None, n_in, bc), lambda bi, si, ci: (bi, 0, ci))  # xp, read at shifts
  ids = pl.BlockSpec((None, n_in, 1), lambda bi, si, ci: (bi, 0, 0))
  w = pl.BlockSpec((k, bc), lambda bi, si, ci: (0, ci))
  bias = pl.BlockSpec((bc,), lambda bi, si, ci: (ci,))
  own = pl.BlockSpec((None, t * nb, bc), lambda bi, si, ci: (bi, si, ci))  # y, dx
  return whole, ids, w, bias, own


def _ids_bytes(ids, reads: int) -> int:
  return 0 if ids is None else ids.size * 4 * reads


def _drop_ids(specs, args):
  """The call's specs and operands without the document ids' when there are none."""
  keep = [i for i, a in enumerate(args) if not (i == 1 and a is None)]
  return [specs[i] for i in keep], [args[i] for i in keep]


def _conv_fwd_call(xp, ids, w, bias, k, interpret):
  b, n_in, C = xp.shape
  L = n_in - k + 1
  t, nb, _, bc = _conv_tiles(L, C)
  whole, ids_spec, w_spec, b_spec, own = _conv_specs(b, L, C, k, t, nb, bc)
  isz = jnp.dtype(xp.dtype).itemsize
  cost = pl.CostEstimate(
      # k multiply-adds, a masked select and the SiLU (~6 ops) per output
      flops=int(b * L * C * (3 * k + 6)), transcendentals=int(b * L * C),
      # xp read once (the shifted reads of a block's k-1 extra rows hit L1/L2), y
      # written once; the document ids once per channel block (L2)
      bytes_accessed=int(xp.size * isz + b * L * C * isz + _ids_bytes(ids, C // bc)))
  specs, args = _drop_ids([whole, ids_spec, w_spec, b_spec], [xp, ids, w, bias])
  return pl.pallas_call(
      functools.partial(_conv_fwd_kernel, k=k, t=t, nb=nb, n_in=n_in, seq=ids is not None),
      out_shape=jax.ShapeDtypeStruct((b, L, C), xp.dtype), grid=(b, L // (t * nb), C // bc),
      in_specs=specs, out_specs=own, compiler_params=_params(),
      cost_estimate=cost, interpret=interpret, name="conv_silu_gpu_fwd")(*args)


def _conv_bwd_call(xp, ids, w, bias, dy, k, interpret):
  b, n_in, C = xp.shape
  L = n_in - k + 1
  t, nb, _, bc = _conv_tiles(L, C)
  whole, ids_spec, w_spec, b_spec, own = _conv_specs(b, L, C, k, t, nb, bc)
  dy_spec = pl.BlockSpec((None, L, bc), lambda bi, si, ci: (bi, 0, ci))  # read at shifts
  ns = L // (t * nb)
  out_shape = (jax.ShapeDtypeStruct((b, L, C), xp.dtype), jax.ShapeDtypeStruct((b, ns, k, C), _F32),
               jax.ShapeDtypeStruct((b, ns, 1, C), _F32))
  out_specs = (own, pl.BlockSpec((None, None, k, bc), lambda bi, si, ci: (bi, si, 0, ci)),
               pl.BlockSpec((None, None, 1, bc), lambda bi, si, ci: (bi, si, 0, ci)))
  isz = jnp.dtype(xp.dtype).itemsize
  cost = pl.CostEstimate(
      # the pre-activation at k shifts (k taps each), SiLU's derivative, the k taps of
      # dx and of dw
      flops=int(b * L * C * (k * (3 * k + 10) + 4 * k)), transcendentals=int(b * L * C * k),
      # xp and dy read once (the shifted re-reads from L1/L2), dx written once, the
      # partial sums of dw and db written once, the ids once per channel block
      bytes_accessed=int(xp.size * isz + dy.size * jnp.dtype(dy.dtype).itemsize + b * L * C * isz
                         + b * ns * (k + 1) * C * 4 + _ids_bytes(ids, C // bc)))
  specs, args = _drop_ids([whole, ids_spec, w_spec, b_spec, dy_spec], [xp, ids, w, bias, dy])
  return pl.pallas_call(
      functools.partial(_conv_bwd_kernel, k=k, t=t, nb=nb, n_in=n_in, n_out=L, seq=ids is not None),
      out_shape=out_shape, grid=(b, ns, C // bc),
      in_specs=specs, out_specs=out_specs, compiler_params=_params(),
      cost_estimate=cost, interpret=interpret, name="conv_silu_gpu_bwd")(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _conv(x, front, w, bias, ids, k, interpret):
  xp = jnp.concatenate([front.astype(x.dtype), x], axis=1)
  return _conv_fwd_call(xp, ids, w, bias, k, interpret)


def _conv_fwd(x, front, w, bias, ids, k, interpret):
  y = checkpoint_name(_conv(x, front, w, bias, ids, k, interpret), SAVE_NAMES[0])
  return y, (x, front, w, bias, ids)


def _conv_bwd(k, interpret, res, dy):
  x, front, w, bias, ids = res
  xp = jnp.concatenate([front.astype(x.dtype), x], axis=1)
  dx, dw, db = _conv_bwd_call(xp, ids, w, bias, dy, k, interpret)
  # The front feeds only the first k-1 outputs: its cotangent from the plain form
  # over those (a (b, k-1, C) sliver), rather than a kernel path of its own.
  head = min(k - 1, x.shape[1])
  seq = None if ids is None else ids[:, k - 1:k - 1 + head, 0]
  front_ids = None if ids is None else ids[:, :k - 1, 0]
  _, vjp = jax.vjp(lambda f: causal_conv_silu(x[:, :head], w, bias, f, seq, front_ids)[0], front)
  dfront, = vjp(dy[:, :head].astype(_F32))
  return dx, dfront, jnp.sum(dw, axis=(0, 1)).astype(w.dtype), jnp.sum(db, axis=(0, 1, 2)).astype(bias.dtype), None


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv_silu_gpu(x, w, bias, front, seq_idx=None, front_idx=None, *, interpret: bool = False):
  """`layer_math.causal_conv_silu` as a Pallas Triton kernel: its arguments and shapes; the
  activation in x's dtype (float32 inside) and the new front (float32)."""
  b, l = x.shape[:2]
  chan = x.shape[2:]
  k = w.shape[0]
  C = math.prod(chan)
  t, nb, L, bc = _conv_tiles(l, C)
  Cp = -(-C // bc) * bc
  # Padding (none at the released sizes): positions after the end and zero channels.
  xk = pad_axis(pad_axis(x.reshape(b, l, C), 1, L), 2, Cp)
  fk = pad_axis(front.reshape(b, k - 1, C), 2, Cp)
  wk = pad_axis(w.reshape(k, C).astype(_F32), 1, Cp)
  bk = pad_axis(bias.reshape(C).astype(_F32), 0, Cp)
  ids = None
  if seq_idx is not None:
    if front_idx is None:
      front_idx = jnp.repeat(seq_idx[:, :1], k - 1, axis=1)
    # (b, L + k - 1, 1): a trailing axis of one keeps the loads two-dimensional
    ids = pad_axis(jnp.concatenate([front_idx, seq_idx], axis=1).astype(jnp.int32), 1, L + k - 1,
                  mode="edge")[..., None]
  y = _conv(xk, fk, wk, bk, ids, k, interpret)[:, :l, :C].reshape(x.shape)
  # The new front: the last k-1 inputs (of the front, too, when l < k - 1).
  tail = x[:, l - (k - 1):] if l >= k - 1 else jnp.concatenate([front.astype(x.dtype), x], 1)[:, l:]
  return y, tail.astype(_F32)


# ----------------------------------------------------------------------------
# Gated RMSNorm: rows (b l) of i channels in g groups of G; a program owns NORM_ROWS
# rows of one group.


def _norm_fwd_kernel(y_ref, z_ref, w_ref, o_ref, *, rows, G, eps):
  w = w_ref[...].astype(_F32)[None, :]

  def body(r, carry):
    y = y_ref[pl.ds(r, 1), :].astype(_F32)
    z = z_ref[pl.ds(r, 1), :].astype(_F32)
    x = y * z * jax.nn.sigmoid(z)
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / G + eps)
    o_ref[pl.ds(r, 1), :] = (x * rstd * w).astype(o_ref.dtype)
    return carry

  jax.lax.fori_loop(0, rows, body, 0)


def _norm_bwd_kernel(y_ref, z_ref, w_ref, do_ref, dy_ref, dz_ref, dw_ref, *, rows, G, eps):
  """out = x r w, x = y silu(z), r = rsqrt(mean(x^2) + eps): dw += do x r;
  dx = r (g - x r mean(g x r)) with g = do w; dy = dx silu(z); dz = dx y silu'(z).
  r is recomputed from the row (the forward keeps nothing)."""
  w = w_ref[...].astype(_F32)[None, :]

  def body(r, dw):
    y = y_ref[pl.ds(r, 1), :].astype(_F32)
    z = z_ref[pl.ds(r, 1), :].astype(_F32)
    sig = jax.nn.sigmoid(z)
    x = y * z * sig
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / G + eps)
    xn = x * rstd
    do = do_ref[pl.ds(r, 1), :].astype(_F32)
    g = do * w
    dx = rstd * (g - xn * (jnp.sum(g * xn, axis=1, keepdims=True) / G))
    dy_ref[pl.ds(r, 1), :] = (dx * z * sig).astype(dy_ref.dtype)
    dz_ref[pl.ds(r, 1), :] = (dx * y * dsilu(z, sig)).astype(dz_ref.dtype)
    return dw + do * xn

  dw_ref[...] = jax.lax.fori_loop(0, rows, body, jnp.zeros((1, w_ref.shape[-1]), _F32))


def _norm_specs(Gp, rows):
  row = pl.BlockSpec((rows, Gp), lambda ri, gi: (ri, gi))
  return row, pl.BlockSpec((Gp,), lambda ri, gi: (gi,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _norm(y, z, w, groups, G, eps, interpret):
  return _norm_call(y, z, w, groups, G, eps, interpret)


def _norm_call(y, z, w, groups, G, eps, interpret):
  # z: (R, Ip), or wider (in_proj's joined z|x|B|C output): its first Ip channels
  # are the gate, which the blocks' index map reads in place.
  R, Ip = y.shape
  Gp = Ip // groups
  row, wspec = _norm_specs(Gp, NORM_ROWS)
  isz = jnp.dtype(y.dtype).itemsize
  cost = pl.CostEstimate(
      flops=int(R * Ip * 8), transcendentals=int(R * Ip + R * groups),
      bytes_accessed=int(y.size * isz + R * Ip * jnp.dtype(z.dtype).itemsize + R * Ip * isz + w.size * 4))
  return pl.pallas_call(
      functools.partial(_norm_fwd_kernel, rows=NORM_ROWS, G=G, eps=eps),
      out_shape=jax.ShapeDtypeStruct((R, Ip), y.dtype), grid=(R // NORM_ROWS, groups),
      in_specs=[row, row, wspec], out_specs=row, compiler_params=_params(), cost_estimate=cost,
      interpret=interpret, name="gated_norm_gpu_fwd")(y, z, w)


def _norm_fwd(y, z, w, groups, G, eps, interpret):
  out = checkpoint_name(_norm_call(y, z, w, groups, G, eps, interpret), SAVE_NAMES[1])
  return out, (y, z, w)


def _norm_bwd(groups, G, eps, interpret, res, do):
  y, z, w = res
  R, Ip = y.shape
  Gp = Ip // groups
  row, wspec = _norm_specs(Gp, NORM_ROWS)
  nr = R // NORM_ROWS
  ysz, zsz = jnp.dtype(y.dtype).itemsize, jnp.dtype(z.dtype).itemsize
  cost = pl.CostEstimate(
      flops=int(R * Ip * 24), transcendentals=int(R * Ip + R * groups),
      # y, z and the output's cotangent read once, dy and dz written once, the
      # weight's partial sums (one row per program) written once
      bytes_accessed=int(2 * y.size * ysz + 2 * R * Ip * zsz + do.size * jnp.dtype(do.dtype).itemsize
                         + nr * Ip * 4 + w.size * 4))
  dy, dz, dw = pl.pallas_call(
      functools.partial(_norm_bwd_kernel, rows=NORM_ROWS, G=G, eps=eps),
      out_shape=(jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(y.shape, z.dtype),
                 jax.ShapeDtypeStruct((nr, Ip), _F32)),
      grid=(nr, groups), in_specs=[row, row, wspec, row],
      out_specs=(row, row, pl.BlockSpec((1, Gp), lambda ri, gi: (ri, gi))), compiler_params=_params(),
      cost_estimate=cost, interpret=interpret, name="gated_norm_gpu_bwd")(y, z, w, do)
  if z.shape[1] > Ip:  # a joined z: zeros for the channels past the gate (XLA adds them into
    dz = jnp.pad(dz, ((0, 0), (0, z.shape[1] - Ip)))  # the joined cotangent's one fusion)
  return dy, dz, jnp.sum(dw, axis=0).astype(w.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


def gated_rms_norm_gpu(y, z, weight, groups, eps, *, interpret: bool = False):
  """`layer_math.gated_rms_norm` as a Pallas Triton kernel: same arguments; the
  result in the dtype of y and z together (the compute dtype out_proj multiplies
  in), float32 inside. y: (..., i); weight: (i,); z: (..., i), or wider with the gate
  its first i channels: in_proj's joined z|x|B|C output (`Ops.norm_gate_joined`),
  which the kernels then read in place where no padding is needed (a group a power
  of two, whole blocks of rows) instead of a slice XLA would copy out for them, in
  the forward pass and again in the backward's (docs/bench/gpu.md); its
  gradient is zero past the gate."""
  i = y.shape[-1]
  if i % groups:
    raise ValueError(f"d_inner ({i}) must be a multiple of groups ({groups})")
  if z.shape[:-1] != y.shape[:-1] or z.shape[-1] < i:
    raise ValueError(f"z {z.shape} must be y's shape {y.shape} or wider in its last axis")
  G = i // groups
  Gp = max(16, _pow2_ceil(G))
  dt = jnp.promote_types(y.dtype, z.dtype)
  lead = y.shape[:-1]
  R = 1
  for d in lead:
    R *= d
  Rp = -(-R // NORM_ROWS) * NORM_ROWS
  if z.shape[-1] > i:
    if Gp == G and Rp == R and z.dtype == dt:
      wk = weight.astype(_F32)
      out = _norm(y.astype(dt).reshape(R, i), z.reshape(R, z.shape[-1]), wk, groups, G, float(eps), interpret)
      return out.reshape(*lead, i)
    z = z[..., :i]
  # Padding (none at the released sizes): zero channels add nothing to a group's
  # sum of squares (the mean divides by G), zero rows are dropped.
  prep = lambda a: pad_axis(pad_axis(a.astype(dt).reshape(R, groups, G), 2, Gp).reshape(R, groups * Gp), 0, Rp)
  wk = pad_axis(weight.astype(_F32).reshape(groups, G), 1, Gp).reshape(groups * Gp)
  out = _norm(prep(y), prep(z), wk, groups, G, float(eps), interpret)
  return out[:R].reshape(R, groups, Gp)[..., :G].reshape(*lead, i)
