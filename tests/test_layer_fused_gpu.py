"""The fused Mamba-2 layer for NVIDIA GPUs (ops/layer_fused_gpu.py: Pallas Triton
kernels from in_proj's outputs to the gated y and its norm statistics, and two for its
backward) against its plain form (`layer_math.mixer_core` over the plain SSD) in
Pallas' interpreter on CPU: float32 outputs and every gradient at 1e-5 over packed
documents whose boundaries sit inside the conv's reach across a chunk boundary,
initial states (SSM and conv), a ragged length over several chunks, 3 groups and 1,
dt clamped; bfloat16 within the plain form's own bfloat16 error; the model with
`layer_impl='fused_triton'` against the XLA model (2e-6); the table's choice and its
fallbacks; and the kernels compiled for an H100 (sm_90a) on this CPU through the CUDA plugin (no GPU
needed), with what each remat runs of them (a B200's sm_100a: test_aot.py). Under a
data x fsdp x tensor mesh: test_sequence_parallel."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from mamba_train.ops.layer_fused_gpu import joins, mixer_core_gpu
from mamba_train.ops.layer_math import mixer_core
from mamba_train.ops.ssd import ssd_chunked

from helpers import ROOT, missing_gpu_wheels, rel
from kernel_checks import assert_model_matches_xla, mixer_inputs, mixer_run

_KERNEL = lambda *a, **kw: mixer_core_gpu(*a, **kw, interpret=True)
_PLAIN = lambda *a, **kw: mixer_core(*a, **kw, ssd=ssd_chunked)


# (b, l, heads, head size, groups, state, chunk, documents): documents change at 14
# and 17, so the conv's taps at 16-18 reach back across the chunk boundary at 16 into
# another document, 40 positions over chunks of 16 (the last ragged, padded inside), 3
# groups of 2 heads; one group of 4 heads of 32 over whole chunks of 32, no documents.
CASES = [(2, 40, 6, 16, 3, 16, 16, True), (1, 64, 4, 32, 1, 16, 32, False)]


@pytest.mark.parametrize("b,l,h,p,g,n,q,docs", CASES, ids=["documents_3groups_ragged", "1group_whole_chunks"])
def test_fused_gpu_mixer_matches_plain_form(b, l, h, p, g, n, q, docs):
  """Outputs (the gated y, the sums of squares per group, the final state) and the
  gradient of every input (z|x, B|C, dt, each weight, both conv fronts, the initial
  state), with initial states and fronts given and dt clamped."""
  args = mixer_inputs(b, l, h, p, g, n)
  seq = jnp.array([[0] * 14 + [1] * 3 + [2] * (l - 17)] * b, jnp.int32) if docs else None
  got, dgot = mixer_run(_KERNEL, args, seq, q, g, (0.0, 0.2), True)
  want, dwant = mixer_run(_PLAIN, args, seq, q, g, (0.0, 0.2), True)
  if docs:
    assert rel(want[2], mixer_run(_PLAIN, args, None, q, g, (0.0, 0.2), False)[0][2]) > 1e-3  # documents matter
  for a, c in zip(got, want):
    assert a.shape == c.shape and a.dtype == c.dtype and rel(a, c) < 1e-5
  for (path, a), c in zip(jax.tree_util.tree_flatten_with_path(dgot)[0], jax.tree.leaves(dwant)):
    assert a.shape == c.shape and rel(a, c) < 1e-5, path


def test_fused_gpu_mixer_bfloat16_within_plain_error():
  """z|x and B|C in bfloat16 (the compute dtype; dt, the weights and states float32):
  the kernels' outputs and gradients deviate from the float32 plain run (on the same
  rounded inputs) by no more than the plain form's own bfloat16 run does, to a factor 1.5."""
  b, l, h, p, g, n, q = 1, 48, 4, 16, 2, 16, 16
  zx, bc, dt_raw, w, fx, fbc, s0, key = mixer_inputs(b, l, h, p, g, n)
  seq = jnp.array([[0] * 20 + [1] * 28], jnp.int32)
  lo = (zx.astype(jnp.bfloat16), bc.astype(jnp.bfloat16))
  hi = tuple(t.astype(jnp.float32) for t in lo)
  rest = (dt_raw, w, fx, fbc, s0, key)
  ref, dref = mixer_run(_PLAIN, (*hi, *rest), seq, q, g, (0.0, float("inf")), True)
  got, dgot = mixer_run(_KERNEL, (*lo, *rest), seq, q, g, (0.0, float("inf")), True)
  plain, dplain = mixer_run(_PLAIN, (*lo, *rest), seq, q, g, (0.0, float("inf")), True)
  assert got[0].dtype == jnp.bfloat16 and dgot[0].dtype == jnp.bfloat16
  pairs = list(zip(("gated", "ssq", "state"), got, plain, ref))
  pairs += [(jax.tree_util.keystr(path), a, c, r) for (path, a), c, r in
            zip(jax.tree_util.tree_flatten_with_path(dgot)[0], jax.tree.leaves(dplain), jax.tree.leaves(dref))]
  for name, k, c, r in pairs:
    err_k, err_p = rel(k, r), rel(c, r)
    assert err_p < 5e-2, (name, err_p)  # bfloat16 rounding, not a broken reference
    assert err_k <= 1.5 * err_p + 1e-6, (name, err_k, err_p)


