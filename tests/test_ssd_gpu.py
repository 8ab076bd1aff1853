"""The GPU SSD kernels (ops/ssd_gpu.py, Pallas Triton) against the XLA form
(`ssd.ssd_chunked`): in Pallas' interpreter on CPU, forward and every gradient, in
float32 (1e-5) and in bfloat16 (judged against the float32 run's error), with
documents (seq_idx), initial states, ragged lengths, 1 and 3 groups, and head and
state sizes that are not powers of two; and the kernels compiled for an H100
(sm_90a) on this CPU through the CUDA plugin (no GPU needed), forward and backward."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from mamba_train.ops import ssd, ssd_gpu

from helpers import ROOT, missing_gpu_wheels, packed_ids, rel, ssd_inputs
from kernel_checks import assert_model_matches_xla


def _grads(fn, chunk, seq, wy, ws):
  # A weighted sum of every output, so each output's gradient is checked.
  def loss(x, dt, A, B, C, D, h0):
    y, s = fn(x, dt, A, B, C, chunk, D=D, initial_state=h0, seq_idx=seq)
    return jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(s * ws), (y, s)
  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))


_KERNEL = functools.partial(ssd_gpu.ssd_gpu, interpret=True)
_XLA = functools.partial(ssd.ssd_chunked, form="parallel")
NAMES = "x dt A B C D h0".split()

# (l, chunk, groups, heads, head dim, state, documents): a ragged length over three
# kernel chunks (16) with packed documents, 3 groups, p and n padded to 16 inside;
# whole chunks, one group, no documents, the chunk rounded down to a power of two.
CASES = [(37, 16, 3, 6, 4, 5, True), (64, 24, 1, 4, 16, 16, False)]


@pytest.mark.parametrize("l,q,g,h,p,n,docs", CASES)
def test_gpu_kernels_match_xla_forward_and_gradients(l, q, g, h, p, n, docs):
  x, dt, A, B, C, D, h0 = ssd_inputs(l, 2, l, h, p, g, n, jnp.float32)
  seq = packed_ids(l, 2, l) if docs else None
  k1, k2 = jax.random.split(jax.random.PRNGKey(l))
  wy, ws = jax.random.normal(k1, x.shape), jax.random.normal(k2, h0.shape)
  (_, (y1, s1)), g1 = _grads(_KERNEL, q, seq, wy, ws)(x, dt, A, B, C, D, h0)
  (_, (y2, s2)), g2 = _grads(_XLA, q, seq, wy, ws)(x, dt, A, B, C, D, h0)
  assert y1.shape == x.shape and y1.dtype == x.dtype and s1.shape == h0.shape
  assert rel(y1, y2) < 1e-5 and rel(s1, s2) < 1e-5
  for name, a, b in zip(NAMES, g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name
  if docs:  # documents cut the state: the final state ignores the first documents
    (_, (_, s3)), _ = _grads(_KERNEL, q, seq, wy, ws)(x.at[:, 0].add(1.0), dt, A, B, C, D, h0)
    assert rel(s3, s1) == 0.0


def test_gpu_kernels_bfloat16_within_xla_error():
  """bfloat16 x, B and C (dt, A, D and the state float32): the kernels' outputs and
  gradients deviate from the float32 run (on the same rounded inputs) by no more than
  XLA's own bfloat16 form does, to a factor 1.5."""
  l, q, g, h, p, n = 80, 32, 2, 4, 16, 16
  x, dt, A, B, C, D, h0 = ssd_inputs(3, 2, l, h, p, g, n, jnp.float32)
  seq = packed_ids(4, 2, l)
  k1, k2 = jax.random.split(jax.random.PRNGKey(5))
  wy, ws = jax.random.normal(k1, x.shape), jax.random.normal(k2, h0.shape)
  lo = [t.astype(jnp.bfloat16) for t in (x, B, C)]
  x32, B32, C32 = [t.astype(jnp.float32) for t in lo]
  (_, ref), gref = _grads(_XLA, q, seq, wy, ws)(x32, dt, A, B32, C32, D, h0)
  (_, out_k), gk = _grads(_KERNEL, q, seq, wy, ws)(lo[0], dt, A, lo[1], lo[2], D, h0)
  (_, out_x), gx = _grads(_XLA, q, seq, wy, ws)(lo[0], dt, A, lo[1], lo[2], D, h0)
  assert out_k[0].dtype == jnp.bfloat16 and gk[0].dtype == jnp.bfloat16
  pairs = [("y", out_k[0], out_x[0], ref[0]), ("state", out_k[1], out_x[1], ref[1])]
  pairs += [(f"d{nm}", a, b, r) for nm, a, b, r in zip(NAMES, gk, gx, gref)]
  for name, k, xla, r in pairs:
    err_k, err_x = rel(k, r), rel(xla, r)
    assert err_x < 5e-2, (name, err_x)  # bfloat16 rounding, not a broken reference
    assert err_k <= 1.5 * err_x + 1e-6, (name, err_k, err_x)


