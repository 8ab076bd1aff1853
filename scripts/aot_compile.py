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
chip's HBM, XLA's FLOP and byte counts, the step time and MFU they imply at the
datasheet peaks, and the compile time. Exits with status 2 and says what to
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


def compile_train_step(config, topology: str) -> dict:
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
  # XLA's cost analysis counts a while-loop body once, and the layers run in a
  # scan: its FLOPs and bytes cover one layer plus what is outside the scan. The
  # step time therefore takes the larger of XLA's FLOPs and the model's count
  # (metrics.train_flops_per_token), and the bytes are a lower bound.
  flops = max(cost.get("flops", 0.0), model_flops)
  rl = metrics.roofline_seconds(flops, cost.get("bytes accessed", 0.0), peak, bandwidth)
  report["roofline"] = rl
  report["step_time_s"] = rl["time_s"]
  report["tokens_per_s"] = tokens / rl["time_s"]
  report["mfu_at_roofline"] = model_flops / peak / rl["time_s"]
  if mem is not None and mem["peak_bytes"] > hbm:
    raise DoesNotFit(f"the train step needs {mem['peak_bytes'] / GIB:.2f} GiB per device "
                     f"(state {mem['argument_bytes'] / GIB:.2f} GiB + scratch {mem['temp_bytes'] / GIB:.2f} GiB"
                     f" + outputs {mem['output_bytes'] / GIB:.2f} GiB - donated {mem['alias_bytes'] / GIB:.2f} GiB)"
                     f" but a {chip.name} device has {hbm / GIB:.0f} GiB of HBM.\nTo fit: "
                     f"{_advice(config, state_bytes, hbm, mem['temp_bytes'])}")
  return report


def format_report(r: dict) -> str:
  g = lambda b: f"{b / GIB:.2f} GiB"
  lines = [f"{r['chip']} slice {r['topology']}: {r['devices']} devices, mesh {r['mesh']}",
           f"batch {r['batch_size']} x {r['seq_len']} (grad_accum {r['grad_accum']}), "
           f"d_model {r['model']['d_model']}, n_layer {r['model']['n_layer']}"
           + (f" (layers {r['model']['layer_pattern']}, attention {r['runtime']['attention']})"
              if r['model'].get('layer_pattern') else "") + ", "
           f"{r['runtime']['compute_dtype']}, remat {r['runtime']['remat']}, SSD {r['runtime']['ssd_form']}",
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
    lines.append(f"XLA counts per device: {c.get('flops', 0):.3e} FLOPs, {c.get('bytes accessed', 0):.3e} bytes "
                 f"(the scanned layer body counted once); model FLOPs {r['model_flops_per_device']:.3e}")
  rl = r.get("roofline")
  if rl:
    lines.append(f"at datasheet peaks (model FLOPs; XLA bytes, a lower bound): step {rl['time_s'] * 1e3:.1f} ms ({rl['bound']}-bound; compute "
                 f"{rl['compute_s'] * 1e3:.1f} ms, memory {rl['memory_s'] * 1e3:.1f} ms), "
                 f"{r['tokens_per_s']:.3g} tokens/s, MFU {100 * r['mfu_at_roofline']:.0f}%")
  return "\n".join(lines)


_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2", "TPU slice: v5e:2x2, v6e:4x4, v5p:4x4x4, v5p-128, ...")
_JSON = flags.DEFINE_string("json", "", "Also write the report as JSON here.")


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config configs/<name>.py is required")
  try:
    report = compile_train_step(config, _TOPOLOGY.value)
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