def test_sizes_triton_cannot_block_run_the_plain_form():
  """A head size or state size that is not a power of two of at least 16 runs the plain
  form over the GPU SSD kernels, the same function."""
  assert joins(4096, 64, 1, 128) and joins(64, 4, 1, 16)
  assert not joins(48, 4, 1, 16) and not joins(64, 4, 1, 24) and not joins(64, 4, 1, 8)
  args = mixer_inputs(1, 20, 4, 12, 1, 16)  # p = 12
  got, _ = mixer_run(_KERNEL, args, None, 16, 1, (0.0, float("inf")), False)
  want, _ = mixer_run(_PLAIN, args, None, 16, 1, (0.0, float("inf")), False)
  for a, c in zip(got, want):
    assert rel(a, c) < 1e-5


def test_model_with_fused_gpu_layer_matches_xla_model():
  """A one-layer tiny model with 4 groups over packed documents at a ragged length,
  logits, states and every parameter's gradient: the fused GPU layer in the interpreter
  (remat save_matmuls) against the XLA model (no remat); the table's choice. (Which
  kernels each remat runs: the compile test below, as XLA leaves them.)"""
  from mamba_train import Runtime, config_for
  from mamba_train.model.select import ops_for
  cfg = config_for("tiny", n_layer=1, chunk_size=16, ngroups=4, d_state=16)
  rt = Runtime(ssd_impl="triton", layer_impl="fused_triton", interpret=True, remat="save_matmuls").resolve("cpu")
  ops = ops_for(cfg, rt)
  assert ("mixer", "fused_triton", "runtime") in ops.choices
  # The conv and norm rows where the mixer does not run (a split sequence): the GPU's kernels.
  assert ("conv", "triton", "runtime") in ops.choices and ("norm", "triton", "runtime") in ops.choices
  xla = Runtime(ssd_impl="xla", layer_impl="xla", ssd_form="parallel")
  # D's gradient, a sum over every position and channel, differs from the XLA model's by
  # 1.2e-6 under the suite's YNNPACK dots (8e-7 under XLA's own); the layer alone, above,
  # holds 1e-5 at every gradient with D's at 1e-7.
  assert_model_matches_xla(cfg, rt, xla, tol=2e-6)


def test_table_runs_the_gpu_kernels_where_they_apply():
  """The selection, decided without devices: the fused GPU layer per device's heads
  where whole groups sit on each; where it does not run (a group split over devices, a
  window, a split sequence), the plain mixer with the GPU's conv and norm kernels where
  they apply, naming why. (The numbers on a data x fsdp x tensor mesh:
  tests/test_sequence_parallel.py.)"""
  import types

  from mamba_train import Runtime, config_for
  from mamba_train.ops import table
  from mamba_train.parallel.heads import HeadSplit
  rt = Runtime(ssd_impl="triton", layer_impl="fused_triton", interpret=True).resolve("cpu")
  heads = lambda devices: table.Mesh(heads=HeadSplit(None, "data", "tensor", devices), active=True)
  whole = table.build(rt, config_for("tiny", ngroups=2), heads(2))
  assert ("mixer", "fused_triton", "runtime") in whole.choices and whole.mixer is not None
  spans = table.build(rt, config_for("tiny", ngroups=1), heads(2))
  assert ("mixer", "xla", "fused_triton takes no group split over devices (ngroups % heads' devices)") in spans.choices
  assert spans.mixer is None and spans.chose("conv") == "triton"
  windowed = table.build(rt, config_for("tiny", ssd_window=64))
  assert ("mixer", "xla", "fused_triton takes no window (ssd_window)") in windowed.choices and windowed.mixer is None
  stub = lambda *a, **k: None  # a split sequence's maps, not run here
  seq = table.build(rt, config_for("tiny"), table.Mesh(sequence=types.SimpleNamespace(ssd=stub, conv=stub),
                                                       active=True))
  assert ("mixer", "xla", "fused_triton takes no split sequence (the 'sequence' mesh axis)") in seq.choices
  assert ("conv", "xla", "triton takes no split sequence (the 'sequence' mesh axis)") in seq.choices
  assert seq.chose("ssd") == "triton" and seq.mixer is None


