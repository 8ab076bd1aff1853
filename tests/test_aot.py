"""scripts/aot_compile.py, mamba_train/tools/aot.py and mamba_train/parallel/topology.py:
TPU slice and GPU host names, and the real train step compiled for a TPU slice
(libtpu from PyPI; TPU7x too) and for B200s (the CUDA plugin and ptxas: the `gpu` extra), both
in the `test` extra, on this CPU, its memory report, and the refusal of a config
that cannot fit a chip's HBM."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT, missing_gpu_wheels, require_libtpu

SCRIPT = os.path.join(ROOT, "scripts", "aot_compile.py")

from mamba_train.parallel.topology import topology_name  # noqa: E402


@pytest.mark.parametrize("name, expected", [
    ("v5e:2x2", ("v5e", "v5e:2x2")),
    ("v5p-128", ("v5p", "v5p:4x4x4")),  # 128 TensorCores = 64 chips
    ("v5p-8", ("v5p", "v5p:2x2x1")),
    ("v4-32", ("v4", "v4:2x2x4")),
    ("v5e-16", ("v5e", "v5e:4x4")),
    ("v5litepod-8", ("v5e", "v5e:2x4")),
    ("v6e-256", ("v6e", "v6e:16x16")),
    ("tpu7x-8", ("tpu7x", "tpu7x:2x2x1")),  # MaxText's name: 8 TensorCores = 4 chips
    ("tpu7x-512", ("tpu7x", "tpu7x:4x8x8")),
    ("TPU7x:2x2x2", ("tpu7x", "tpu7x:2x2x2")),
])
def test_topology_names(name, expected):
  assert topology_name(name) == expected


def test_bad_topology_names():
  for bad in ("v5p-3", "v7x:2x2", "tpu", "tpu7x-3"):
    with pytest.raises(ValueError):
      topology_name(bad)


def _run(*flags, config="tiny"):
  # libtpu parses XLA_FLAGS too and aborts on CPU-only flags (conftest's fast-compile set).
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT)
  return subprocess.run([sys.executable, SCRIPT, "--config", os.path.join(ROOT, "configs", f"{config}.py"),
                         *flags], capture_output=True, text=True, env=env, timeout=900)


# Small shapes keep the TPU compile (single-threaded, tens of seconds for the tiny
# config at full length on a 2-core host) short.
_SMALL = ("--config.seq_len=64", "--config.batch_size=4", "--config.model.chunk_size=32")


def test_tiny_hybrid_train_step_compiles_for_v6e(tmp_path):
  """A hybrid train step (Mamba-2, attention and MLP layers) for a v6e slice of four
  chips. (The pure Mamba-2 model compiles for v5e in the test below: one compile
  each, as the TPU compiler is most of this file's time.)"""
  require_libtpu()
  out = tmp_path / "report.json"
  # Narrower than the recipe (d_model 64): the TPU compile takes half the time.
  narrow = ("--config.model.d_model=64", "--config.model.d_intermediate=128", "--config.model.headdim=32",
            "--config.model.d_state=16", "--config.model.attn_head_dim=32")
  # Layers unrolled: the step holds every layer, so it is counted whole with no
  # differencing compiles, even with --every_layer (every_layer_cost has its own test below).
  # Length 128: the splash attention kernel's smallest block (TPU's default form).
  r = _run("--topology", "v6e:2x2", *_SMALL, *narrow, "--config.seq_len=128", "--json", str(out),
           "--config.runtime.unroll_layers=True", config="tiny-hybrid")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "memory per device" in r.stdout and "of 32.00 GiB HBM" in r.stdout, r.stdout
  import json
  rep = json.loads(out.read_text())
  assert rep["devices"] == 4 and rep["mesh"]["data"] == 4
  assert rep["model"]["layer_pattern"] == "MM*-" and rep["runtime"]["attention"] == "splash"
  assert rep["runtime"]["layer_impl"] == "fused"  # 'auto' on a v6e (the chip's kind, not only "tpu")
  mem = rep["memory"]
  # The state (parameters, two Adam moments, step, rng) is an argument of the step, per device.
  assert mem["argument_bytes"] > 0 and 0 < mem["peak_bytes"] < rep["hbm_bytes_per_device"]
  assert rep["cost"]["flops"] > 0 and rep["compile_s"] > 0
  # Counted whole, as the report says: XLA's FLOPs of the step itself, near the model's
  # own count (96% here: the tiny step's small ops round differently), with no differencing.
  assert rep["cost_every_layer"] == {k: rep["cost"][k] for k in ("flops", "bytes accessed")}
  ratio = rep["cost"]["flops"] / rep["model_flops_per_device"]
  assert 0.9 < ratio < 1.5, (rep["cost"], rep["model_flops_per_device"])
  assert "the layers unrolled, each counted as compiled" in r.stdout, r.stdout


def test_tiny_moe_train_step_compiles_for_b200_with_the_gpu_kernels(tmp_path):
  """The real train step of a tiny MoE hybrid ('ME') for one 8-GPU B200 host (CUDA
  plugin and the nvcc 12.9 wheel's ptxas for sm_100a, no GPU; H100's sm_90a compiles
  the same kernels in test_ssd_gpu.py and tokamax's in test_moe.py) in the one-host
  full-finetune layout: experts over expert 8, and ('auto' at fsdp 1) the non-expert
  weights, gradients and moments split over the expert group too (fsdp_expert), so the
  state a GPU holds is an eighth of the whole but the few small vectors left whole.
  ssd_impl, layer_impl and moe_impl auto resolve to the GPU kernels (SSD, the fused
  layer, tokamax's grouped matmul), whose cost estimates join XLA's counts (XLA counts a
  Pallas call as nothing on GPUs). Skips, saying why, without the gpu extra."""
  missing = missing_gpu_wheels()
  if missing:
    reason = f"GPU compile wheels absent ({', '.join(missing)}): pip install -e '.[gpu]'"
    print(reason)
    pytest.skip(reason)
  out = tmp_path / "report.json"
  moe = ("--config.model.d_model=64", "--config.model.headdim=16", "--config.model.d_state=16",
         "--config.model.n_layer=2", "--config.model.layer_pattern=ME", "--config.model.n_routed_experts=8",
         "--config.model.num_experts_per_tok=2", "--config.model.moe_intermediate_size=32",
         "--config.mesh.data=1", "--config.mesh.expert=8", "--config.moe.capacity_factor=1.25",
         "--config.batch_size=8")  # after _SMALL's 4: the last flag wins
  r = _run("--topology", "b200-8", *_SMALL, *moe, "--config.runtime.compute_dtype=bfloat16",
           "--json", str(out), "--every_layer=false")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Pallas kernels per device" in r.stdout and "of 167.64 GiB HBM" in r.stdout, r.stdout
  assert "layout fsdp_expert" in r.stdout, r.stdout
  import json
  import math

  import jax

  from mamba_train import Mamba2Config
  from mamba_train.train.state import param_shapes
  rep = json.loads(out.read_text())
  assert rep["devices"] == 8 and rep["chip"] == "NVIDIA B200" and rep["mesh"]["expert"] == 8
  assert rep["layout"] == "fsdp_expert"
  rt = rep["runtime"]
  assert (rt["ssd_impl"], rt["layer_impl"], rt["moe_impl"]) == ("triton", "fused_triton", "tokamax")
  # The state (float32 weights and two float32 moments): 8 devices hold it once, and
  # 9% more (A, D, dt bias and the conv stay whole). The fsdp layout would hold every
  # non-expert weight on every GPU: 5.1 times.
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(Mamba2Config(**rep["model"]))))
  assert 1.0 < 8 * rep["state_bytes_per_device"] / (12 * n) < 1.1
  k, xla = rep["kernel_cost"], rep["cost"]
  assert k["flops"] > 0 and k["bytes accessed"] > 0 and xla["flops"] > 0
  assert rep["cost_with_kernels"]["flops"] == pytest.approx(xla["flops"] + k["flops"])
  assert 0 < rep["memory"]["peak_bytes"] < rep["hbm_bytes_per_device"]


