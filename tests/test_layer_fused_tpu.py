"""The fused Mamba-2 layer between in_proj and out_proj (ops/layer_fused_tpu.py, one
Pallas Mosaic kernel: conv + SiLU, dt, the one-pass SSD, the gate and the norm's
sums of squares; its backward kernel walking the chunks in reverse) against its plain
form (`layer_math.mixer_core` over the plain SSD) in Pallas' interpreter on CPU:
float32 outputs and every gradient at 1e-5 over
packed documents whose boundaries sit inside the conv's reach across a chunk
boundary, initial states (SSM and conv), a ragged length over several chunks, 3 groups of two
head blocks of 16; the model with `layer_impl='fused'` against the XLA model (1e-6); and the
kernels compiled through libtpu (no TPU needed): forward and backward for v6e and
TPU7x."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from mamba_train.ops import layer_fused_bwd_tpu
from mamba_train.ops.layer_fused_tpu import SAVE_NAMES, mixer_core_tpu
from mamba_train.ops.layer_math import mixer_core
from mamba_train.ops.ssd import ssd_chunked

from helpers import libtpu_compiles, rel
from kernel_checks import assert_model_matches_xla, mixer_inputs, mixer_run


@pytest.mark.parametrize("merged", [True, False], ids=["states_in_vmem", "states_saved"])
def test_fused_mixer_matches_plain_form_with_documents_and_groups(merged, monkeypatch):
  """3 groups of 32 heads, two blocks of 16 a group (B and C read at each group's
  lanes; the backward kernel's per-block partials of their gradients, summed outside),
  40 positions in chunks of 16 (the last ragged); documents change at 14 and 17, so
  the conv's taps at positions 16-18 reach back across the chunk boundary into another
  document; initial states (the SSM's, the conv's fronts of earlier inputs, which the
  first chunk's taps read); dt clamped. Outputs (the gated y, the sums of squares, the
  final state) and every gradient. (One test: the interpreter's compile of the 16-head
  kernels is most of its time.) Both backward kernels: the one that passes the states
  itself in VMEM (what fits: here, and at l 2048 at the released sizes) and the one
  that reads the forward kernel's saved states (longer sequences)."""
  if not merged:
    monkeypatch.setattr(layer_fused_bwd_tpu, "MERGED_STATES_VMEM", 0)
  b, l, h, p, g, n = 2, 40, 96, 2, 3, 8
  args = mixer_inputs(b, l, h, p, g, n)
  seq = jnp.array([[0] * 14 + [1] * 3 + [2] * 23, [0] * 40], jnp.int32)
  kernel = lambda *a, **kw: mixer_core_tpu(*a, **kw, interpret=True)
  plain = lambda *a, **kw: mixer_core(*a, **kw, ssd=ssd_chunked)
  got, dgot = mixer_run(kernel, args, seq, 16, g, (0.0, 0.2), True)
  want, dwant = mixer_run(plain, args, seq, 16, g, (0.0, 0.2), True)
  assert rel(want[2], mixer_run(plain, args, None, 16, g, (0.0, 0.2), False)[0][2]) > 1e-3  # documents matter
  for a, c in zip(got, want):
    assert rel(a, c) < 1e-5
  for (path, a), c in zip(jax.tree_util.tree_flatten_with_path(dgot)[0], jax.tree.leaves(dwant)):
    assert rel(a, c) < 1e-5, path


def test_model_with_fused_layer_matches_xla_model():
  """A one-layer tiny model with 4 groups over packed documents at a ragged length,
  logits and every parameter's gradient: the fused layer in the interpreter (remat
  save_in_proj, the norm folded into out_proj) against the XLA model (no remat); and
  the table's choice, and where 'auto' makes it."""
  from mamba_train import Runtime, config_for
  from mamba_train.model.select import ops_for
  cfg = config_for("tiny", n_layer=1, chunk_size=16, ngroups=4, d_state=8)
  # 'auto' picks it on v6e and TPU7x, where both counts say it moves fewer bytes (not
  # on v5p, compute-bound, nor on a TPU of unknown kind).
  assert Runtime().resolve("tpu", "TPU v6 lite").layer_impl == Runtime().resolve("tpu", "TPU7x").layer_impl == "fused"
  assert Runtime().resolve("tpu", "TPU v5").layer_impl == Runtime().resolve("tpu").layer_impl == "xla"
  rt = Runtime(ssd_impl="mosaic", layer_impl="fused", interpret=True, remat="save_in_proj").resolve("cpu")
  assert ("mixer", "fused", "runtime") in ops_for(cfg, rt).choices
  from flax import nnx

  from mamba_train import Mamba2LM
  model = Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)  # the kernel runs in the model (not a fallback)
  ids = jnp.zeros((1, 40), jnp.int32)
  assert "mixer_fused" in str(jax.make_jaxpr(lambda ids: model(ids))(ids))
  grad = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(Mamba2LM.from_params(cfg, p, rt)(ids))))(model.params())
  # The kernels: no states saved (the backward kernel passes them itself, in VMEM).
  # Under save_in_proj the backward pass reruns the forward kernel for the gated y and
  # its squares, which the norm's and out_proj's backward read; save_in_proj_ssd keeps
  # them, and no forward kernel runs again.
  kernels = lambda jaxpr: sorted(n for n in re.findall(r"name=(mixer_fused\w*)", str(jaxpr)) if n not in SAVE_NAMES)
  assert kernels(grad) == ["mixer_fused", "mixer_fused", "mixer_fused_bwd"], kernels(grad)
  rt_ssd = dataclasses.replace(rt, remat="save_in_proj_ssd")
  grad_ssd = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(Mamba2LM.from_params(cfg, p, rt_ssd)(ids))))(model.params())
  assert kernels(grad_ssd) == ["mixer_fused", "mixer_fused_bwd"], kernels(grad_ssd)
  xla = Runtime(ssd_impl="xla", layer_impl="xla", ssd_form="parallel")
  assert_model_matches_xla(cfg, rt, xla, tol=1e-6)
  assert_model_matches_xla(cfg, rt_ssd, xla, tol=1e-6)


