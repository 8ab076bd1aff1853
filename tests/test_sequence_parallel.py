"""The sequence mesh axis: one sequence split over devices gives the unsharded
model's logits, final states, gradients and training losses; checkpoints move
between sequence=4 and sequence=1; and the scan holds at 65k+ positions against
the sequential recurrence. The fused Mamba-2 layer (ops/layer_fused_tpu.py, and
the GPU's ops/layer_fused_gpu.py; interpreted) against the XLA model on one device:
under data x fsdp x tensor, and the TPU one's fallback to the plain forms under a split sequence.

The multi-device checks run in one subprocess on 8 simulated CPU devices (the
device count is fixed when jax starts; compiling is most of the cost); the tests
read what it saved. The long-length test runs in this process on one device.
"""

import functools
import json
import os
import re
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK = 16
# mesh name -> (mesh config, length). 256 is a multiple of devices x chunk for
# every mesh here; 200 is not (slices of 25, 50 and 100 positions: ragged chunks).
# Eight slices are checked at the ragged length only (the even one at four: the same
# code, each slice whole chunks), and trained only in the meshes below that mix the
# sequence with data, tensor and fsdp: a case here is a compile, and the suite's ten
# minutes are its budget (docs/bench/suite.md).
# The Pallas SSD kernels (in interpret mode) per slice, inside the heads' map, on this
# sequence x tensor x fsdp mesh against the unsharded XLA SSD: FUSED_LAYER's split-sequence
# case below, whose fallback runs them (the GPU kernels go the same way: tests/test_ssd_gpu.py
# runs the model with them).
FORWARD = {
    "seq8_l200": ({"sequence": 8}, 200),
    "s4d2_l256": ({"sequence": 4, "data": 2}, 256),
    "s2t2f2_l200": ({"sequence": 2, "tensor": 2, "fsdp": 2}, 200),
}
TRAIN = {  # name -> (mesh config, runtime overrides, grad_accum)
    "single": ({}, {}, 1),
    "s4d2_remat_accum2": ({"sequence": 4, "data": 2}, {"remat": "full"}, 2),
    "s2t2f2_parallel": ({"sequence": 2, "tensor": 2, "fsdp": 2}, {"ssd_form": "parallel"}, 1),
}
STEPS = 3
# The fused layer (`layer_impl='fused'`, Pallas' interpreter): one layer of 2 groups, so
# that whole groups sit on each of tensor's 2 devices (a group split over devices is the
# table's other fallback), 40 positions (2.5 chunks), batch 4 over data x fsdp. Under data x
# fsdp x tensor the kernels run per device's batch and heads (`HeadSplit.mixer`); under a
# split sequence the table falls back to the plain forms (its one walk over the chunks
# carries the conv's halo and the state within a device), here with the SSD kernel per slice.
# The GPU's fused layer (`layer_impl='fused_triton'`) under data x fsdp x tensor too.
FUSED_LAYER = {"d2f2t2_fusedlayer": {"data": 2, "fsdp": 2, "tensor": 2},
               "s2f2t2_fusedlayer": {"sequence": 2, "fsdp": 2, "tensor": 2},
               "d2f2t2_fusedlayer_gpu": {"data": 2, "fsdp": 2, "tensor": 2}}
# Document starts: 17 (the conv's taps at 17-19 reach back across the chunk boundary at
# 16 into another document), 21 (across the sequence split's device edge at 20), 5, 30.
FUSED_DOCS = ((17, 21), (5,), (), (30,))


def _documents(b, l):
  """seq_idx rows whose documents start just after a device edge (26: the conv
  halo reaches into the previous document), on one (100) and inside slices."""
  seq = np.zeros((b, l), np.int32)
  for row, starts in enumerate([(26, 100, 163), (5, 130)][:b]):
    for s in starts:
      seq[row, s:] += 1
  return seq


