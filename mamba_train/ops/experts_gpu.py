"""The routed experts' grouped matmuls by tokamax's ragged dot (its Pallas Triton
kernels: NVIDIA GPUs from sm_80, the optional `gpu` extra), where XLA's GPU compiler
turns `jax.lax.ragged_dot` into a dense product over every local expert
(docs/bench/moe.md). Same arguments and result as `experts.expert_mlp_xla`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mamba_train.ops.experts import grouped, split_gate


def import_tokamax():
  """tokamax, imported on first use (it is the optional `gpu` extra; CPU and TPU
  runs never import it), or an ImportError that says how to get it or do without; its
  absl options readable outside an absl program."""
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except Exception as err:  # noqa: BLE001 - a missing or broken (another jax) install alike
    raise ImportError(f"moe_impl='tokamax' (or attention='tokamax') needs tokamax (pip install "
                      f"'mamba_train[gpu]'), which does not import here ({type(err).__name__}: {err}); "
                      f"use moe_impl='xla' (attention='xla', or 'cudnn' on a GPU)") from err
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    # tokamax reads its options as absl flags, and with none parsed it parses
    # sys.argv, which outside an absl program (pytest, a notebook) holds foreign
    # flags and raises: its options then keep their defaults.
    flags.FLAGS.mark_as_parsed()
  return tokamax


# Which of tokamax's implementations `moe_impl='tokamax'` runs; None: `_tokamax_implementation`.
TOKAMAX_IMPLEMENTATION = None


def _tokamax_implementation():
  """'triton' where tokamax registered it, else 'mosaic'. tokamax 0.0.12 (the last for
  Python 3.11, jax 0.10) has it in Pallas Triton, always registered; from 0.0.17 (jax
  0.11+) it is a jax_triton kernel, registered only with tokamax's `cuda` extra
  (triton, jax-triton), and without it Mosaic GPU (sm_80+) is tokamax's GPU kernel.
  Asked for by name either way: tokamax's own default order ends in XLA's
  ragged_dot, which it would take silently, the dense lowering this replaces."""
  try:
    from tokamax._src.ops.ragged_dot import api  # pylint: disable=import-outside-toplevel
    registered = api.IMPLEMENTATIONS
  except (ImportError, AttributeError):  # another layout: ask for triton, which names itself if absent
    return "triton"
  return "triton" if "triton" in registered else "mosaic"

# tokamax's Triton ragged dot reads a block of up to 128 rows from each group's start
# without a bounds check on rows (its store is masked): this many rows past the last
# keep the reads of a group ending near the last row inside the array.
TOKAMAX_ROW_PAD = 128


# The rows' gradient, d_rows = d_out @ w^T per expert, by `_rows_grad`'s kernel, which reads
# each expert's (k, n) weight as stored; tokamax's backward asks its kernel for w^T, which
# XLA writes out (bfloat16 copies of every expert weight a layer: the cast's transposed
# outputs, their transposes back for full remat's recompute, the down weights' in the
# backward; docs/bench/moe.md, "The parameter norm from the guard's pass, and the experts'
# rows' gradient without transposed weights"). INTERPRET: run it in Pallas' interpreter (the CPU tests).
INTERPRET = False
_DOT_DIMS = 16  # a Triton dot's smallest side: shapes with a width not a multiple keep tokamax's path


def _block(d: int) -> int:
  return next(b for b in (128, 64, 32, 16) if d % b == 0)


def _rows_grad_kernel(lo_ref, hi_ref, g_ref, w_ref, o_ref, *, block_m, block_k, block_n, n, precision):
  """One (block_m, block_k) tile of one expert's rows' gradient: d_out's rows of the
  expert (masked to [lo, hi)) against the expert's weight rows k, contracted over n."""
  i, j, e = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # outside the pl.when: the interpreter
  lo, hi = lo_ref[e], hi_ref[e]
  start = lo + i * block_m

  @pl.when(start < hi)
  def _():
    rows = start + jnp.arange(block_m)
    live = (rows < hi)[:, None]

    def body(t, acc):
      cols = pl.ds(pl.multiple_of(t * block_n, block_n), block_n)
      g = pltriton.load(g_ref.at[pl.ds(start, block_m), cols], mask=live, other=0)
      w = w_ref[e, pl.ds(pl.multiple_of(j * block_k, block_k), block_k), cols]
      return acc + pltriton.dot(g.astype(w.dtype), w, trans_b=True, precision=precision)

    acc = jax.lax.fori_loop(0, n // block_n, body, jnp.zeros((block_m, block_k), jnp.float32))
    pltriton.store(o_ref.at[pl.ds(start, block_m), pl.ds(pl.multiple_of(j * block_k, block_k), block_k)],
                   acc.astype(o_ref.dtype), mask=live)


def _rows_grad(g, w, sizes, dtype, block_m: int = 64):
  """(m, n) d_out, (e, k, n) weights, (e,) rows per expert -> (m, k) `dtype`: each expert's
  rows times its weight transposed, float32 accumulation; rows past sum(sizes) unwritten
  (as tokamax's). A block of rows reads up to block_m - 1 rows past its expert's last
  (masked): `grouped` pads the rows by TOKAMAX_ROW_PAD >= block_m."""
  m, n = g.shape
  e, k, _ = w.shape
  ends = jnp.cumsum(sizes.astype(jnp.int32))
  starts = ends - sizes.astype(jnp.int32)
  block_k, block_n = _block(k), _block(n)
  precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
  kernel = functools.partial(_rows_grad_kernel, block_m=block_m, block_k=block_k, block_n=block_n, n=n,
                             precision=precision)
  size = lambda x, d=None: x.size * jnp.dtype(d or x.dtype).itemsize
  cost = pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                         bytes_accessed=size(g) + size(w) + m * k * jnp.dtype(dtype).itemsize)
  whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((m, k), dtype),
      in_specs=[whole((e,)), whole((e,)), whole((m, n)), whole((e, k, n))], out_specs=whole((m, k)),
      grid=(pl.cdiv(m, block_m), k // block_k, e),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
      cost_estimate=cost, interpret=INTERPRET, name="experts_rows_grad")(starts, ends, g, w)


