"""The run's train step compiled ahead of time for a TPU slice or NVIDIA GPU hosts,
on any host (a CPU laptop too), and whether it fits, before renting the machines
(scripts/aot_compile.py).

The train step is the trainer's own (`step.build`), with the run's mesh over the
slice's devices (`parallel/topology.py`), the runtime resolved for TPU, and the
state and batch shardings it trains with; the state and batch are abstract (shapes
and shardings only), so nothing is allocated. The report: per-device memory from
XLA's memory analysis against the chip's HBM, XLA's FLOP and byte counts with every
layer counted (two more small compiles: one layer, and two layers unrolled; on GPUs
the one compile's loop bodies times their trip counts; none when
`runtime.unroll_layers` compiles every layer into the step itself), the
step time and MFU they imply at the datasheet peaks, and the compile time. A step
that does not fit raises `DoesNotFit`, saying what to change.

On GPUs XLA's own `cost_analysis()` is unimplemented (the CUDA plugin's), so the
counts are XLA's HLO cost analysis of the optimised GPU module run through the
CPU client (`hlo.gpu_hlo_cost`), which counts the GEMM fusions but gives a custom
call (a Pallas kernel) nothing: the cost estimates of the kernels XLA kept are
added apart, every layer counted the same way (`hlo.kernel_costs`).
"""

from __future__ import annotations

import contextlib
import math
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mamba_train import metrics
from mamba_train.model import lora as lora_lib
from mamba_train.model.params import weight_names
from mamba_train.ops import table
from mamba_train.parallel.mesh import make_mesh
from mamba_train.parallel.topology import gpu_devices, is_gpu_topology, tpu_devices
from mamba_train.tools.hlo import dumped_module_proto, kernel_costs, optimised_text, trip_scaled_cost, xla_cost
from mamba_train.train import run_config
from mamba_train.train.step import abstract_batch, build

GIB = metrics.GIB


class DoesNotFit(RuntimeError):
  pass


def state_bytes_per_device(state) -> int:
  """Bytes of one device's shards of an abstract (sharded) state."""
  total = 0
  for leaf in jax.tree.leaves(state):
    shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
  return total


def sequence_advice(config, state_bytes: int, hbm: float, temp_bytes: float | None) -> str | None:
  """A larger `mesh.sequence` when the activations of one sequence are what does not
  fit: they shrink about in proportion to the positions each device holds, the
  state does not. None when the sequence axis would not help. `config`: the run config."""
  sp, l = int(config.mesh.get("sequence", 1)), config.seq_len
  room = 0.9 * hbm - state_bytes  # leave XLA a margin
  if room <= 0:  # the state alone does not fit: shard it (fsdp), splitting l cannot help
    return None
  if temp_bytes is not None:
    if temp_bytes <= room:
      return None
    need = sp * 2 ** math.ceil(math.log2(temp_bytes / room))
  elif l // sp >= 4096:  # XLA refused outright: at long lengths, try twice the split
    need = 2 * sp
  else:
    return None
  if l % need or l // need < 4:
    return None
  return (f"seq_len {l} needs more sequence parallelism: split each sequence over "
          f"--config.mesh.sequence={need} devices (now {sp}; {l // need} positions per device), "
          f"taking them from data / fsdp")


def _advice(config, state_bytes: int, hbm: float, temp_bytes: float | None = None) -> str:
  """What to change, from where the bytes are: the state (arguments) or the activations."""
  tips = []
  seq_tip = sequence_advice(config, state_bytes, hbm, temp_bytes)
  if seq_tip:
    tips.append(seq_tip)
  if state_bytes > 0.5 * hbm:
    tips.append(f"the train state alone takes {state_bytes / GIB:.1f} GiB per device: shard it "
                f"over more devices with --config.mesh.fsdp=-1 --config.mesh.data=1 (now "
                f"{dict(config.mesh)}), or use a larger slice")
  tips.append(f"lower the per-device batch: --config.batch_size (now {config.batch_size}) or "
              f"--config.optim.grad_accum (now {config.optim.grad_accum}) to split it into micro-batches")
  if config.runtime.remat != "full":
    tips.append(f"recompute activations in the backward pass: --config.runtime.remat=full "
                f"(now {config.runtime.remat!r})")
  if config.runtime.compute_dtype != "bfloat16":
    tips.append("--config.runtime.compute_dtype=bfloat16")
  return "; ".join(tips)


