"""Expert parallelism (the 'expert' mesh axis, parallel/experts.py): train steps of
a mixture-of-experts hybrid on 8 simulated CPU devices, alone and with data,
fsdp, tensor and sequence, against the single-device steps (losses, every
parameter, the routers' tokens per expert and correction biases). Expert 8 alone
runs the one-host full-finetune layout (config.layout 'fsdp_expert': the non-expert
weights, gradients and moments split over the expert group, ZeRO-3), the others
the fsdp layout.

One subprocess (the device count is fixed when jax starts); the tests read what it saved.
"""

import json
import os
import sys
import time

import numpy as np
import pytest

STEPS = 2
MESHES = {
    "single": {"data": 1},
    "expert8": {"expert": 8},
    "e2f2t2": {"expert": 2, "fsdp": 2, "tensor": 2},
}
# Traced only, for the buffers it sends (dropless, against the capped run below): its
# dropless dispatch is expert8's and e2f2t2's, the sequence split only lengthening each
# device's rows, and a trained case is a compile out of the suite's ten minutes.
TRACED = {"e2s2d2": {"expert": 2, "sequence": 2, "data": 2}}
# With a capacity (moe.capacity_factor 0.5: each expert takes 4 of a 32-token
# row's 64 assignments, half an even share), so many are dropped: expert with
# sequence (the devices count after those before them in the row) and data.
CAPPED = {"single_cap": {"data": 1}, "e2s2d2_cap": TRACED["e2s2d2"]}
LAYOUT = {"expert8": "fsdp_expert"}  # the rest: 'fsdp'

CAPACITY = 0.5
# Grouped routing, a shared expert, the latent projection; every kind of layer.
MOE = dict(d_model=32, n_layer=4, d_state=16, headdim=16, chunk_size=16, vocab_size=64,
           layer_pattern="EM*E", attn_num_heads=4, attn_num_heads_kv=2, attn_head_dim=8,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           moe_shared_expert_intermediate_size=16, moe_latent_size=16, n_group=2, topk_group=1)