_COMPILE = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import gpu_devices
from mamba_train.ops.layer_fused_gpu import mixer_core_gpu
b, l, h, p, g, n, k = 1, 256, 8, 64, 1, 128, 4  # the released models' head and state sizes
i = h * p
def loss(zx, bc, dt_raw, w, seq):
  gated, ssq, fin = mixer_core_gpu(zx, bc, dt_raw, w, 128, ngroups=g, seq_idx=seq)
  return jnp.sum(gated.astype(jnp.float32) ** 2) + jnp.sum(ssq) + jnp.sum(fin)
# sm_90a here; sm_100a in test_aot.py's tiny MoE step for b200-8, where `auto` runs these kernels.
rep = NamedSharding(Mesh(np.array(gpu_devices("h100-1")[2][:1]), ("d",)), P())
S = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)
w = dict(conv_x=S((k, i)), conv_x_bias=S((i,)), conv_bc=S((k, 2, g * n)), conv_bc_bias=S((2, g * n)),
         dt_bias=S((h,)), A_log=S((h,)), D=S((h,)))
args = (S((b, l, 2 * i), jnp.bfloat16), S((b, l, 2, g * n), jnp.bfloat16), S((b, l, h)), w, S((b, l), jnp.int32))
hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile().as_text()
for kernel in ("mixer_fused_gpu_save", "mixer_fused_gpu_bwd", "mixer_fused_gpu_conv_t"):
  assert kernel in hlo, kernel + " missing"
print("compiled h100-1")
# What each remat runs of the kernels in a tiny model's gradient, as compiled: in a layer
# scan `save_matmuls` keeps none of their outputs, so the forward pass runs the kernel
# that writes no states and the backward pass reruns the saving one; with the layers
# unrolled (or `save_in_proj_ssd`, or no remat) the states are kept, and the forward
# pass runs the saving kernel once.
import re
from flax import nnx
from mamba_train import Mamba2LM, Runtime, config_for
cfg = config_for("tiny", n_layer=1, chunk_size=16, ngroups=4, d_state=16)
ids = jax.ShapeDtypeStruct((1, 64), jnp.int32, sharding=rep)
for remat, unroll in (("save_matmuls", False), ("save_matmuls", True), ("save_in_proj_ssd", False), ("none", False)):
  rt = Runtime(layer_impl="fused_triton", remat=remat, unroll_layers=unroll, compute_dtype="bfloat16").resolve("gpu")
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep),
                        jax.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt).params()))
  grad = jax.jit(jax.grad(lambda p, ids: jnp.sum(Mamba2LM.from_params(cfg, p, rt)(ids))))
  hlo = grad.lower(params, ids).compile().as_text()
  ran = sorted(m for line in hlo.splitlines() if "custom-call(" in line
               for m in re.findall(r"mixer_fused_gpu[a-z_]*", line)[:1])
  print("kernels", remat, unroll, ",".join(ran))
"""


def test_fused_gpu_layer_compiles_for_h100():
  """The three kernels, forward and backward with documents, in bfloat16 at the released
  head and state sizes, through XLA's GPU pipeline, Triton and ptxas for sm_90a, with the
  gpu extra's wheels (no GPU needed): Triton's power-of-two, gather and shared-memory
  rules are checked here (sm_100a: test_aot.py's b200-8 step); and which of them each
  remat runs in a tiny model's compiled gradient. Skips, saying why, without those wheels."""
  missing = missing_gpu_wheels()
  if missing:
    reason = f"GPU compile wheels absent ({', '.join(missing)}): pip install -e '.[gpu]'"
    print(reason)
    pytest.skip(reason)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the suite's CPU-only flags
  env["PYTHONPATH"] = str(ROOT)
  r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
  assert r.returncode == 0 and "compiled h100-1" in r.stdout, r.stderr[-3000:]
  saving = "mixer_fused_gpu_bwd,mixer_fused_gpu_conv_t,mixer_fused_gpu_save"
  assert "kernels save_matmuls False mixer_fused_gpu," + saving in r.stdout, r.stdout
  for remat in ("save_matmuls True", "save_in_proj_ssd False", "none False"):
    assert f"kernels {remat} {saving}\n" in r.stdout, r.stdout