def cost_with_layers(plan: run_config.Plan, mesh: Mesh, n_layer: int, *, unroll: bool) -> dict:
  """XLA's counts of the plan's train step with n_layer layers (an unrolled loop if asked)."""
  plan = plan.replace(model=plan.model.replace(n_layer=n_layer),
                      runtime=plan.runtime.replace(unroll_layers=unroll))
  built = build(plan, mesh, init=False)
  batch = abstract_batch(plan.config.batch_size, plan.config.seq_len, mesh)
  compiled = built.train_step.lower(built.state, batch).compile()
  platform = mesh.devices.flat[0].platform
  cost = xla_cost(compiled, platform)
  if platform == "gpu":  # XLA counts the kernels as nothing there: theirs, apart
    kernels = kernel_costs(compiled, built.train_step.trace(built.state, batch).jaxpr)
    cost.update({"kernel " + k: v for k, v in kernels.items()})
  return cost


def cost_with_pattern(plan: run_config.Plan, mesh: Mesh, pattern: str) -> dict:
  """XLA's counts of the plan's train step with the layers of `pattern` unrolled."""
  model = plan.model.replace(n_layer=len(pattern), layer_pattern=pattern)
  lora = plan.lora
  if lora is not None:  # the adapters of the weights the smaller pattern has (no attention's in 'M')
    present = weight_names(model)
    lora = lora.replace(targets=tuple(t for t in lora.targets
                                      if t == lora_lib.HEAD or lora_lib.TARGETS[t][1][0] in present))
  return cost_with_layers(plan.replace(model=model, lora=lora), mesh, len(pattern), unroll=True)


def hybrid_every_layer_cost(plan: run_config.Plan, mesh: Mesh) -> dict:
  """`every_layer_cost` for a hybrid, whose pattern fixes its depth: small unrolled
  compiles give one layer of each kind. With a the first layer's kind: the
  program of one a layer, of two, and of a then each other kind x; a layer of x is
  the difference from the one-layer program, and the whole step is that program
  plus count(a) - 1 layers of a and count(x) layers of each x (1 + the number of
  kinds compiles). (A grad_accum loop is still counted once.)"""
  pattern = plan.model.pattern
  a = pattern[0]
  keys = lambda c: {k: c.get(k, 0.0) for k in c if k in ("flops", "bytes accessed")
                    or k in ("kernel flops", "kernel bytes accessed")}
  one = keys(cost_with_pattern(plan, mesh, a))
  total = dict(one)
  for kind in dict.fromkeys(pattern):
    body = keys(cost_with_pattern(plan, mesh, a + kind))
    n = pattern.count(kind) - (kind == a)
    total = {k: total[k] + n * (body.get(k, 0.0) - one.get(k, 0.0)) for k in total}
  return total


def every_layer_cost(plan: run_config.Plan, mesh: Mesh, cost: dict) -> dict:
  """XLA's FLOPs and bytes of the train step with every layer counted.

  XLA's cost analysis counts a loop body once, and the layers run in a scan (the
  backward pass too), so `cost` (of the real program) covers one layer. Two small
  compiles give the rest: one layer, and two layers as an unrolled loop; their
  difference is one layer's forward, backward and optimizer update, added
  n_layer - 1 times to the one-layer step. (A grad_accum loop is still counted once.)
  """
  n = plan.model.n_layer
  if n == 1:
    return {k: cost.get(k, 0.0) for k in ("flops", "bytes accessed")}
  one = cost_with_layers(plan, mesh, 1, unroll=False)
  two = cost_with_layers(plan, mesh, 2, unroll=True)
  out = metrics.every_layer_counts(one, n, more=two, fewer=one)
  if "kernel flops" in one:  # GPUs: the kernels' estimates, every layer counted the same way
    kernels = lambda c: {k: c.get("kernel " + k, 0.0) for k in ("flops", "bytes accessed")}
    out.update({"kernel " + k: v for k, v in metrics.every_layer_counts(
        kernels(one), n, more=kernels(two), fewer=kernels(one)).items()})
  return out