def test_gpu_topology_names():
  from mamba_train.parallel.topology import gpu_topology_name
  assert gpu_topology_name("h100-8") == ("h100", 1, 8)
  assert gpu_topology_name("H200-64") == ("h200", 8, 8)
  assert gpu_topology_name("h100-2") == ("h100", 1, 2)
  assert gpu_topology_name("b200-16") == ("b200", 2, 8)
  assert gpu_topology_name("gb200-72") == ("gb200", 18, 4)  # NVL72: compute trays of 4
  for bad in ("h100-12", "a100-8", "h100-0", "h100", "gb200-6"):
    with pytest.raises(ValueError):
      gpu_topology_name(bad)


def test_too_large_for_hbm_is_refused():
  require_libtpu()
  # A 4M-row vocabulary: 1e9 embedding parameters, 4 GB, plus gradients and two Adam
  # moments, replicated over data=4: far past a v5e chip's 16 GiB.
  r = _run("--topology", "v5e:2x2", *_SMALL, "--config.model.vocab_size=4000000")
  assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
  assert "DOES NOT FIT" in r.stderr and "To fit" in r.stderr, r.stderr[-3000:]
  assert "fsdp" in r.stderr and "batch_size" in r.stderr and "remat" in r.stderr


def test_gpu_reports_count_by_trips():
  """GPU reports count by trip counts (a hybrid's too: its skipped layers by their share
  of the trips); TPU ones only when asked."""
  from mamba_train.tools.aot import counts_by_trips
  assert counts_by_trips(False, True, True) and not counts_by_trips(False, True, False)
  assert not counts_by_trips(False, False, True) and counts_by_trips(True, False, False)


