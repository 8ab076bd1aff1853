"""Compile-only figures: compile time against depth, peak memory against length,
and the 2.7b forward compiled ahead of time for one TPU v6e chip.

Nothing here runs a program, so the shapes can be those of a machine one does
not have. The layers run in a `lax.scan`, so compile time should stay flat with
depth; memory is XLA's memory analysis of the compiled program (arguments +
outputs + scratch - donated). The TPU figure needs libtpu (the TPU compiler, no
TPU): XLA's cost analysis of the 2.7b forward against the v6e datasheet
(`mamba_train.metrics.CHIPS`) says whether it is compute- or memory-bound.
"""

from __future__ import annotations

import resource

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import peers
from benchmarks.common import F32, add_rows, compile_fn, log, model_cfg, one_device_mesh, run_plan, runtime
from mamba_train import metrics
from mamba_train.model.config import config_for
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.runtime import Runtime
from mamba_train.parallel.mesh import make_mesh
from mamba_train.parallel.topology import tpu_devices
from mamba_train.train.state import with_shardings
from mamba_train.train.step import abstract_batch, build

TPU = "v6e:1x1"


def abstract_forward(cfg, rt, out_shardings=None, inference: bool = False):
  """(jitted forward (params, ids) -> logits, abstract params) of `cfg` run by `rt`;
  with `inference`, over the weights a served model holds (`Mamba2LM.for_inference`)."""
  make = lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: make().for_inference() if inference else make()))
  return jax.jit(lambda p, i: nnx.merge(graphdef, p)(i), out_shardings=out_shardings), params


def bench_compile(args, results, size):
  """Compile time of forward and train step against depth (flat: layers are
  scanned), and, with libtpu, the 2.7b forward at l=4096 for one TPU v6e chip."""
  rows = []
  mesh = one_device_mesh()
  base_cfg, rt = model_cfg(args, size), runtime(args)
  l, batch = args.seq_len or 512, args.batch or 1
  for depth in sorted({1, 2, 4, base_cfg.n_layer}):
    fwd, params = abstract_forward(base_cfg.replace(n_layer=depth), rt)
    _, info = compile_fn(fwd, params, jax.ShapeDtypeStruct((batch, l), jnp.int32))
    rows.append({"bench": "compile", "impl": "ours", "program": "forward", "config": size, "n_layer": depth,
                 "batch": batch, "seq_len": l, "target": "cpu", **info})
    built = build(run_plan(args, size, batch, l, n_layer=depth), mesh, init=False)
    _, info = compile_fn(built.train_step, built.state, abstract_batch(batch, l, mesh))
    rows.append({"bench": "compile", "impl": "ours", "program": "train step", "config": size, "n_layer": depth,
                 "batch": batch, "seq_len": l, "target": "cpu", **info})
    for r in rows[-2:]:
      log(f"  compile {r['program']:10s} {size} n_layer {depth:2d}: {r['compile_s']:.2f}s wall, "
          f"{r['compile_cpu_s']:.2f}s cpu")
  if not args.skip_tpu:
    rows += bench_compile_tpu(args)
  return add_rows(results, rows)


def bench_memory(args, results, size, lengths, batch):
  """Peak memory (XLA memory analysis) of forward and train step against length; compile only."""
  mesh = one_device_mesh()
  rows = []
  fwd, params = abstract_forward(model_cfg(args, size), runtime(args))
  built = build(run_plan(args, size, batch, lengths[0]), mesh, init=False)
  for l in lengths:
    for program, fn, a in (("forward", fwd, (params, jax.ShapeDtypeStruct((batch, l), jnp.int32))),
                           ("train step", built.train_step, (built.state, abstract_batch(batch, l, mesh)))):
      _, info = compile_fn(fn, *a)
      rows.append({"bench": "memory", "impl": "ours", "program": program, "config": size, "batch": batch,
                   "seq_len": l, "dtype": args.dtype, **info})
      log(f"  memory {program:10s} {size} {batch}x{l}: peak {info.get('peak_bytes', 0) / 2**20:.0f} MiB "
          f"(scratch {info.get('temp_bytes', 0) / 2**20:.0f} MiB)")
  results["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return add_rows(results, rows)


# ----------------------------------------------------------------------------
# Ahead of time, for a TPU.


def _on(sharding, tree):
  """Abstract `tree` (shapes and dtypes), every leaf placed by `sharding`."""
  return with_shardings(tree, jax.tree.map(lambda _: sharding, tree))


def compile_forward(model_cfg, runtime: Runtime, batch: int, seq_len: int, topology: str = TPU,
                    inference: bool = True) -> dict:
  """Compile the model's forward (logits) for one slice, batch split over all its
  devices, with `runtime` resolved for TPU, over the weights a served model holds
  (`Mamba2LM.for_inference`; `inference=False`: the float32 training weights): the lowering (tracing + StableHLO) and
  compile (XLA's passes + libtpu's code generation) times, wall and this process's
  CPU seconds, XLA's memory and cost analyses, the model's FLOPs and the roofline
  time at the chip's datasheet peaks."""
  gen, topo, devices = tpu_devices(topology)
  chip = metrics.CHIPS[gen]
  rt = runtime.resolve("tpu", devices[0].device_kind)
  mesh = make_mesh({"data": -1}, devices)
  # The logits row-major, as a host reads them. TPU's default layout for an f32
  # (b, l, 50277) result is positions-minor (the vocabulary is no multiple of
  # 128), and meeting it copies the logits once more (0.82e9 bytes at 2.7b l=4096).
  fwd, params = abstract_forward(model_cfg, rt, Format(Layout(major_to_minor=(0, 1, 2)),
                                                       NamedSharding(mesh, P("data"))), inference)
  ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=NamedSharding(mesh, P("data")))
  with metrics.Timer() as lt:
    lowered = fwd.lower(_on(NamedSharding(mesh, P()), params), ids)
  with metrics.Timer() as t:
    compiled = lowered.compile()
  cost = metrics.compiled_cost(compiled)
  out = {"topology": topo, "chip": chip.name, "lower_s": lt.seconds, "lower_cpu_s": lt.cpu_seconds,
         "compile_s": t.seconds, "compile_cpu_s": t.cpu_seconds,
         "memory": metrics.compiled_memory(compiled), "cost": cost,
         "model_flops": metrics.forward_flops_per_token(model_cfg, rt, seq_len) * batch * seq_len}
  if cost.get("flops"):
    out["roofline"] = metrics.roofline_seconds(cost["flops"], cost.get("bytes accessed", 0.0),
                                               chip.peak_flops, chip.hbm_bandwidth)
  return out


