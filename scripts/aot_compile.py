"""Compile the real train step for a TPU slice on any machine (a CPU laptop too)
and say whether it fits, before renting the slice.

  pip install -e '.[tpu]'     # libtpu from PyPI: the TPU compiler, no TPU needed
  python scripts/aot_compile.py --config configs/130m.py --topology v5e:2x2
  python scripts/aot_compile.py --config configs/1.3b.py --topology v5p-128 --config.batch_size=512
  python scripts/aot_compile.py --config configs/tiny.py --topology v6e:1x1 --json out.json
  python scripts/aot_compile.py --config configs/long_context.py --topology v5p:2x2x2

--topology takes the names `jax.experimental.topologies` knows (v4:2x2x2,
v5e:4x4, v5p:4x4x4, v6e:2x2, ...) or Cloud TPU slice names (v5p-128, v5e-16,
v6e-8, v4-32; see mamba_train/parallel/topology.py).

The train step is the trainer's own (`mamba_train.train.step.build`), with the
run's mesh over the slice's devices, the runtime resolved for TPU, and the state
and batch shardings it trains with; the state and batch are abstract (shapes and
shardings only), so nothing is allocated. Reported: per-device memory from XLA's memory analysis against the
chip's HBM, XLA's FLOP and byte counts with every layer counted (two more small
compiles: one layer, and two layers unrolled), the step time and MFU they imply at
the datasheet peaks, and the compile time. Exits with status 2 and says what to
change when the step does not fit.
"""

from __future__ import annotations