def counts_by_trips(asked: bool, gpu: bool, every_layer: bool) -> bool:
  """Whether the report counts every layer from the one compile, its loop bodies times
  their trip counts: where asked, and on GPUs with `every_layer`. What `save_matmuls`
  keeps of the GPU kernels differs between a layer scan and unrolled layers
  (`table.build`), so `every_layer`'s differencing of a scanned layer against two
  unrolled ones would mix the two programs' remat, and it never sees the scan's stack
  copies (docs/bench/gpu.md); for a hybrid it counts programs of one or two layers a
  kind, not the scan of steps that runs (docs/bench/moe.md). The trip count takes a
  layer the scan skips by `lax.cond` in the trips that run it (`hlo.branch_shares`)."""
  return asked or (gpu and every_layer)


def compile_train_step(config, topology: str, every_layer: bool = True, *, reference=None,
                       trip_counts: bool = False, hlo_dump: str = "") -> dict:
  """Compile the run's train step for `topology`; return the report (see the module
  doc). `reference`: the config of every key (configs/base.py) for the unknown-key
  check. `trip_counts`: count every layer from the one compile, each loop body scaled by
  its trip count (`hlo.trip_scaled_cost`), instead of `every_layer`'s smaller compiles.
  `hlo_dump`: a folder to keep XLA's dump of the optimised step in (TPU: the one
  --trip_counts reads; a temporary one otherwise).
  Raises run_config.ConfigError on a bad config, DoesNotFit when XLA refuses or the
  per-device peak exceeds HBM."""
  gpu = is_gpu_topology(topology)
  gen, topo, devices = gpu_devices(topology) if gpu else tpu_devices(topology)
  plan = run_config.validate(config, num_devices=len(devices), platform=devices[0].platform,
                             device_kind=devices[0].device_kind,
                             reference=reference)
  trip_counts = counts_by_trips(trip_counts, gpu, every_layer)
  with table.cross_compile(plan.runtime) if gpu else contextlib.nullcontext():
    return _compile_train_step(config, plan, gpu, gen, topo, devices, every_layer, trip_counts, hlo_dump)