def outside_scan_cost(cfg, runtime: Runtime, batch: int, seq_len: int) -> dict[str, float]:
  """XLA's counts of the embedding, final norm and LM head alone, for one v6e chip."""
  _, _, devices = tpu_devices(TPU)
  rep = NamedSharding(make_mesh({"data": -1}, devices), P())
  rt = runtime.resolve("tpu")
  graphdef, params = nnx.split(nnx.eval_shape(
      lambda: Mamba2LM(cfg.replace(n_layer=1), rngs=nnx.Rngs(0), runtime=rt)))
  ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=rep)
  f = jax.jit(lambda p, i: (lambda m: m.logits(m.embed(i)))(nnx.merge(graphdef, p)),
              out_shardings=Format(Layout(major_to_minor=(0, 1, 2)), rep))  # as compile_forward
  with metrics.Timer() as t:
    compiled = f.lower(_on(rep, params), ids).compile()
  return {**metrics.compiled_cost(compiled), "cpu_s": t.cpu_seconds}


def scaled_forward_counts(cfg, rt: Runtime, batch: int, seq_len: int) -> dict[str, float]:
  """XLA's FLOPs and bytes of the whole forward for one v6e chip, every layer
  counted; and the CPU seconds of the two compiles that count them (`one_layer_cpu_s`
  lowering included, `head_cpu_s`).

  XLA's cost analysis counts a scanned (while-loop) body once, whatever the trip
  count: the counts are a one-layer model's, plus its layer body (one layer's
  counts minus the embedding and head alone) n_layer - 1 more times. Nothing else
  in the forward is a loop (the Pallas SSD and the parallel XLA form have none)."""
  one = compile_forward(cfg.replace(n_layer=1), rt, batch, seq_len)
  r1, r0 = one["cost"], outside_scan_cost(cfg, rt, batch, seq_len)
  return {**metrics.every_layer_counts(r1, cfg.n_layer, more=r1, fewer=r0),
          "one_layer_cpu_s": one["lower_cpu_s"] + one["compile_cpu_s"], "head_cpu_s": r0["cpu_s"]}


# The SSD implementations the TPU figure compiles, as runtime fields.
TPU_SSD = {"xla": dict(ssd_impl="xla", ssd_form="parallel"), "pallas": dict(ssd_impl="pallas")}