def _operands(jaxpr, primitive):
  """The operands of every `primitive` equation in a jaxpr and the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == primitive:
      yield from eqn.invars
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
        if hasattr(sub, "eqns"):
          yield from _operands(sub, primitive)


def _worker(out_dir):
  import jax

  from mamba_train import Mamba2Config, Runtime
  from mamba_train.data import SyntheticLoader
  from mamba_train.parallel import sharding
  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.train import balance, optim, state as train_state, step as trainer
  assert jax.device_count() == 8, jax.devices()
  cfg = Mamba2Config(**MOE)
  ocfg = dict(lr=1e-2, schedule="constant", warmup_frac=0.0, decay_frac=0.0, final_lr_frac=0.1,
              b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, state_dtype="float32")
  tx, schedule = optim.make_optimizer(ocfg, 10)
  flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(t)}
  results, init = {}, None
  for name, mesh_cfg in {**MESHES, **TRACED, **CAPPED}.items():
    t0 = time.perf_counter()
    mesh = make_mesh(mesh_cfg, jax.devices()[:1] if name.startswith("single") else jax.devices())
    rules = sharding.LAYOUTS[LAYOUT.get(name, "fsdp")]
    state = train_state.init_train_state(cfg, tx, mesh, seed=0, params=init, rules=rules)
    if init is None:
      init = jax.device_get(state.params)
    specs = lambda tree: {jax.tree_util.keystr(k): str(v.sharding.spec)
                          for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    spec = specs(state.params)
    # Adam's first moment of each parameter: the optimizer state lies as its parameter.
    mu = next(s.mu for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
              if hasattr(s, "mu"))
    rt = Runtime(moe_capacity_factor=CAPACITY if name in CAPPED else 0.0).resolve("cpu")
    step = trainer.make_train_step(cfg, rt, tx, schedule, mesh, rules=rules,
                                   moe=balance.MoeSpec(1e-2, 1e-3))
    loader = SyntheticLoader(vocab_size=64, seq_len=32, global_batch_size=8, seed=0)
    losses, loads, dropped, share = [], [], [], []
    sent = []  # the shapes of the all-to-alls' operands, from the traced step
    for i in range(STEPS):
      batch = trainer.to_global(next(loader), mesh)
      if i == 0 and name.startswith("e2s2"):
        sent = sorted({tuple(v.aval.shape) for v in _operands(step.trace(state, batch).jaxpr, "all_to_all")})
      if name in TRACED:
        break
      state, m = step(state, batch)
      losses.append(float(m["loss"]))
      loads.append(np.asarray(m["moe_tokens_per_expert"]).tolist())
      dropped.append(float(m["moe_dropped_tokens"]))
      share.append(float(m["moe_dropped_share"]))
    np.savez(os.path.join(out_dir, f"{name}.npz"), **flat(jax.device_get(state.params)))
    shard = list(state.params["moe"]["experts_up"].addressable_shards[0].data.shape)
    results[name] = {"losses": losses, "loads": loads, "dropped": dropped, "share": share, "specs": spec,
                     "mu_specs": specs(mu), "shard": shard, "sent": sent, "seconds": time.perf_counter() - t0}
  np.savez(os.path.join(out_dir, "init.npz"), **flat(init))
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, on_simulated_devices):
  out = tmp_path_factory.mktemp("experts")
  results = on_simulated_devices(__file__, out)
  return results, {name: dict(np.load(out / f"{name}.npz")) for name in [*results, "init"]}


@pytest.mark.parametrize("name", [n for n in [*MESHES, *CAPPED] if not n.startswith("single")])
def test_expert_parallel_steps_equal_single_device(runs, name):
  results, arrays = runs
  single = "single_cap" if name in CAPPED else "single"
  ref, got, init = arrays[single], arrays[name], arrays["init"]
  np.testing.assert_allclose(results[name]["losses"], results[single]["losses"], rtol=1e-6)
  # The same tokens reach the same experts, so the biases move alike, exactly;
  # with a capacity, the same assignments are dropped (counted per sequence).
  assert results[name]["loads"] == results[single]["loads"]
  assert results[name]["dropped"] == results[single]["dropped"]
  assert (min(results[name]["dropped"]) > 0) == (name in CAPPED)
  # The share: of 8 x 32 tokens' 2 assignments in each of the 2 'E' layers.
  np.testing.assert_allclose(results[name]["share"], np.array(results[name]["dropped"]) / (8 * 32 * 2 * 2),
                             rtol=1e-6)
  bias = "['moe']['e_score_correction_bias']"
  np.testing.assert_allclose(got[bias], ref[bias], rtol=0, atol=1e-9)
  for key in ref:
    moved = ref[key] - init[key]
    # Relative to the change the steps made. Adam divides each gradient by its own
    # size, so float32 reassociation across devices shows most where gradients are
    # smallest: 2e-4 at most here (the Mamba-2 layer's B/C projection), 5e-5 on the MoE layers.
    if key != bias and np.abs(moved).max() > 0:
      assert np.abs((got[key] - init[key]) - moved).max() / np.abs(moved).max() < 5e-4, key


def test_sequence_split_pools_the_capacity_buffers(runs):
  """Expert 2 x sequence 2 x data 2: each device holds 2 rows' halves (16 of 32 tokens,
  2 assignments each) for 4 local experts. Dropless it sends its own 64 assignments'
  rows to each of the 2 devices. With a capacity of 4 an expert of a 32-token row, a
  row's 4 experts on one device can take 4 x 4 = 16 of its assignments, all from one
  half: sized for its own half, each device would send 2 rows x 16 = 32 rows a
  destination; the two halves pool the row and each sends half of that, 16 (and the
  same assignments are kept: test_expert_parallel_steps_equal_single_device)."""
  results, _ = runs
  w = MOE["moe_latent_size"]
  # the rows' buffer goes as (2 destinations x rows a destination, w), split in 2 by the all-to-all
  assert [s for s in results["e2s2d2"]["sent"] if len(s) == 2] == [[2 * 64, w]]
  assert [s for s in results["e2s2d2_cap"]["sent"] if len(s) == 2] == [[2 * 16, w]]


def test_experts_split_by_the_rules(runs):
  results, _ = runs
  # Experts over the expert axis; an expert's width over fsdp, its hidden units over
  # tensor (axes of size 1 are named too: the rules, not the mesh, decide).
  for name in ("expert8", "e2f2t2"):
    for specs in (results[name]["specs"], results[name]["mu_specs"]):  # the moments lie as the weights
      assert specs["['moe']['experts_up']"] == "P(None, 'expert', 'fsdp', 'tensor')"
      assert specs["['moe']['experts_down']"] == "P(None, 'expert', 'tensor', 'fsdp')"
      # The non-expert weights: over fsdp, or over the expert group too (fsdp_expert).
      router = "P(None, ('fsdp', 'expert'), None)" if name == "expert8" else "P(None, 'fsdp', None)"
      assert specs["['moe']['router']"] == router
      embed = "P('tensor', ('fsdp', 'expert'))" if name == "expert8" else "P('tensor', 'fsdp')"
      assert specs["['embedding']"] == embed
  # (2 layers, 8 experts, width 16, 32 hidden units): really split.
  assert results["expert8"]["shard"] == [2, 1, 16, 32]
  assert results["e2f2t2"]["shard"] == [2, 4, 8, 16]


def test_megablox_row_tiles_for_nano():
  """The row tiles `experts_tpu.row_tiling` gives Nano's grouped matmuls (30,720 rows
  a v5p-128 chip receives), each compiled for v5p and v6e through libtpu
  (docs/bench/moe.md, "megablox's row tile"): 512 where VMEM allows (narrowing the
  output tile of a contraction of several k tiles), 256 where a float32 cotangent
  or result leaves no room. No compile here: the rule and its VMEM bound."""
  from mamba_train.ops import experts_tpu as et
  m, w, f = 30720, 2688, 1856
  # bfloat16 results (the recipe): forward and the rows' gradient, both projections
  assert et.row_tiling(m, w, f, 2, 2, 2) == (512, 896, 1024)
  assert et.row_tiling(m, f, w, 2, 2, 2) == (512, 1856, 896)
  # float32 results and cotangents (a float32 run's shapes at Nano's widths)
  assert et.row_tiling(m, f, w, 2, 2, 4) == (256, 1856, 896)
  assert et.row_tiling(m, f, w, 4, 2, 2) == (256, 1856, 896)
  # 15.8 MiB did not compile for v5p; 15.3 did, and the bound keeps below it
  assert et.gmm_vmem(512, 896, 1856, 2, 2, 2) > et.VMEM_BUDGET
  assert et.VMEM_BUDGET < et.gmm_vmem(512, 1856, 896, 2, 2, 4) < 16 * 2**20
  assert et.row_tiling(384, w, f) == (128, 896, 1856)  # rows padded to 128s: no larger tile divides


if __name__ == "__main__":
  # This checkout's library, not whichever one is installed.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  _worker(sys.argv[1])