def _compile_train_step(config, plan, gpu: bool, gen: str, topo: str, devices, every_layer: bool,
                        trip_counts: bool = False, hlo_dump: str = "") -> dict:
  chip = metrics.CHIPS[gen]
  chips = math.prod(int(d) for d in topo.split(":")[1].split("x"))
  per_device = chips / len(devices)  # v4's default config shows each TensorCore as a device
  hbm, peak = chip.hbm_bytes * per_device, chip.peak_flops * per_device
  bandwidth = chip.hbm_bandwidth * per_device
  mesh = make_mesh(config.mesh, devices, shape=plan.mesh_shape)
  built = build(plan, mesh, init=False)
  state, model_cfg = built.state, plan.model
  batch = abstract_batch(config.batch_size, config.seq_len, mesh)
  state_bytes = state_bytes_per_device(state)

  report = {"topology": topo, "chip": chip.name, "devices": len(devices), "mesh": dict(mesh.shape),
            "layout": plan.layout, "model": model_cfg.to_dict(), "runtime": plan.runtime.to_dict(),
            "batch_size": config.batch_size, "seq_len": config.seq_len,
            "grad_accum": config.optim.grad_accum, "hbm_bytes_per_device": hbm,
            "state_bytes_per_device": state_bytes}
  with metrics.Timer() as t:
    lowered = built.train_step.lower(state, batch)
  report["lower_s"] = t.seconds
  # --trip_counts on TPUs reads the optimised module from XLA's dump (hlo.dumped_module_proto).
  dump = (contextlib.nullcontext(hlo_dump) if hlo_dump else
          tempfile.TemporaryDirectory() if trip_counts and not gpu else contextlib.nullcontext())
  try:
    with dump as dump_dir:
      options = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_proto": True} if dump_dir else None
      with metrics.Timer() as t:
        compiled = lowered.compile(compiler_options=options)
      proto = dumped_module_proto(dump_dir) if dump_dir and trip_counts and not gpu else None
  except Exception as e:  # noqa: BLE001 - XLA:TPU refuses programs that overflow HBM
    msg = str(e)
    if "RESOURCE_EXHAUSTED" in msg or "memory" in msg.lower():
      first = msg.strip().splitlines()[0][:400]
      raise DoesNotFit(f"XLA could not fit the train step on {topo} ({chip.name}, "
                       f"{hbm / GIB:.0f} GiB HBM per device): {first}\nTo fit: "
                       f"{_advice(config, state_bytes, hbm)}") from None
    raise
  report["compile_s"] = t.seconds
  mem = metrics.compiled_memory(compiled)
  report["memory"] = mem
  cost = xla_cost(compiled, devices[0].platform)
  report["cost"] = cost
  # XLA counts a Pallas call as nothing on GPUs (on TPUs its estimate is in XLA's
  # count): the estimates of the calls XLA kept, added apart.
  jaxpr = built.train_step.trace(state, batch).jaxpr if gpu or trip_counts else None
  kernels = kernel_costs(compiled, jaxpr) if gpu else None
  tokens = config.batch_size * config.seq_len
  model_flops = (metrics.train_flops_per_token(model_cfg, plan.runtime, config.seq_len)
                 * tokens / len(devices))
  report["model_flops_per_device"] = model_flops
  if mem is not None and mem["peak_bytes"] > hbm:
    raise DoesNotFit(f"the train step needs {mem['peak_bytes'] / GIB:.2f} GiB per device "
                     f"(state {mem['argument_bytes'] / GIB:.2f} GiB + scratch {mem['temp_bytes'] / GIB:.2f} GiB"
                     f" + outputs {mem['output_bytes'] / GIB:.2f} GiB - donated {mem['alias_bytes'] / GIB:.2f} GiB)"
                     f" but a {chip.name} device has {hbm / GIB:.0f} GiB of HBM.\nTo fit: "
                     f"{_advice(config, state_bytes, hbm, mem['temp_bytes'])}")
  # XLA's cost analysis counts a while-loop body once, and the layers run in a
  # scan: `every_layer_cost` counts every layer (unless they are unrolled, when the
  # program itself holds each one and needs no differencing). The step time takes the larger of
  # those FLOPs and the model's count (metrics.train_flops_per_token).
  # A hybrid's pattern fixes its depth: small unrolled patterns count one layer of each kind.
  full = None
  if plan.runtime.unroll_layers:  # every layer compiled as its own ops: XLA counts them all
    full = {k: cost.get(k, 0.0) for k in ("flops", "bytes accessed")}
  elif trip_counts:
    try:
      scaled = trip_scaled_cost(compiled, proto)
    except Exception as e:  # noqa: BLE001 - jaxlib cannot read the module back: keep the compile's report
      report["cost_trip_scaled_error"] = str(e).strip().splitlines()[0][:300]
    else:
      report["cost_trip_scaled"] = scaled
      full = {k: scaled[k] for k in ("flops", "bytes accessed")}
      # That analysis counts a Pallas call as nothing, on TPUs too (XLA:TPU's own count takes
      # the estimate a Mosaic kernel carries): the kernels in the loop bodies as often as
      # XLA's ops there, on every platform.
      kernels = kernel_costs(optimised_text(compiled, proto), jaxpr, trip_counts=True)
  elif every_layer:
    full = hybrid_every_layer_cost(plan, mesh) if model_cfg.layer_pattern else every_layer_cost(plan, mesh, cost)
  report["cost_every_layer"] = full
  if full is None:  # the scanned body counted once: bytes a lower bound
    full = {k: cost.get(k, 0.0) for k in ("flops", "bytes accessed")}
  if kernels is not None:
    if report["cost_every_layer"] and "kernel flops" in report["cost_every_layer"]:
      kernels = {k: report["cost_every_layer"]["kernel " + k] for k in ("flops", "bytes accessed")}
    report["kernel_cost"] = kernels
    full = {k: full[k] + kernels[k] for k in ("flops", "bytes accessed")}
    report["cost_with_kernels"] = full
  flops = max(full["flops"], model_flops)
  # The int8 / fp8 matmuls (the model's count of them) at the chip's peak for that format.
  low = metrics.quantized_flops_per_token(model_cfg, plan.runtime, config.seq_len) * tokens / len(devices)
  low_peak = chip.matmul_peak(plan.runtime.matmul_precision) * per_device
  report["quantized_flops_per_device"] = low
  report["quantized_peak_per_device"] = low_peak if low else 0.0
  rl = metrics.roofline_seconds(flops, full["bytes accessed"], peak, bandwidth, low, low_peak if low else 0.0)
  report["roofline"] = rl
  report["step_time_s"] = rl["time_s"]
  report["tokens_per_s"] = tokens / rl["time_s"]
  report["mfu_at_roofline"] = model_flops / peak / rl["time_s"]  # of the bfloat16 peak, as is usual
  return report