def _worker(out_dir):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from mamba_train import Mamba2LM, Runtime, config_for
  from mamba_train.data import SyntheticLoader
  from mamba_train.parallel import sharding
  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.train import optim, state as train_state, step as trainer
  from mamba_train.workdir.checkpoint import Checkpointer
  assert jax.device_count() == 8, jax.devices()
  cfg = config_for("tiny", d_model=32, n_layer=2, d_state=16, headdim=16, chunk_size=CHUNK,
                   vocab_size=64)
  rt = Runtime().resolve("cpu")
  params = Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt).params()
  rng = np.random.default_rng(0)
  out = {}

  # --- forward and gradients: logits, final states (from random initial states), grads ---
  def loss_and_grads(params, ids, seq, states, weights, rt=rt, cfg=cfg):
    def f(params, states):
      m = Mamba2LM.from_params(cfg, params, rt)
      h, final = m.backbone(ids, seq_idx=seq, states=states)
      logits = m.logits(h)
      return jnp.sum(logits * weights), (logits, final)
    (_, (logits, final)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, states)
    return {"logits": logits, "final": final, "grads": grads}

  def flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}

  refs = {}
  for name, (mesh_cfg, l) in FORWARD.items():
    if l not in refs:
      b = 2
      ids = jnp.asarray(rng.integers(0, 64, (b, l)), jnp.int32)
      seq = jnp.asarray(_documents(b, l))
      states = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32),
                            jax.eval_shape(lambda: Mamba2LM.from_params(cfg, params, rt).backbone(ids)[1]))
      weights = jnp.asarray(rng.normal(size=(b, l, 64)), jnp.float32)
      inputs = (params, ids, seq, states, weights)
      refs[l] = (inputs, flat(jax.jit(loss_and_grads)(*inputs)))
      np.savez(os.path.join(out_dir, f"ref_l{l}.npz"), **refs[l][1])
    inputs, _ = refs[l]
    mesh = make_mesh(mesh_cfg)

    def sharded(*a, mesh=mesh):
      with sharding.use_rules(mesh):
        return loss_and_grads(*a)

    np.savez(os.path.join(out_dir, f"{name}.npz"), **flat(jax.jit(sharded)(*inputs)))

  out["fused_layer"] = _fused_layer(out_dir, cfg.replace(n_layer=1, ngroups=2), loss_and_grads, flat, rng)

  # --- a hybrid (Mamba-2, attention with rotary and GQA, MLP): queries split, keys and
  # values gathered over the sequence axis; logits and gradients against unsharded ---
  hcfg = cfg.replace(n_layer=3, layer_pattern="M*-", attn_num_heads=4, attn_num_heads_kv=2,
                     attn_head_dim=8, attn_rotary_emb_dim=4, d_intermediate=64)
  hparams = Mamba2LM(hcfg, rngs=nnx.Rngs(1), runtime=rt).params()
  ids = jnp.asarray(rng.integers(0, 64, (2, 200)), jnp.int32)
  seq, weights = jnp.asarray(_documents(2, 200)), jnp.asarray(rng.normal(size=(2, 200, 64)), jnp.float32)

  def hybrid(params):
    f = lambda p: jnp.sum(Mamba2LM.from_params(hcfg, p, rt)(ids, seq_idx=seq) * weights)
    return jax.value_and_grad(f)(params)

  np.savez(os.path.join(out_dir, "hybrid_ref.npz"), **flat(jax.jit(hybrid)(hparams)))
  mesh = make_mesh({"sequence": 4, "tensor": 2})

  def hybrid_sharded(params):
    with sharding.use_rules(mesh):
      return hybrid(params)

  np.savez(os.path.join(out_dir, "hybrid_s4t2.npz"), **flat(jax.jit(hybrid_sharded)(hparams)))

  # --- training steps against the unsharded run; checkpoints across sequence sizes ---
  ocfg = dict(lr=1e-2, schedule="constant", warmup_frac=0.0, decay_frac=0.0, final_lr_frac=0.1,
              b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, state_dtype="float32")
  tx, schedule = optim.make_optimizer(ocfg, 10)
  loader = SyntheticLoader(vocab_size=64, seq_len=64, global_batch_size=4, seed=0, mean_doc_len=20)
  batches = [next(loader) for _ in range(STEPS)]
  steps, saved = {}, {}
  for name, (mesh_cfg, rt_over, accum) in TRAIN.items():
    mesh = make_mesh(mesh_cfg or {"data": 1}, jax.devices()[:1] if not mesh_cfg else None)
    step = trainer.make_train_step(cfg, Runtime(**rt_over).resolve("cpu"), tx, schedule, mesh,
                                   grad_accum=accum)
    state = train_state.init_train_state(cfg, tx, mesh, seed=0, params=params)
    losses = []
    for i, batch in enumerate(batches):
      if i == STEPS - 1:
        saved[name] = (mesh, jax.device_get(state))
      state, m = step(state, trainer.to_global(batch, mesh))
      losses.append(float(m["loss"]))
    steps[name] = (mesh, step)
    out[name] = {"losses": losses}

  # Save at step 2 on one mesh, restore on the other, take the last step there.
  for src, dst in (("s4d2_remat_accum2", "single"), ("single", "s4d2_remat_accum2")):
    ckpt = Checkpointer(os.path.join(out_dir, f"ckpt_{src}"), async_save=False)
    src_mesh, host_state = saved[src]
    ckpt.save(STEPS - 1, jax.device_put(host_state, train_state.state_shardings(cfg, tx, src_mesh)),
              loader, {})
    ckpt.close()
    mesh, step = steps[dst]
    ckpt = Checkpointer(os.path.join(out_dir, f"ckpt_{src}"), async_save=False)
    at, state = ckpt.restore(train_state.abstract_train_state(cfg, tx, mesh), loader)
    ckpt.close()
    _, m = step(state, trainer.to_global(batches[-1], mesh))
    out[f"restored_{src}_on_{dst}"] = {"step": at, "loss": float(m["loss"])}
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(out, f)