# The weights' gradient: tokamax's ragged contraction, (m, k)^T x (m, n) -> (e, k, n).
_CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(a, w, sizes, cd, impl):
  """tokamax's ragged dot, a (m, k) x w (e, k, n) -> (m, n) in `cd`, with the backward below."""
  return import_tokamax().ragged_dot(a, w, sizes, preferred_element_type=cd, implementation=impl)


def _gmm_fwd(a, w, sizes, cd, impl):
  return _gmm(a, w, sizes, cd, impl), (a, w, sizes)


def _gmm_bwd(cd, impl, res, g):
  """The rows' gradient by `_rows_grad` (tokamax's transposed path where the widths do not
  fit its tiles); the weights' by tokamax's ragged contraction, zeroed for experts with no
  rows: tokamax 0.0.12's Triton weight gradient (`_ragged_contracting_dim_dot_kernel`)
  runs its masked last step even for an empty group, at rows lo - block .. lo, so an
  empty expert would get a gradient from the rows before it (read from its source)."""
  del cd
  a, w, sizes = res
  tokamax = import_tokamax()
  if w.shape[1] % _DOT_DIMS == 0 and w.shape[2] % _DOT_DIMS == 0:
    da = _rows_grad(g, w, sizes, a.dtype)
  else:
    da = tokamax.ragged_dot(g, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=a.dtype, implementation=impl)
  dw = tokamax.ragged_dot_general(a, g, sizes, _CONTRACT_ROWS,
                                  preferred_element_type=w.dtype, implementation=impl)
  dw = jnp.where((sizes > 0)[:, None, None], dw, jnp.zeros((), dw.dtype))
  return da, dw, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def expert_mlp_tokamax(rows, up, down, sizes, cd):
  """`experts.expert_mlp_xla` by tokamax's ragged dot, its Triton kernels (any NVIDIA GPU from
  sm_80; forward a grouped matmul, backward a ragged contraction per group for the
  weights and our `_rows_grad` for the rows; `_tokamax_implementation`). Triton before
  tokamax's Mosaic GPU kernel, its own first choice: that one's configuration is
  chosen from the live device's compute capability, so an ahead-of-time compile on a
  host without the GPU is refused (tokamax 0.0.12). tokamax refuses to lower for a default device that is no GPU,
  forward and backward: an ahead-of-time compile lowers under
  `tokamax.config.cross_compile(True)` (tools/aot.py)."""
  import_tokamax()  # its ImportError, before anything is traced
  gate, up = split_gate(up)
  sizes = sizes.astype(jnp.int32)
  impl = TOKAMAX_IMPLEMENTATION or _tokamax_implementation()
  # Results in the compute dtype (float32 accumulation inside): the gradients flowing
  # back into the backward kernels are then in it too, and a bfloat16 run's backward
  # products run at the bfloat16 rate, not at float32's with bfloat16 weights. The
  # rows leave in it (`grouped` widens only the hidden units for the activation): the
  # dispatch carries them in bfloat16 to the weighted sum, the same values as widened
  # here, at half the bytes (docs/bench/moe.md, "One MoE layer's bytes").
  gmm = lambda a, w: _gmm(a, w, sizes, cd, impl)

  return grouped(rows, up, gate, down, sizes, cd, gmm, TOKAMAX_ROW_PAD)
