"""The routed experts' grouped matmuls by megablox, JAX's Pallas TPU grouped matmul
(forward and backward stay grouped: gmm and tgmm), where libtpu lowers
`jax.lax.ragged_dot` on some chips to a product over every local expert
(docs/bench/moe.md). Same arguments and result as `experts.expert_mlp_xla`."""

from __future__ import annotations

import jax.numpy as jnp

try:  # JAX's Pallas TPU grouped matmul; an experimental path that may move
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
except ImportError:  # pragma: no cover
  megablox = None

from mamba_train.ops.experts import grouped, split_gate

F32 = jnp.float32


def _gmm_tm(m: int) -> int:
  """megablox's row tile for m rows: 128, or m rounded up to 16 (a bfloat16 sublane
  tile) below that. Each expert's first and last tiles run whole, so up to E tiles of
  waste; a small tile keeps that small beside T k rows."""
  return 128 if m >= 128 else -(-m // 16) * 16


def _gmm_tile(d: int) -> int:
  """A contraction / output tile for a dimension d: d itself up to 1024; else the
  largest multiple of 128 up to 1024 that divides d (2688 = 21 x 128 -> 896); else d
  itself up to 4096 (a block the full dimension wide needs no 128 multiple: 1856);
  else 512, whose ragged last tile megablox masks."""
  if d <= 1024:
    return d
  for t in range(1024, 127, -128):
    if d % t == 0:
      return t
  return d if d <= 4096 else 512


def gmm_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
  """megablox's (tm, tk, tn) for an (m, k) x (e, k, n) problem. A function, not a
  tuple: its backward calls gmm and tgmm on the transposed problems, each of which
  asks it again for its own shape."""
  return _gmm_tm(m), _gmm_tile(k), _gmm_tile(n)


def expert_mlp_megablox(rows, up, down, sizes, cd, *, interpret: bool = False):
  """`experts.expert_mlp_xla` by megablox's grouped matmul, whose rows must be a
  multiple of its row tile."""
  if megablox is None:
    raise ImportError("moe_impl='megablox' needs jax.experimental.pallas.ops.tpu.megablox, which this "
                      "jax lacks; use moe_impl='xla'")
  gate, up = split_gate(up)
  sizes = sizes.astype(jnp.int32)
  m = rows.shape[0]
  gmm = lambda a, w: megablox.gmm(a, w, sizes, preferred_element_type=F32, tiling=gmm_tiling,
                                  interpret=interpret)
  return grouped(rows, up, gate, down, sizes, cd, gmm, -(-m // _gmm_tm(m)) * _gmm_tm(m) - m)