def _fused_layer(out_dir, cfg, loss_and_grads, flat, rng):
  """FUSED_LAYER's meshes: the XLA model on one device (fused_ref.npz), the fused one on
  each mesh (NAME.npz); returns the mixer's choice and reason on each mesh, and the CPU
  seconds each case cost (what it costs the suite)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from mamba_train import Mamba2LM, Runtime
  from mamba_train.model.select import ops_for
  from mamba_train.parallel import sharding
  from mamba_train.parallel.mesh import make_mesh
  b, l = len(FUSED_DOCS), 40
  xla_rt = Runtime().resolve("cpu")
  fused_rt = Runtime(ssd_impl="mosaic", layer_impl="fused", interpret=True).resolve("cpu")
  gpu_rt = Runtime(ssd_impl="triton", layer_impl="fused_triton", interpret=True).resolve("cpu")
  params = Mamba2LM(cfg, rngs=nnx.Rngs(2), runtime=xla_rt).params()
  ids = jnp.asarray(rng.integers(0, 64, (b, l)), jnp.int32)
  seq = np.zeros((b, l), np.int32)
  for row, starts in enumerate(FUSED_DOCS):
    for s in starts:
      seq[row, s:] += 1
  states = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32),
                        jax.eval_shape(lambda: Mamba2LM.from_params(cfg, params, xla_rt).backbone(ids)[1]))
  inputs = (params, ids, jnp.asarray(seq), states, jnp.asarray(rng.normal(size=(b, l, 64)), jnp.float32))
  t0 = time.process_time()
  np.savez(os.path.join(out_dir, "fused_ref.npz"),
           **flat(jax.jit(functools.partial(loss_and_grads, rt=xla_rt, cfg=cfg))(*inputs)))
  chose, kernels, seconds = {}, {}, {"ref": time.process_time() - t0}
  for name, mesh_cfg in FUSED_LAYER.items():
    t0 = time.process_time()
    mesh = make_mesh(mesh_cfg)

    rt = gpu_rt if name.endswith("_gpu") else fused_rt

    def sharded(*a, mesh=mesh, rt=rt):
      with sharding.use_rules(mesh):
        return loss_and_grads(*a, rt=rt, cfg=cfg)

    with sharding.use_rules(mesh):
      chose[name] = next(c for c in ops_for(cfg, rt).choices if c[0] == "mixer")[1:]
    traced = jax.jit(sharded).trace(*inputs)
    kernels[name] = sorted(set(re.findall(r"name=(\w+)", str(traced.jaxpr))))  # the Pallas calls that ran
    np.savez(os.path.join(out_dir, f"{name}.npz"), **flat(traced.lower().compile()(*inputs)))
    seconds[name] = time.process_time() - t0
  return {"chose": chose, "kernels": kernels, "seconds": seconds}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, on_simulated_devices):
  out = tmp_path_factory.mktemp("sequence")
  return on_simulated_devices(__file__, out), out


def _rel(got, ref):
  return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.mark.parametrize("name", list(FORWARD))
def test_split_sequence_equals_unsharded(runs, name):
  _, out = runs
  ref = dict(np.load(out / f"ref_l{FORWARD[name][1]}.npz"))
  got = dict(np.load(out / f"{name}.npz"))
  assert sorted(got) == sorted(ref)
  assert any("final" in k for k in ref) and any("grads" in k for k in ref)
  for key in ref:
    assert np.isfinite(got[key]).all(), key
    # float32 reassociation (slices' summaries combined in another order): ~1e-6.
    assert _rel(got[key], ref[key]) < 1e-5, (key, _rel(got[key], ref[key]))


@pytest.mark.parametrize("name", list(FUSED_LAYER))
def test_fused_layer_on_a_mesh_equals_xla_on_one_device(runs, name):
  """The fused layer's logits, final states (conv and SSM, from random initial ones) and
  every gradient (parameters and initial states) against the XLA model on one device;
  the table ran the kernels (the TPU's; the GPU's, `fused_triton`) under data x fsdp x
  tensor and fell back, naming the split sequence, under sequence."""
  results, out = runs
  impl, why = results["fused_layer"]["chose"][name]
  kernels = results["fused_layer"]["kernels"][name]
  if "sequence" in FUSED_LAYER[name]:
    assert (impl, why) == ("xla", "fused takes no split sequence (the 'sequence' mesh axis)")
    # The SSD kernels per slice, forward and backward (the FORWARD meshes run the XLA SSD).
    assert "ssd_one_pass_save" in kernels and "ssd_one_pass_bwd" in kernels, kernels
  elif name.endswith("_gpu"):
    assert (impl, why) == ("fused_triton", "runtime")
    assert {"mixer_fused_gpu_save", "mixer_fused_gpu_bwd", "mixer_fused_gpu_conv_t"} <= set(kernels), kernels
  else:
    assert (impl, why) == ("fused", "runtime")
  ref, got = dict(np.load(out / "fused_ref.npz")), dict(np.load(out / f"{name}.npz"))
  assert sorted(got) == sorted(ref) and any("conv_x" in k for k in ref) and any("A_log" in k for k in ref)
  for key in ref:
    assert _rel(got[key], ref[key]) < 1e-5, (key, _rel(got[key], ref[key]))


def test_hybrid_split_sequence_equals_unsharded(runs):
  _, out = runs
  ref, got = dict(np.load(out / "hybrid_ref.npz")), dict(np.load(out / "hybrid_s4t2.npz"))
  assert sorted(got) == sorted(ref) and any("attn" in k for k in ref)
  for key in ref:
    assert _rel(got[key], ref[key]) < 1e-5, (key, _rel(got[key], ref[key]))


@pytest.mark.parametrize("name", [n for n in TRAIN if n != "single"])
def test_training_steps_equal_unsharded(runs, name):
  results, _ = runs
  np.testing.assert_allclose(results[name]["losses"], results["single"]["losses"], rtol=1e-6)


def test_checkpoint_moves_between_sequence_sizes(runs):
  results, _ = runs
  want = results["single"]["losses"][-1]
  for key in ("restored_s4d2_remat_accum2_on_single", "restored_single_on_s4d2_remat_accum2"):
    assert results[key]["step"] == STEPS - 1
    assert results[key]["loss"] == pytest.approx(want, rel=1e-6), key


def test_long_sequence_against_sequential_recurrence():
  """65,600 positions (not a multiple of the chunk): the model's forward and
  gradients with the chunked scan equal those with the sequential recurrence
  put in its place, and nothing overflows or turns NaN."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from mamba_train import Mamba2LM, Runtime, config_for
  from mamba_train.ops import ssd

  l = 65_600
  cfg = config_for("tiny", d_model=16, n_layer=1, d_state=8, headdim=8, chunk_size=64, vocab_size=32)
  rt = Runtime().resolve("cpu")
  params = Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt).params()
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, 32, (1, l)), jnp.int32)
  seq = np.zeros((1, l), np.int32)
  seq[0, 40_000:] = 1  # one document boundary far into the sequence
  weights = jnp.asarray(rng.normal(size=(1, l, 32)), jnp.float32)

  def run(scan):
    def loss(params):
      m = Mamba2LM.from_params(cfg, params, rt)
      h, final = m.backbone(ids, seq_idx=jnp.asarray(seq))
      return jnp.sum(m.logits(h) * weights), (h, final["ssm"])

    orig = ssd.ssd_chunked  # the table loads the XLA SSD from its module when the model runs
    ssd.ssd_chunked = scan
    try:
      return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    finally:
      ssd.ssd_chunked = orig

  sequential = lambda x, dt, A, B, C, chunk, *, form, **kw: ssd.ssd_sequential(x, dt, A, B, C, **kw)
  (_, (h, final)), grads = run(ssd.ssd_chunked)
  (_, (h_ref, final_ref)), grads_ref = run(sequential)
  for got, ref in [(h, h_ref), (final, final_ref)] + list(zip(jax.tree.leaves(grads),
                                                               jax.tree.leaves(grads_ref))):
    got, ref = np.asarray(got), np.asarray(ref)
    assert np.isfinite(got).all()
    assert _rel(got, ref) < 1e-5, _rel(got, ref)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(HERE))
  from mamba_train.xla_flags import apply_cpu_defaults
  apply_cpu_defaults()  # as every entry point does, before JAX's first computation
  _worker(sys.argv[1])
