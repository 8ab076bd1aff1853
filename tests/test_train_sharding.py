"""Sharded train steps on 8 simulated CPU devices equal the single-device step (the XLA
layer, and the TPU and GPU kernels of the layer and SSD in Pallas' interpreter);
gradient accumulation equals the big batch; non-finite steps are skipped.

Everything runs in one subprocess (the device count is fixed when jax starts,
and compiling is most of the cost); the tests below read what it saved.
"""

import json
import os
import sys
import time

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
# name -> (mesh config, grad_accum). Data parallelism alone is not a case of its own: each
# case is a compile out of the suite's ten minutes, and data is an axis of every d2f2t2 one.
MESHES = {
    "single": ({"data": 1, "fsdp": 1, "tensor": 1}, 1),
    "fsdp8": ({"data": 1, "fsdp": 8, "tensor": 1}, 1),
    "d2f2t2": ({"data": 2, "fsdp": 2, "tensor": 2}, 1),
    # The layer's Mosaic kernels (conv + SiLU, gated norm; Pallas' interpreter) and the
    # fused SSD, each run per device's batch and heads under the mesh, against the XLA step.
    "d2f2t2_kernels": ({"data": 2, "fsdp": 2, "tensor": 2}, 1),
    # The same, the GPU's (Triton), in 2 micro-batches: the gradient accumulation's case too
    # (a case is a compile; the XLA step accumulates under a mesh in test_sequence_parallel).
    "d2f2t2_gpu_kernels_accum2": ({"data": 2, "fsdp": 2, "tensor": 2}, 2),
    # A hybrid (Mamba-2, GQA attention, MLP): heads and MLP units split by tensor.
    "hybrid_single": ({"data": 1, "fsdp": 1, "tensor": 1}, 1),
    "hybrid_d2f2t2": ({"data": 2, "fsdp": 2, "tensor": 2}, 1),
}
HYBRID = dict(layer_pattern="M*-", n_layer=3, attn_num_heads=4, attn_num_heads_kv=2,
              attn_head_dim=8, d_intermediate=64)


def _worker(out_dir):
  import jax

  from mamba_train import Runtime, config_for
  from mamba_train.data import SyntheticLoader
  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.parallel.sharding import logical_to_spec
  from mamba_train.train import optim, state as train_state, step as trainer
  assert jax.device_count() == 8, jax.devices()
  # Several chunks and a ragged tail (40 = 2.5 chunks of 16); 4 heads split by tensor=2.
  cfg = config_for("tiny", d_model=32, n_layer=2, d_state=16, headdim=16, chunk_size=16, vocab_size=64)
  ocfg = dict(lr=1e-2, schedule="constant", warmup_frac=0.0, decay_frac=0.0, final_lr_frac=0.1,
              b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, state_dtype="float32")
  tx, schedule = optim.make_optimizer(ocfg, 10)
  pure_cfg, hybrid_cfg = cfg, cfg.replace(**HYBRID)
  results = {}
  for name, (mesh_cfg, accum) in MESHES.items():
    t0 = time.perf_counter()
    cfg = hybrid_cfg if name.startswith("hybrid") else pure_cfg
    axes = train_state.param_logical_axes(cfg)
    ref = "hybrid_single" if name.startswith("hybrid") else "single"
    devices = jax.devices()[:1] if name == ref else jax.devices()
    mesh = make_mesh(mesh_cfg, devices)
    # Random init, created sharded, on three meshes; the others start from the same values.
    from_ref = name not in ("single", "d2f2t2", "hybrid_single")
    state = train_state.init_train_state(cfg, tx, mesh, seed=0,
                                         params=results[ref]["init"] if from_ref else None)
    init = jax.device_get(state.params)
    mu = state.opt_state.inner_state[1].mu  # chain: clip, adam, decay, lr
    flat = lambda t: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(t)}
    specs = {k: [str(a.sharding.spec), str(b.sharding.spec),
                 str(logical_to_spec(ax)), list(a.addressable_shards[0].data.shape), list(a.shape)]
             for (k, a), b, ax in zip(flat(state.params).items(), flat(mu).values(),
                                      jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)))}
    rt = (Runtime(layer_impl="triton_interpret", ssd_impl="triton_interpret") if "_gpu_kernels" in name
          else Runtime(layer_impl="mosaic_interpret", ssd_impl="interpret") if "_kernels" in name
          else Runtime()).resolve("cpu")
    step = trainer.make_train_step(cfg, rt, tx, schedule, mesh, grad_accum=accum)
    loader = SyntheticLoader(vocab_size=64, seq_len=40, global_batch_size=8, seed=0)
    losses = []
    for _ in range(STEPS):
      state, m = step(state, trainer.to_global(next(loader), mesh))
      losses.append(float(m["loss"]))
    np.savez(os.path.join(out_dir, f"{name}.npz"),
             **{"init" + k: v for k, v in flat(init).items()},
             **{"final" + k: v for k, v in flat(jax.device_get(state.params)).items()})
    results[name] = {"losses": losses, "specs": specs, "steps": int(state.step),
                     "seconds": time.perf_counter() - t0}  # what each case costs the suite
    if name == ref:
      results[name]["init"] = init
    if name == "single":
      results[name]["nonfinite"] = _nonfinite_steps(step, state, loader, mesh)
  del results["single"]["init"], results["hybrid_single"]["init"]
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f)


