"""The routed experts' grouped matmuls, plain: rows sorted by expert through
`jax.lax.ragged_dot`, XLA's own op, which differentiates and runs on every backend
(each lowers it its own way: docs/bench/moe.md). The kernels beside it take the same
arguments: megablox's (JAX's Pallas TPU grouped matmul, `experts_tpu.py`) and
tokamax's ragged dot (Pallas Triton, NVIDIA GPUs, `experts_gpu.py`); which runs is
decided in `table.py`.

Shapes: m rows (token, expert) pairs sorted by expert, w expert width, f expert
hidden units, e experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

F32 = jnp.float32
# Names of what the grouped matmuls compute that a remat policy may keep (the model's
# 'save_moe'), so the backward pass does not run the dispatch and the forward products
# again: the rows entering the up projection (grouped by expert, masked, the compute
# dtype), the up projection's outputs (the gate's too) and the activation.
ROWS = "moe_expert_rows"
HIDDEN = "moe_expert_hidden"
ACT = "moe_expert_act"  # the activation in the compute dtype: the down projection's input


def _relu2(x):
  return jnp.square(jax.nn.relu(x))


def act(hid, gate_hid):
  """The experts' activation: relu(h)^2, or with a gate (swiglu) silu(gate) * h; float32."""
  return _relu2(hid) if gate_hid is None else jax.nn.silu(gate_hid) * hid


def split_gate(up):
  """(gate, up): up is (e, w, f), or (gate, up) for swiglu experts."""
  return up if isinstance(up, tuple) else (None, up)


def grouped(rows, up, gate, down, sizes, cd, gmm, pad: int):
  """`expert_mlp_xla` by a grouped-matmul kernel gmm(a, w) -> float32 or `cd` that,
  like megablox's and tokamax's, leaves rows past sum(sizes) unwritten (whatever
  memory held, forward, and for the lhs gradient backward): each product's output is
  zeroed there, and its input too, which zeroes the unwritten gradient rows on the way
  back. The rows are padded to `pad` more (megablox: to its row tile; tokamax: a row
  block past the end, which its kernel reads unmasked), padding being such rows. The
  activation is float32; the result is in gmm's dtype (`expert_mlp_xla`)."""
  m = rows.shape[0]
  valid = (jnp.arange(m + pad) < jnp.sum(sizes))[:, None]

  zero_past = lambda a: jnp.where(valid, a, jnp.zeros((), a.dtype))
  rows = checkpoint_name(zero_past(jnp.pad(rows, ((0, pad), (0, 0)))), ROWS)
  hidden = lambda w: checkpoint_name(zero_past(gmm(rows, w)), HIDDEN).astype(F32)
  hid = checkpoint_name(zero_past(act(hidden(up), None if gate is None else hidden(gate)).astype(cd)), ACT)
  return zero_past(gmm(hid, down))[:m]


def expert_mlp_xla(rows, up, down, sizes, cd):
  """rows (m, w) sorted by expert, sizes (e,) rows per expert (summing to at most m;
  rows past the sum meet no expert and come out zero) -> (m, w) float32. up: (e, w,
  f), or (gate, up) for swiglu; up and down in the compute dtype `cd`.

  The kernels beside it may return the rows in `cd` where their product's result is
  in it anyway (tokamax's): the dispatch keeps the rows in the dtype they come in
  (the unsorting, the return all-to-all) and widens them to float32 only in the
  weighted sum onto the tokens, so a float32 copy of every row is never written, and
  the rows' gradient comes back in that dtype too."""
  gate, up = split_gate(up)
  sizes = sizes.astype(jnp.int32)
  rows = checkpoint_name(rows, ROWS)
  ragged = lambda a, w: checkpoint_name(jax.lax.ragged_dot(a, w, sizes, preferred_element_type=F32), HIDDEN)
  hid = act(ragged(rows, up), None if gate is None else ragged(rows, gate))
  return ragged(checkpoint_name(hid.astype(cd), ACT), down)