def bench_compile_tpu(args):
  """2.7b forward at l=4096, batch 1, bf16, for one v6e chip: ours with the XLA SSD
  (parallel form) and with the Pallas SSD, and the peer with --compare."""
  rows = []
  try:
    _, _, devices = tpu_devices(TPU)
  except Exception as e:  # noqa: BLE001
    log(f"  TPU compile skipped: {str(e).splitlines()[0]} (pip install libtpu)")
    return rows
  cfg = config_for("2.7b")
  chip = metrics.CHIPS["v6e"]
  # compile_s / compile_cpu_s: the one program a user compiles (the 64-layer
  # forward), apart from its lowering; count_cpu_s: the benchmark's own extra
  # compiles (a one-layer model and the head alone) that scale the scanned layer
  # body by its trip count for XLA's FLOPs and bytes.
  for impl, fields in TPU_SSD.items():
    rt = Runtime(compute_dtype="bfloat16", **fields)
    r = compile_forward(cfg, rt, 1, 4096)
    with metrics.Timer() as t:
      counts = scaled_forward_counts(cfg, rt, 1, 4096)
    rl = metrics.roofline_seconds(counts["flops"], counts["bytes accessed"], chip.peak_flops, chip.hbm_bandwidth)
    rows.append({"bench": "compile", "impl": f"ours ({impl} SSD)", "program": "forward 2.7b l4096 bf16",
                 "target": "TPU v6e (AOT)", "weights": "for_inference", "n_layer": 64, "seq_len": 4096, "batch": 1,
                 "lower_s": r["lower_s"], "lower_cpu_s": r["lower_cpu_s"],
                 "compile_s": r["compile_s"], "compile_cpu_s": r["compile_cpu_s"], "count_cpu_s": t.cpu_seconds,
                 "one_layer_cpu_s": counts["one_layer_cpu_s"], "head_cpu_s": counts["head_cpu_s"],
                 "xla_flops": counts["flops"], "xla_bytes": counts["bytes accessed"],
                 "xla_flops_raw": r["cost"].get("flops"), "xla_bytes_raw": r["cost"].get("bytes accessed"),
                 "model_flops": r["model_flops"], "peak_bytes": (r["memory"] or {}).get("peak_bytes"),
                 "roofline": rl, "roofline_ms": rl["time_s"] * 1e3})
    log(f"  compile 2.7b fwd l4096 for v6e, {impl} SSD: lower {r['lower_s']:.1f}s ({r['lower_cpu_s']:.1f}s cpu), "
        f"compile {r['compile_s']:.1f}s ({r['compile_cpu_s']:.1f}s cpu); counting compiles "
        f"{t.cpu_seconds:.1f}s cpu (one-layer model {counts['one_layer_cpu_s']:.1f}s, head alone "
        f"{counts['head_cpu_s']:.1f}s); XLA {counts['flops']:.2e} FLOPs, {counts['bytes accessed']:.2e} bytes "
        f"(layer body x 64) -> {rl['bound']}-bound, {rl['time_s'] * 1e3:.1f} ms at "
        f"{chip.peak_flops / 1e12:.0f} TF/s, {chip.hbm_bandwidth / 1e12:.1f} TB/s")
  # The scan form of the SSD (the CPU default); its XLA counts would need the
  # chunk loop's trip count too, so only time it.
  rs = compile_forward(cfg, Runtime(compute_dtype="bfloat16", ssd_impl="xla", ssd_form="scan",
                                    scan_chunk_size=256), 1, 4096)
  rows.append({"bench": "compile", "impl": "ours (xla SSD, scan form)", "program": "forward 2.7b l4096 bf16",
               "target": "TPU v6e (AOT)", "n_layer": 64, "seq_len": 4096, "batch": 1,
               **{k: rs[k] for k in ("lower_s", "lower_cpu_s", "compile_s", "compile_cpu_s")}})
  log(f"  compile 2.7b fwd l4096 for v6e, scan-form SSD: compile {rs['compile_s']:.1f}s "
      f"({rs['compile_cpu_s']:.1f}s cpu)")
  if args.compare and peers.have_mamba2_jax():
    import mamba2_jax
    rep = NamedSharding(make_mesh({"data": -1}, devices), P())
    mcfg = mamba2_jax.Mamba2Config(hidden_size=2560, num_hidden_layers=64, vocab_size=50288)
    gd, ps = nnx.split(nnx.eval_shape(lambda: mamba2_jax.Mamba2ForCausalLM(mcfg, rngs=nnx.Rngs(0))))
    ps = _on(rep, jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16 if s.dtype == F32 else s.dtype),
                               ps))
    ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=rep)
    with metrics.Timer() as lt:
      lowered = jax.jit(lambda ps, ids: nnx.merge(gd, ps)(ids)["logits"]).lower(ps, ids)
    with metrics.Timer() as t:
      compiled = lowered.compile()
    info = {"lower_s": lt.seconds, "lower_cpu_s": lt.cpu_seconds, "compile_s": t.seconds,
            "compile_cpu_s": t.cpu_seconds}
    cost = metrics.compiled_cost(compiled)
    rl = metrics.roofline_seconds(cost.get("flops", 0.0), cost.get("bytes accessed", 0.0), chip.peak_flops,
                                  chip.hbm_bandwidth)
    # mamba2-jax unrolls its layers (no scan), so XLA counts every layer as is.
    rows.append({"bench": "compile", "impl": "mamba2-jax", "program": "forward 2.7b l4096 bf16",
                 "target": "TPU v6e (AOT)", "n_layer": 64, "seq_len": 4096, "batch": 1,
                 **info, "xla_flops": cost.get("flops"), "xla_bytes": cost.get("bytes accessed"),
                 "roofline": rl, "roofline_ms": rl["time_s"] * 1e3})
    log(f"  mamba2-jax 2.7b fwd l4096 for v6e: compile {info['compile_s']:.1f}s "
        f"({info['compile_cpu_s']:.1f}s cpu); {cost.get('flops', 0):.2e} FLOPs, "
        f"{cost.get('bytes accessed', 0):.2e} bytes")
  return rows