def test_every_layer_cost_counts_each_layer():
  """The every-layer counts (one layer, plus n - 1 times the difference two unrolled
  layers make) against XLA's counts of the whole step compiled with its layers
  unrolled (which XLA counts in full). On CPU: the arithmetic is the same for any
  backend."""
  import jax

  from configs import base
  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.tools import aot
  from mamba_train.train import run_config
  c = base.get_config()
  c.model.update(d_model=32, n_layer=3, vocab_size=64, d_state=8, headdim=8, chunk_size=8)
  c.seq_len, c.batch_size = 8, 1
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  plan = run_config.validate(c, num_devices=1, platform=mesh.devices.flat[0].platform)
  got = aot.every_layer_cost(plan, mesh, {})
  want = aot.cost_with_layers(plan, mesh, 3, unroll=True)
  for k in ("flops", "bytes accessed"):
    assert abs(got[k] - want[k]) <= 0.02 * want[k], (k, got[k], want[k])


_RECOMPUTE = """
import jax
from configs import base
from mamba_train.parallel.mesh import make_mesh
from mamba_train.parallel.topology import tpu_devices
from mamba_train.tools import aot
from mamba_train.train import run_config
devices = tpu_devices("v6e:1x1")[2]
mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices[:1])
out = {}
for remat in ("full", "save_in_proj"):
  c = base.get_config()  # the Pallas SSD's smallest chunk (128) and head dim (64)
  c.model.update(d_model=128, n_layer=1, vocab_size=128, d_state=64, headdim=64, chunk_size=128)
  c.seq_len, c.batch_size = 128, 1
  c.runtime.update(remat=remat, compute_dtype="bfloat16")
  plan = run_config.validate(c, num_devices=1, platform=devices[0].platform)
  out[remat] = aot.cost_with_layers(plan, mesh, 1, unroll=False)["flops"]
m = plan.model
out["in_proj"] = 2 * c.seq_len * m.d_model * (2 * m.d_inner + 2 * m.ngroups * m.d_state + m.nheads)
# The same one-layer step (the Pallas SSD kernels inside) for one TensorCore of a TPU7x,
# in this process: the newest chip as a compile target at the cost of one small compile.
devices7 = tpu_devices("tpu7x-8")[2]
mesh7 = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices7[:1])
plan7 = run_config.validate(c, num_devices=1, platform=devices7[0].platform)
out["tpu7x"] = [devices7[0].device_kind, len(devices7), aot.cost_with_layers(plan7, mesh7, 1, unroll=False)["flops"],
                run_config.validate(c, num_devices=1, platform=devices7[0].platform,
                                    device_kind=devices7[0].device_kind).runtime.layer_impl]
result = out
"""