def test_model_with_gpu_kernels_matches_xla_model():
  """A one-layer tiny model over packed documents at a ragged length, logits and
  every parameter's gradient: ssd_impl 'triton_interpret' (these kernels, as
  `ssd_impl=auto` runs them on a GPU; remat save_matmuls, which saves their output
  and states by name) against 'xla' in the parallel form (no remat)."""
  from mamba_train import Runtime, config_for
  assert Runtime().resolve("gpu").ssd_impl == "triton"
  # save_matmuls with the kernels: the backward takes their saved output and states.
  assert_model_matches_xla(config_for("tiny", n_layer=1, chunk_size=16),
                           Runtime(ssd_impl="triton_interpret", ssd_form="parallel", remat="save_matmuls"),
                           Runtime(ssd_impl="xla", ssd_form="parallel", remat="none"))


_COMPILE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import gpu_devices
from mamba_train.ops.ssd_gpu import ssd_gpu
rep = NamedSharding(Mesh(np.array(gpu_devices("h100-1")[2][:1]), ("d",)), P())
S = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)
b, l, h, p, g, n = 1, 256, 8, 64, 1, 128  # the released models' head and state sizes
args = (S((b, l, h, p), jnp.bfloat16), S((b, l, h)), S((h,)), S((b, l, g, n), jnp.bfloat16),
        S((b, l, g, n), jnp.bfloat16), S((h,)), S((b, h, p, n)), S((b, l), jnp.int32))
def loss(x, dt, A, B, C, D, h0, seq):
  y, s = ssd_gpu(x, dt, A, B, C, 128, D=D, initial_state=h0, seq_idx=seq)
  return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s)
compiled = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)))).lower(*args).compile()
hlo = compiled.as_text()
for kernel in ("ssd_gpu_fwd_save", "ssd_gpu_bwd"):  # Triton custom calls, compiled by ptxas
  assert kernel in hlo, kernel + " missing"
# The layer kernels (ops/layer_gpu.py) at the 130m layer's channels, with documents.
from mamba_train.ops.layer_gpu import causal_conv_silu_gpu, gated_rms_norm_gpu
i, c = 1536, 256
def layer(x, bc, w, wb, z, gw, seq, zj):
  xs, _ = causal_conv_silu_gpu(x, w, wb, jnp.zeros((b, 3, i), x.dtype), seq)
  bcs, _ = causal_conv_silu_gpu(bc, jnp.ones((4, c)), jnp.zeros((c,)), jnp.zeros((b, 3, c)), seq)
  out = gated_rms_norm_gpu(xs, z, gw, 1, 1e-5)
  # the gate read in place from a joined z|x|B|C-like array (3 groups of 512: no padding)
  out2 = gated_rms_norm_gpu(xs, zj, gw, 3, 1e-5)
  sq = lambda a: jnp.sum(a.astype(jnp.float32) ** 2)
  return sq(out) + jnp.sum(bcs.astype(jnp.float32)) + sq(out2)
largs = (S((b, l, i), jnp.bfloat16), S((b, l, c), jnp.bfloat16), S((4, i)), S((i,)), S((b, l, i), jnp.bfloat16),
         S((i,)), S((b, l), jnp.int32), S((b, l, 2 * i + c), jnp.bfloat16))
hlo = jax.jit(jax.grad(layer, argnums=(0, 1, 2, 3, 4, 5, 7))).lower(*largs).compile().as_text()
for kernel in ("conv_silu_gpu_fwd", "conv_silu_gpu_bwd", "gated_norm_gpu_fwd", "gated_norm_gpu_bwd"):
  assert kernel in hlo, kernel + " missing"
assert any("gated_norm_gpu_fwd" in ln and f"bf16[{l},{2 * i + c}]" in ln for ln in hlo.splitlines()), "joined gate"
print("compiled", compiled.runtime_executable().hlo_modules()[0].name)
"""


def test_gpu_kernels_compile_for_h100():
  """The SSD kernels and the layer kernels (ops/layer_gpu.py), forward and
  backward, through XLA's GPU pipeline, Triton and ptxas for sm_90a,
  with the gpu extra's wheels (no GPU needed): Triton's power-of-two and shared
  memory rules are checked here. Skips, saying why, without those wheels."""
  missing = missing_gpu_wheels()
  if missing:
    reason = f"GPU compile wheels absent ({', '.join(missing)}): pip install -e '.[gpu]'"
    print(reason)
    pytest.skip(reason)
  # The CUDA plugin parses XLA_FLAGS too: leave out the suite's CPU-only flags.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT)
  r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
  assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