import json
import math
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `configs` lives at the repository root
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import base  # noqa: E402
from mamba_train import metrics  # noqa: E402
from mamba_train.parallel.mesh import make_mesh  # noqa: E402
from mamba_train.parallel.topology import tpu_devices  # noqa: E402
from mamba_train.train import run_config  # noqa: E402
from mamba_train.train.step import abstract_batch, build  # noqa: E402

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
  state does not. None when the sequence axis would not help."""
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


def _cost_with_layers(config, mesh, n_layer: int, unroll: bool) -> dict:
  """XLA's counts of the run's train step with n_layer layers (an unrolled loop if asked)."""
  c = config.copy_and_resolve_references()
  c.model.n_layer, c.runtime.unroll_layers = n_layer, unroll
  built = build(c, mesh, init=False)
  batch = abstract_batch(c.batch_size, c.seq_len, mesh)
  return metrics.compiled_cost(built.train_step.lower(built.state, batch).compile())


def every_layer_cost(config, mesh, cost: dict) -> dict:
  """XLA's FLOPs and bytes of the train step with every layer counted.

  XLA's cost analysis counts a loop body once, and the layers run in a scan (the
  backward pass too), so `cost` (of the real program) covers one layer. Two small
  compiles give the rest: one layer, and two layers as an unrolled loop; their
  difference is one layer's forward, backward and optimizer update, added
  n_layer - 1 times to the one-layer step. (A grad_accum loop is still counted once.)
  """
  n = config.model.n_layer
  if n == 1:
    return {k: cost.get(k, 0.0) for k in ("flops", "bytes accessed")}
  one = _cost_with_layers(config, mesh, 1, False)
  two = _cost_with_layers(config, mesh, 2, True)
  return {k: one.get(k, 0.0) + (n - 1) * (two.get(k, 0.0) - one.get(k, 0.0)) for k in ("flops", "bytes accessed")}


def compile_train_step(config, topology: str, every_layer: bool = True) -> dict:
  """Compile the run's train step for `topology`; return the report (see module doc).
  Raises DoesNotFit when XLA refuses or the per-device peak exceeds HBM."""
  gen, topo, devices = tpu_devices(topology)
  chip = metrics.CHIPS[gen]
  chips = math.prod(int(d) for d in topo.split(":")[1].split("x"))
  per_device = chips / len(devices)  # v4's default config shows each TensorCore as a device
  hbm, peak = chip.hbm_bytes * per_device, chip.peak_flops * per_device
  bandwidth = chip.hbm_bandwidth * per_device

  run_config.validate(config, num_devices=len(devices), reference=base.get_config())
  mesh = make_mesh(config.mesh, devices)
  built = build(config, mesh, init=False)  # the runtime resolves for the mesh's TPU devices
  state, model_cfg = built.state, built.model_cfg
  batch = abstract_batch(config.batch_size, config.seq_len, mesh)
  state_bytes = state_bytes_per_device(state)

  report = {"topology": topo, "chip": chip.name, "devices": len(devices), "mesh": dict(mesh.shape),
            "model": model_cfg.to_dict(), "runtime": built.runtime.to_dict(),
            "batch_size": config.batch_size, "seq_len": config.seq_len,
            "grad_accum": config.optim.grad_accum, "hbm_bytes_per_device": hbm,
            "state_bytes_per_device": state_bytes}
  with metrics.Timer() as t:
    lowered = built.train_step.lower(state, batch)
  report["lower_s"] = t.seconds
  try:
    with metrics.Timer() as t:
      compiled = lowered.compile()
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
  cost = metrics.compiled_cost(compiled)
  report["cost"] = cost
  tokens = config.batch_size * config.seq_len
  model_flops = (metrics.train_flops_per_token(model_cfg, built.runtime, config.seq_len)
                 * tokens / len(devices))
  report["model_flops_per_device"] = model_flops
  if mem is not None and mem["peak_bytes"] > hbm:
    raise DoesNotFit(f"the train step needs {mem['peak_bytes'] / GIB:.2f} GiB per device "
                     f"(state {mem['argument_bytes'] / GIB:.2f} GiB + scratch {mem['temp_bytes'] / GIB:.2f} GiB"
                     f" + outputs {mem['output_bytes'] / GIB:.2f} GiB - donated {mem['alias_bytes'] / GIB:.2f} GiB)"
                     f" but a {chip.name} device has {hbm / GIB:.0f} GiB of HBM.\nTo fit: "
                     f"{_advice(config, state_bytes, hbm, mem['temp_bytes'])}")
  # XLA's cost analysis counts a while-loop body once, and the layers run in a
  # scan: `every_layer_cost` counts every layer. The step time takes the larger of
  # those FLOPs and the model's count (metrics.train_flops_per_token).
  # A hybrid's pattern fixes its depth (n_layer cannot shrink to one or two layers), so
  # its count stays the compiled one: the loop bodies once, the bytes a lower bound.
  full = (every_layer_cost(config, mesh, cost)
          if every_layer and not config.model.get("layer_pattern") else None)
  report["cost_every_layer"] = full
  if full is None:  # the scanned body counted once: bytes a lower bound
    full = {k: cost.get(k, 0.0) for k in ("flops", "bytes accessed")}
  flops = max(full["flops"], model_flops)
  rl = metrics.roofline_seconds(flops, full["bytes accessed"], peak, bandwidth)
  report["roofline"] = rl
  report["step_time_s"] = rl["time_s"]
  report["tokens_per_s"] = tokens / rl["time_s"]
  report["mfu_at_roofline"] = model_flops / peak / rl["time_s"]
  return report


def format_report(r: dict) -> str:
  g = lambda b: f"{b / GIB:.2f} GiB"
  lines = [f"{r['chip']} slice {r['topology']}: {r['devices']} devices, mesh {r['mesh']}",
           f"batch {r['batch_size']} x {r['seq_len']} (grad_accum {r['grad_accum']}), "
           f"d_model {r['model']['d_model']}, n_layer {r['model']['n_layer']}"
           + (f" (layers {r['model']['layer_pattern']}, attention {r['runtime']['attention']})"
              if r['model'].get('layer_pattern') else "") + ", "
           f"{r['runtime']['compute_dtype']}, remat {r['runtime']['remat']}, SSD {r['runtime']['ssd_impl']} ({r['runtime']['ssd_form']} form if xla)",
           f"compile: {r['compile_s']:.1f} s (+ lowering {r['lower_s']:.1f} s)"]
  sp = r["mesh"].get("sequence", 1)
  if sp > 1:
    lines.append(f"sequence parallel: each sequence split over {sp} devices, "
                 f"{r['seq_len'] // sp} positions per device")
  m = r.get("memory")
  if m:
    lines.append(f"memory per device: {g(m['peak_bytes'])} of {g(r['hbm_bytes_per_device'])} HBM "
                 f"({100 * m['peak_bytes'] / r['hbm_bytes_per_device']:.0f}%): state/arguments "
                 f"{g(m['argument_bytes'])}, scratch {g(m['temp_bytes'])}, outputs {g(m['output_bytes'])}, "
                 f"donated {g(m['alias_bytes'])}")
  c = r.get("cost", {})
  if c:
    f = r["cost_every_layer"]
    if f:
      lines.append(f"XLA counts per device: {f['flops']:.3e} FLOPs, {f['bytes accessed']:.3e} bytes, every layer "
                   f"counted (as compiled, the scanned layer body once: {c.get('flops', 0):.3e} FLOPs, "
                   f"{c.get('bytes accessed', 0):.3e} bytes); model FLOPs {r['model_flops_per_device']:.3e}")
    else:
      lines.append(f"XLA counts per device: {c.get('flops', 0):.3e} FLOPs, {c.get('bytes accessed', 0):.3e} bytes "
                   f"(the scanned layer bodies counted once: --every_layer=false, or a hybrid); model FLOPs "
                   f"{r['model_flops_per_device']:.3e}")
  rl = r.get("roofline")
  if rl:
    lines.append(f"at datasheet peaks (the larger FLOP count; XLA bytes{', every layer' if f else ', a lower bound'}): step {rl['time_s'] * 1e3:.1f} ms ({rl['bound']}-bound; compute "
                 f"{rl['compute_s'] * 1e3:.1f} ms, memory {rl['memory_s'] * 1e3:.1f} ms), "
                 f"{r['tokens_per_s']:.3g} tokens/s, MFU {100 * r['mfu_at_roofline']:.0f}%")
  return "\n".join(lines)


_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2", "TPU slice: v5e:2x2, v6e:4x4, v5p:4x4x4, v5p-128, ...")
_JSON = flags.DEFINE_string("json", "", "Also write the report as JSON here.")
_EVERY_LAYER = flags.DEFINE_bool("every_layer", True, "Count every layer's FLOPs and bytes (two more "
                                 "small compiles); false: the scanned layer body once, a lower bound.")


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config configs/<name>.py is required")
  try:
    report = compile_train_step(config, _TOPOLOGY.value, _EVERY_LAYER.value)
  except DoesNotFit as e:
    print(f"DOES NOT FIT: {e}", file=sys.stderr)
    sys.exit(2)
  except (ValueError, run_config.ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  print(format_report(report))
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
  app.run(main)