# The TPU programs this file compiles in Python (not through scripts/aot_compile.py), run in
# one libtpu process for the module: each snippet sets `result`, and a test reads its own
# (a snippet that raised gives its traceback to its test alone): one start of JAX, libtpu
# and the package instead of one a test.
_ON_LIBTPU = """
import json, sys, traceback
out = {}
for name, code in json.loads(sys.stdin.read()).items():
  scope = {}
  try:
    exec(code, scope)
    out[name] = {"result": scope["result"]}
  except Exception:
    out[name] = {"error": traceback.format_exc()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def on_libtpu():
  """{snippet name: its `result`, or its traceback}: every snippet of _SNIPPETS, compiled
  in one fresh process for TPUs."""
  require_libtpu()
  import json
  # libtpu parses XLA_FLAGS too and aborts on CPU-only flags (conftest's fast-compile set).
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT)
  r = subprocess.run([sys.executable, "-c", _ON_LIBTPU], input=json.dumps(_SNIPPETS), capture_output=True,
                     text=True, env=env, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _result(on_libtpu, name):
  got = on_libtpu[name]
  assert "error" not in got, got.get("error", "")[-3000:]
  return got["result"]


def test_every_layer_programs_keep_the_recompute_on_tpu(on_libtpu):
  """The every-layer count's programs run their layers as straight-line code (one
  layer, two unrolled), where a remat with prevent_cse=False let XLA:TPU merge the
  backward's recomputation with the forward: `full` and `save_in_proj` counted the
  same FLOPs. The one-layer train step for one v6e must count `full` above
  `save_in_proj` by the in_proj matmul it recomputes, 2 T d (2i + 2gn + h). In the
  same process the `save_in_proj` step compiles for a TPU7x TensorCore (tpu7x-8), and
  'auto' picks the fused layer for the device kind libtpu reports there."""
  flops = _result(on_libtpu, "recompute")
  assert flops["full"] - flops["save_in_proj"] == pytest.approx(flops["in_proj"], rel=0.02), flops
  # TPU7x: eight TensorCores of four chips as eight devices, and the same program's FLOPs.
  kind, n, flops7, layer7 = flops["tpu7x"]
  assert kind == "TPU7x" and n == 8, flops
  assert layer7 == "fused", flops  # 'auto' on the kind libtpu reports (FUSED_LAYER_CHIPS)
  assert flops7 == pytest.approx(flops["save_in_proj"], rel=0.02), flops


def test_hybrid_every_layer_cost_counts_each_kind():
  """A hybrid's every-layer counts (one layer of each kind from small unrolled
  patterns) against XLA's counts of the whole step with its layers unrolled. With
  LoRA on attention too: the one-layer 'M' program has no attention to adapt, so the
  count must drop that kind's adapters (without adapters the same counts run minus
  that filter; the pure Mamba-2 model's case is the test above)."""
  import jax

  from configs import base
  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.tools import aot
  from mamba_train.train import run_config
  c = base.get_config()
  # (Mamba-2 and attention: an MoE layer's train step alone compiles for tens of seconds here.)
  c.model.update(d_model=32, n_layer=3, vocab_size=64, d_state=8, headdim=8, chunk_size=8,
                 layer_pattern="M*M", attn_num_heads=2, attn_head_dim=8)
  c.seq_len, c.batch_size = 8, 1
  c.lora.rank = 2
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  plan = run_config.validate(c, num_devices=1, platform=mesh.devices.flat[0].platform)
  got = aot.hybrid_every_layer_cost(plan, mesh)
  want = aot.cost_with_layers(plan, mesh, 3, unroll=True)
  for k in ("flops", "bytes accessed"):
    assert abs(got[k] - want[k]) <= 0.02 * want[k], (k, got[k], want[k])


def test_long_length_asks_for_more_sequence_parallelism():
  # The advice alone (no compile): 300 GiB of activations per device against a
  # 95 GiB chip holding 10 GiB of state needs the sequence split 4 ways more.
  from configs import base
  from mamba_train.tools import aot
  c = base.get_config()
  c.seq_len = 131072
  G = 2**30
  first = aot.sequence_advice(c, 10 * G, 95 * G, 300 * G)
  assert "seq_len 131072 needs more sequence parallelism" in first
  assert "--config.mesh.sequence=4 devices (now 1; 32768 positions per device)" in first
  assert aot.sequence_advice(c, 10 * G, 95 * G, 20 * G) is None  # fits: nothing to say