def test_table_runs_the_kernel_only_on_whole_groups():
  """The selection under a mesh, decided without devices: the kernel runs per device's
  heads where whole groups sit on each (2 and 4 groups over 2 devices, 1 group on one),
  and falls back to the plain forms, naming why, where a group would span devices (its
  sums of squares would be partial: 1 group over 2 devices, 2 over 4) or with a window. (The
  numbers on a data x fsdp x tensor mesh and the split sequence's fallback:
  tests/test_sequence_parallel.py.)"""
  from mamba_train import Runtime, config_for
  from mamba_train.ops import table
  from mamba_train.parallel.heads import HeadSplit
  rt = Runtime(ssd_impl="mosaic", layer_impl="fused", interpret=True).resolve("cpu")
  split = "fused takes no group split over devices (ngroups % heads' devices)"
  for g, devices, want in ((2, 2, "runtime"), (4, 2, "runtime"), (1, 1, "runtime"), (1, 2, split), (2, 4, split)):
    ops = table.build(rt, config_for("tiny", ngroups=g), table.Mesh(heads=HeadSplit(None, "data", "tensor", devices),
                                                                    active=True))
    assert ops.chose("mixer") == ("fused" if want == "runtime" else "xla")
    assert ("mixer", ops.chose("mixer"), want) in ops.choices, (g, devices, ops.choices)
    assert (ops.mixer is not None) == (want == "runtime")
  windowed = table.build(rt, config_for("tiny", ssd_window=64))
  assert ("mixer", "xla", "fused takes no window (ssd_window)") in windowed.choices and windowed.mixer is None


_AOT = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import tpu_devices
from mamba_train.ops.layer_fused_tpu import SAVE_NAMES, mixer_core_tpu
# The released models' head and state sizes (p 64, n 128), two groups of two head
# blocks of 16 (B's and C's (q, n) blocks read in place from B|C at the group's lanes), chunk
# 128 (TPU's), documents: Mosaic's tiling rules, the lane and sublane rotations. The
# gradient: the forward kernel, and the backward kernel passing the states itself in
# VMEM at the training length (16 chunks' states, and the VMEM it asks for, within
# each chip's).
b, l, h, p, g, n, k, q = 1, 2048, 64, 64, 2, 128, 4, 128
i = h * p
for topo in sys.argv[1:]:
  rep = NamedSharding(Mesh(np.array(tpu_devices(topo)[2][:1]), ("d",)), P())
  S = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)
  w = dict(conv_x=S((k, i)), conv_x_bias=S((i,)), conv_bc=S((k, 2, g * n)), conv_bc_bias=S((2, g * n)),
           dt_bias=S((h,)), A_log=S((h,)), D=S((h,)))
  fwd = lambda zx, bc, dt, w, s: mixer_core_tpu(zx, bc, dt, w, q, ngroups=g, seq_idx=s)
  loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in fwd(*a))
  f, names = jax.grad(loss, argnums=(0, 1, 2, 3)), ["mixer_fused", "mixer_fused_bwd"]
  bf = jnp.bfloat16
  hlo = jax.jit(f).lower(S((b, l, 2 * i), bf), S((b, l, 2, g * n), bf), S((b, l, h)), w,
                         S((b, l), jnp.int32)).compile().as_text()
  assert all(name in hlo for name in names) and "mixer_fused_save" not in hlo, names
  print("compiled", topo)
# A head block's channels that fill no whole vreg of lanes (2 groups of 3 heads of 64:
# 192 of 384): the plain form over the SSD kernel, not a Mosaic error.
h, g = 6, 2
i = h * p
w = dict(conv_x=S((k, i)), conv_x_bias=S((i,)), conv_bc=S((k, 2, g * n)), conv_bc_bias=S((2, g * n)),
         dt_bias=S((h,)), A_log=S((h,)), D=S((h,)))
hlo = jax.jit(lambda *a: mixer_core_tpu(*a, q, ngroups=g)).lower(
    S((b, l, 2 * i), bf), S((b, l, 2, g * n), bf), S((b, l, h)), w).compile().as_text()
assert "mixer_fused" not in hlo and "ssd_one_pass" in hlo
"""


def test_fused_mixer_compiles_for_v6e_and_tpu7x():
  libtpu_compiles(_AOT, ("v6e:1x1", "tpu7x:2x2x1"))