def _nonfinite_steps(step, state, loader, mesh):
  """Two steps with a NaN loss (a NaN loss mask), then a good one: the bad ones
  change nothing and count a streak; the good one applies and resets it."""
  import jax

  from mamba_train.train import step as trainer
  before = jax.device_get(state.params)
  out = []
  for bad in (True, True, False):
    batch = next(loader)
    if bad:
      batch["loss_mask"] = batch["loss_mask"] * float("nan")
    state, m = step(state, trainer.to_global(batch, mesh))
    after = jax.device_get(state.params)
    changed = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    out.append({"loss": float(m["loss"]), "streak": int(m["nonfinite_streak"]), "changed": changed,
                "step": int(state.step)})
    before = after
  return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, on_simulated_devices):
  out = tmp_path_factory.mktemp("sharding")
  results = on_simulated_devices(__file__, out)
  arrays = {name: dict(np.load(out / f"{name}.npz")) for name in results}
  return results, arrays


@pytest.mark.parametrize("name", [n for n in MESHES if n not in ("single", "hybrid_single")])
def test_sharded_steps_equal_single_device(runs, name):
  results, arrays = runs
  single = "hybrid_single" if name.startswith("hybrid") else "single"
  ref, got = arrays[single], arrays[name]
  assert results[name]["steps"] == STEPS
  np.testing.assert_allclose(results[name]["losses"], results[single]["losses"], rtol=1e-6)
  for key in ref:
    if key.startswith("init"):  # the same init on every mesh (d2f2t2 made its own, sharded)
      np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
  for key in ref:
    if key.startswith("final"):
      # Judge the change the steps made, relative to its size: lr 1e-2 moves every
      # parameter by about 3e-2, and float32 reassociation across devices is ~1e-6 of that.
      start = "init" + key[len("final"):]
      moved = ref[key] - ref[start]
      err = np.abs((got[key] - got[start]) - moved).max() / np.abs(moved).max()
      assert err < 1e-4, (key, err)


def test_params_and_adam_state_sharded_by_rules(runs):
  results, _ = runs
  specs = results["d2f2t2"]["specs"]
  expected = {  # spot checks, written out by hand from sharding.DEFAULT_RULES
      "['embedding']": P("tensor", "fsdp"),
      "['layers']['in_proj_zx']": P(None, "fsdp", None, "tensor"),
      "['layers']['out_proj']": P(None, ("tensor", "fsdp"), None),  # rows over fsdp too
      "['layers']['A_log']": P(None, "tensor"),
      "['norm_f']": P("fsdp"),
  }
  for key, spec in expected.items():
    assert specs[key][0] == str(spec), (key, specs[key])
  for key, (param_spec, mu_spec, rule_spec, shard_shape, shape) in specs.items():
    assert param_spec == mu_spec == rule_spec, key  # all from the rules; Adam state follows params
  shard, full = specs["['layers']['in_proj_zx']"][3:]
  assert shard == [full[0], full[1] // 2, full[2], full[3] // 2]  # really split 2 x 2
  hybrid = results["hybrid_d2f2t2"]["specs"]
  for key, spec in {"['attn']['q_proj']": P(None, "fsdp", "tensor", None),
                    "['attn']['k_proj']": P(None, "fsdp", "tensor", None),
                    "['attn']['o_proj']": P(None, "tensor", None, "fsdp"),
                    "['mlp']['up_proj']": P(None, "fsdp", "tensor"),
                    "['mlp']['down_proj']": P(None, "tensor", "fsdp")}.items():
    assert hybrid[key][0] == hybrid[key][1] == str(spec), (key, hybrid[key])
  for key, (param_spec, *_rest, shard_shape, shape) in results["fsdp8"]["specs"].items():
    if "fsdp" in param_spec:
      assert np.prod(shard_shape) * 8 == np.prod(shape), key


def test_grad_accumulation_equals_big_batch(runs):
  # d2f2t2_gpu_kernels_accum2 runs 2 micro-batches of 4; "single" runs the 8 at once (checked
  # above with the other meshes); here the accumulated run against its own mesh without it.
  results, arrays = runs
  np.testing.assert_allclose(results["d2f2t2_gpu_kernels_accum2"]["losses"], results["d2f2t2"]["losses"],
                             rtol=1e-6)


def test_nonfinite_steps_are_skipped(runs):
  results, _ = runs
  bad1, bad2, good = results["single"]["nonfinite"]
  assert bad1["loss"] != bad1["loss"] and bad2["loss"] != bad2["loss"]  # NaN
  assert (bad1["streak"], bad2["streak"], good["streak"]) == (1, 2, 0)
  assert (bad1["changed"], bad2["changed"], good["changed"]) == (False, False, True)
  assert good["step"] == STEPS + 3


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(HERE))
  from mamba_train.xla_flags import apply_cpu_defaults
  apply_cpu_defaults()  # as every entry point does, before JAX's first computation
  _worker(sys.argv[1])