def test_trip_scaled_cost_counts_each_loop_body_as_often_as_it_runs():
  """A scan of 5 holding a scan of 3 (CPU): the matmuls and sines counted by hand, every
  iteration; XLA's own analysis counts each body once."""
  import jax
  import jax.numpy as jnp

  from mamba_train.tools import hlo

  def f(x):
    def outer(c, _):
      c = jax.lax.scan(lambda c, _: (jnp.sin(c @ c), None), c, None, length=3)[0]
      return c @ c, None
    return jax.lax.scan(outer, x, None, length=5)[0]

  got = hlo.trip_scaled_cost(jax.jit(f).lower(jnp.ones((64, 64))).compile())
  matmul = 2 * 64 ** 3
  assert sorted(n for _, n in got["loops"]) == [3, 5]
  assert got["transcendentals"] == 5 * 3 * 64 * 64
  assert abs(got["flops"] - 5 * 4 * matmul) < 1e-5 * 5 * 4 * matmul  # loop counters' adds aside
  assert abs(got["once"]["flops"] - 2 * matmul) < 1e-5 * 2 * matmul
  assert got["bytes accessed"] > 5 * got["once"]["bytes accessed"]
  # XLA:TPU's windowed einsums count in u32 (a 32-way gather as 16 steps of two shards).
  cond = ["%c = u32[]{:T(128)} constant(16)", "ROOT %lt = pred[] compare(%i, %c), direction=LT"]
  assert hlo._trips("%w = (u32[]) while(%t), condition=%cond, body=%body", cond) == 16


def test_trip_scaled_cost_counts_a_skipped_layer_only_where_taken(monkeypatch):
  """A hybrid's scan of steps ('MEMEM*EMEM*M' runs as 6 steps of order '*EM': '*' in 2
  of them, 'E' in 4) skips a kind by `lax.cond`, which XLA's analysis counts at its
  costliest branch every trip. With each branch in the share of trips its scope says
  take it, the forward and backward FLOPs match the same layers unrolled (no loop, no
  cond), and each branch runs that share of its loop's trips."""
  import jax
  import jax.numpy as jnp

  from mamba_train.model import pattern
  from mamba_train.tools import hlo

  pat = "MEMEM*EMEM*M"
  pl = pattern.plan(pat, "steps")
  assert (pl.steps.n_steps, sum(pl.steps.taken["*"]), sum(pl.steps.taken["E"])) == (6, 2, 4)
  width = {"M": 16, "E": 24, "*": 96}  # '*' the costliest, as attention in Nano
  layer = lambda p, h, s: (jnp.tanh(h @ p) @ p.T, None)
  params = {k: jnp.ones((pat.count(k), 32, w)) / 32 for k, w in width.items()}

  def loss(params, unroll):
    return jnp.sum(pattern.run(pl, dict.fromkeys(width, layer), params, {}, jnp.ones((128, 32)), unroll=unroll)[0])

  compiled = {u: jax.jit(jax.grad(loss), static_argnums=1).lower(params, u).compile() for u in (False, True)}
  got = hlo.trip_scaled_cost(compiled[False])
  want = compiled[True].cost_analysis()["flops"]
  # The 4 conditionals (2 kinds, forward and backward): each branch runs in its share of 6 trips.
  text = compiled[False].as_text()
  times = hlo.loop_multiplicities(text)
  conds = [hlo.branch_shares(l) for l in text.splitlines() if " conditional(" in l]
  assert len(conds) == 4 and all(c is not None for c in conds)
  assert sorted(sorted(c.values()) for c in conds) == [[1 / 3, 2 / 3]] * 4
  assert all(times[b] == 6 * share for c in conds for b, share in c.items())
  # Within 3%: the scan's own backward (its slots' cotangents) adds 1.5-3% to any
  # pattern's, conds or none. The costliest branch every trip counts 30% more.
  assert abs(got["flops"] - want) <= 0.03 * want, (got["flops"], want)
  monkeypatch.setattr(hlo, "branch_shares", lambda line: None)
  assert hlo.trip_scaled_cost(compiled[False])["flops"] > 1.3 * want


