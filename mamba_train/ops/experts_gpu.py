"""The routed experts' grouped matmuls by tokamax's ragged dot (its Pallas Triton
kernels: NVIDIA GPUs from sm_80, the optional `gpu` extra), where XLA's GPU compiler
turns `jax.lax.ragged_dot` into a dense product over every local expert
(docs/bench/moe.md). Same arguments and result as `experts.expert_mlp_xla`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mamba_train.ops.experts import grouped, split_gate


def import_tokamax():
  """tokamax, imported on first use (it is the optional `gpu` extra; CPU and TPU
  runs never import it), or an ImportError that says how to get it or do without."""
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except Exception as err:  # noqa: BLE001 - a missing or broken (another jax) install alike
    raise ImportError(f"moe_impl='tokamax' needs tokamax (pip install 'mamba_train[gpu]'), which does not "
                      f"import here ({type(err).__name__}: {err}); use moe_impl='xla'") from err
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


@jax.custom_vjp
def _no_grad_for_empty(w, sizes):
  """w, whose gradient is zeroed for the groups with no rows. tokamax 0.0.12's Triton
  weight gradient (`_ragged_contracting_dim_dot_kernel`) runs its masked last step
  even for an empty group, at rows lo - block .. lo, so an empty expert would get a
  gradient from the rows before it (read from its source; no GPU here to show it).
  The identity forward costs nothing; backward a select over the gradient."""
  del sizes
  return w


def _no_grad_fwd(w, sizes):
  return w, sizes


def _no_grad_bwd(sizes, g):
  return jnp.where((sizes > 0)[:, None, None], g, jnp.zeros((), g.dtype)), None


_no_grad_for_empty.defvjp(_no_grad_fwd, _no_grad_bwd)


def expert_mlp_tokamax(rows, up, down, sizes, cd):
  """`experts.expert_mlp_xla` by tokamax's ragged dot, its Triton kernels (any NVIDIA GPU from
  sm_80; forward a grouped matmul, backward the same kernel on the transposed
  weights for the rows and a ragged contraction per group for the weights;
  `_tokamax_implementation`). Triton before tokamax's Mosaic GPU kernel, its own
  first choice: that one's configuration is chosen from the live device's compute
  capability, so an ahead-of-time compile on a host without the GPU is refused
  (tokamax 0.0.12). tokamax refuses to lower for a default device that is no GPU,
  forward and backward: an ahead-of-time compile lowers under
  `tokamax.config.cross_compile(True)` (tools/aot.py)."""
  tokamax = import_tokamax()
  gate, up = split_gate(up)
  sizes = sizes.astype(jnp.int32)
  impl = TOKAMAX_IMPLEMENTATION or _tokamax_implementation()
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    # tokamax reads its options as absl flags, and with none parsed it parses
    # sys.argv, which outside an absl program (pytest, a notebook) holds foreign
    # flags and raises: its options then keep their defaults.
    flags.FLAGS.mark_as_parsed()
  # Results in the compute dtype (float32 accumulation inside): the gradients flowing
  # back into the backward kernels are then in it too, and a bfloat16 run's backward
  # products run at the bfloat16 rate, not at float32's with bfloat16 weights. The
  # rows leave in it (`grouped` widens only the hidden units for the activation): the
  # dispatch carries them in bfloat16 to the weighted sum, the same values as widened
  # here, at half the bytes (docs/bench/moe.md, "One MoE layer's bytes").
  gmm = lambda a, w: tokamax.ragged_dot(a, _no_grad_for_empty(w, sizes), sizes, preferred_element_type=cd,
                                        implementation=impl)

  return grouped(rows, up, gate, down, sizes, cd, gmm, TOKAMAX_ROW_PAD)