_TPU_TRIPS = """
import tempfile
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import tpu_devices
from mamba_train.tools import hlo
mesh = Mesh(tpu_devices("v5p:2x2x1")[2], ("x",))
def double(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2
def local(x, i):  # a gather v5p offloads to its SparseCores, an add, a Pallas kernel with an estimate
  est = pl.CostEstimate(flops=1000, bytes_accessed=4096, transcendentals=7)
  return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), cost_estimate=est)(x[i] + 1)
def f(x, i):
  step = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"), check_vma=False)
  return jax.lax.fori_loop(0, 3, lambda _, x: step(x, i), x)
x = jax.ShapeDtypeStruct((8192, 256), jnp.float32, sharding=NamedSharding(mesh, P("x")))
i = jax.ShapeDtypeStruct((8192,), jnp.int32, sharding=NamedSharding(mesh, P("x")))
with tempfile.TemporaryDirectory() as d:
  compiled = jax.jit(f).lower(x, i).compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_proto": True})
  proto = hlo.dumped_module_proto(d)
got = hlo.trip_scaled_cost(compiled, proto)
kernels = hlo.kernel_costs(hlo.optimised_text(compiled, proto), jax.jit(f).trace(x, i).jaxpr, trip_counts=True)
result = {**{k: v for k, v in got.items() if k != "once"}, **{"kernel " + k: v for k, v in kernels.items()},
          "offloaded": b"async-update" in proto}
"""
_SNIPPETS = {"recompute": _RECOMPUTE, "tpu_trips": _TPU_TRIPS}


def test_trip_scaled_cost_reads_a_multi_chip_tpu_program_and_its_kernels(on_libtpu):
  """XLA:TPU's program for four v5p chips with a SparseCore-offloaded gather (whose
  `async-update`s jaxlib cannot read back from the executable) and a Pallas kernel
  in a loop of 3: read from XLA's dump, the loop body counted three times, the
  kernel (`kernel_costs` with trip counts) by the estimate its backend config carries
  (three times its 1000 FLOPs), the add to each
  device's 2048 x 256 gathered rows three times."""
  got = _result(on_libtpu, "tpu_trips")
  assert got["offloaded"], got  # the rewrite the reader needs was exercised
  assert [n for _, n in got["loops"]] == [3], got
  assert got["kernel flops"] == 3 * 1000 and got["kernel transcendentals"] == 3 * 7, got
  assert got["kernel bytes accessed"] == 3 * 4096, got
  assert 3 * 2048 * 256 <= got["flops"] <= 1.05 * 3 * 2048 * 256, got  # the loop's counter adds aside


def test_kernel_costs_with_trip_counts_count_a_kernel_in_a_loop_body_as_often_as_it_runs():
  """`hlo.kernel_costs(..., trip_counts=True)`, what `--trip_counts` adds to XLA's
  trip-scaled count on GPUs: a Pallas call in a scan of 5 holding a scan of 3 counted
  15 times and one in the entry once (text only: the traced program gives the
  estimates, an HLO text written here the calls); each once without trip counts."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl

  from mamba_train.tools import hlo

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  est = pl.CostEstimate(flops=10, transcendentals=1, bytes_accessed=100)
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), cost_estimate=est,
                        interpret=True, name="probe_kernel")
  jaxpr = jax.jit(call).trace(jnp.ones((8,), jnp.float32)).jaxpr
  cc = '  %{0} = f32[8]{{0}} custom-call(f32[8]{{0}} %p), custom_call_target="__gpu$xla.gpu.triton", ' \
       'backend_config={{"name":"probe_kernel"}}'
  text = "\n".join([
      "HloModule m", "",
      "%inner_body (p: f32[8]) -> f32[8] {", cc.format("k1"), "}", "",
      "%inner_cond (p: f32[8]) -> pred[] {", "  %n = s32[] constant(3)", "}", "",
      "%outer_body (p: f32[8]) -> f32[8] {",
      "  %w = f32[8]{0} while(f32[8]{0} %p), condition=%inner_cond, body=%inner_body", "}", "",
      "%outer_cond (p: f32[8]) -> pred[] {", "  %n = s32[] constant(5)", "}", "",
      "ENTRY %main (p: f32[8]) -> f32[8] {", cc.format("k0"),
      "  %w = f32[8]{0} while(f32[8]{0} %k0), condition=%outer_cond, body=%outer_body", "}", ""])
  assert hlo.loop_multiplicities(text) == {"main": 1, "outer_body": 5, "outer_cond": 1, "inner_body": 15,
                                           "inner_cond": 5}
  once = hlo.kernel_costs(text, jaxpr)
  scaled = hlo.kernel_costs(text, jaxpr, trip_counts=True)
  assert once == {"flops": 20.0, "bytes accessed": 200.0, "transcendentals": 2.0}
  assert scaled == {"flops": 160.0, "bytes accessed": 1600.0, "transcendentals": 16.0}
