"""Compile the real train step for a TPU slice on any machine (a CPU laptop too)
and say whether it fits, before renting the slice.

  pip install -e '.[tpu]'     # libtpu from PyPI: the TPU compiler, no TPU needed
  python scripts/aot_compile.py --config configs/130m.py --topology v5e:2x2
  python scripts/aot_compile.py --config configs/1.3b.py --topology v5p-128 --config.batch_size=512
  python scripts/aot_compile.py --config configs/tiny.py --topology v6e:1x1 --json out.json

--topology takes the names `jax.experimental.topologies` knows (v4:2x2x2,
v5e:4x4, v5p:4x4x4, v6e:2x2, ...) or Cloud TPU slice names (v5p-128, v5e-16,
v6e-8, v4-32; v4 and v5p names count TensorCores, two per chip, v5e and v6e
names count chips).

The train step is the trainer's own (`trainer.make_train_step`), with the run's
mesh over the slice's devices and the state and batch shardings it trains with;
the state and batch are abstract (shapes and shardings only), so nothing is
allocated. Reported: per-device memory from XLA's memory analysis against the
chip's HBM, XLA's FLOP and byte counts, the step time and MFU they imply at the
datasheet peaks, and the compile time. Exits with status 2 and says what to
change when the step does not fit.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `configs` lives at the repository root
  sys.path.insert(0, _ROOT)

# libtpu only compiles here: skip its cloud metadata queries, and let several
# processes (parallel tests) load it at once.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import base  # noqa: E402
from mamba_train import metrics, roofline, run_config, trainer  # noqa: E402
from mamba_train.mesh import make_mesh  # noqa: E402
from mamba_train.model import Mamba2LM  # noqa: E402
from mamba_train.optim import make_optimizer  # noqa: E402

GIB = 2**30

# Slice names count TensorCores for these generations (two per chip).
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}


class DoesNotFit(RuntimeError):
  pass


def _grid(chips: int, dims: int) -> tuple[int, ...]:
  """Near-cubic (or square) power-of-two grid of `chips` chips, smallest dims first."""
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f"{chips} chips is not a power of two")
  shape = [1] * dims
  i = 0
  while math.prod(shape) < chips:
    shape[i % dims] *= 2
    i += 1
  shape = sorted(shape)  # v5e:2x4, v5p:4x4x8; a 1 goes last (v4:2x2x1)
  return tuple([d for d in shape if d > 1] + [d for d in shape if d == 1])


def topology_name(name: str) -> tuple[str, str]:
  """('v5e', 'v5e:2x2') from 'v5e:2x2', 'v5litepod-4', 'v5e-4', 'v5p-128', ..."""
  name = name.strip().lower().replace("v5litepod", "v5e").replace("v6litepod", "v6e")
  m = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+)*)", name)
  if m:
    return m.group(1), name
  m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", name)
  if not m:
    raise ValueError(f"unknown TPU topology {name!r}: use e.g. v5e:2x2, v6e:4x4, v5p:4x4x4, "
                     f"v4:2x2x2, or a slice name such as v5p-128 or v5e-16")
  gen, n = m.group(1), int(m.group(2))
  cores = _CORES_PER_CHIP[gen]
  if n % cores:
    raise ValueError(f"{name}: {gen} slice names count TensorCores ({cores} per chip)")
  dims = 3 if gen in ("v4", "v5p") else 2
  shape = _grid(n // cores, dims)
  return gen, f"{gen}:" + "x".join(map(str, shape))


def tpu_devices(name: str):
  """(generation, topology name, devices) for a TPU slice, via libtpu, on any host."""
  gen, topo = topology_name(name)
  try:
    from jax.experimental import topologies
  except ImportError as e:  # pragma: no cover - every supported jax has it
    raise RuntimeError("this jax has no jax.experimental.topologies") from e
  dims = [int(d) for d in topo.split(":")[1].split("x")]
  bounds = tuple(min(d, 2) for d in dims) + (1,) * (3 - len(dims))
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topo, chip_config_name="default",
                                        chips_per_host_bounds=bounds[:3], num_slices=1)
  except Exception as e:  # noqa: BLE001 - libtpu missing or the name unknown to it
    raise RuntimeError(f"could not describe TPU topology {topo!r}: {e}\nIs libtpu installed? "
                       f"pip install -e '.[tpu]' (or pip install libtpu)") from e
  return gen, topo, list(desc.devices)


def abstract_train_state(model_cfg, optimizer, shardings):
  """The TrainState's shapes and dtypes, with its shardings, allocating nothing."""
  def make(key):
    init_key, rng = jax.random.split(key)
    params = Mamba2LM(model_cfg, rngs=nnx.Rngs(params=init_key)).params()
    return trainer.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                              opt_state=optimizer.init(params), rng=rng)
  shapes = jax.eval_shape(make, jax.random.PRNGKey(0))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def abstract_batch(batch_size: int, seq_len: int, mesh):
  sh = trainer.batch_sharding(mesh)
  spec = lambda dt: jax.ShapeDtypeStruct((batch_size, seq_len), dt, sharding=sh)
  return {"input_ids": spec(jnp.int32), "targets": spec(jnp.int32), "seq_idx": spec(jnp.int32),
          "loss_mask": spec(jnp.float32)}


def state_bytes_per_device(state) -> int:
  """Bytes of one device's shards of an abstract (sharded) state."""
  total = 0
  for leaf in jax.tree.leaves(state):
    shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
  return total


def _advice(config, state_bytes: int, hbm: float) -> str:
  """What to change, from where the bytes are: the state (arguments) or the activations."""
  tips = []
  if state_bytes > 0.5 * hbm:
    tips.append(f"the train state alone takes {state_bytes / GIB:.1f} GiB per device: shard it "
                f"over more devices with --config.mesh.fsdp=-1 --config.mesh.data=1 (now "
                f"{dict(config.mesh)}), or use a larger slice")
  tips.append(f"lower the per-device batch: --config.batch_size (now {config.batch_size}) or "
              f"--config.optim.grad_accum (now {config.optim.grad_accum}) to split it into micro-batches")
  if config.model.remat != "full":
    tips.append(f"recompute activations in the backward pass: --config.model.remat=full "
                f"(now {config.model.remat!r})")
  if config.model.compute_dtype != "bfloat16":
    tips.append("--config.model.compute_dtype=bfloat16")
  return "; ".join(tips)


def for_tpu(model_cfg):
  """ssd_form 'auto' resolves on the host's backend (CPU here): pin TPU's choice."""
  return model_cfg.replace(ssd_form="parallel") if model_cfg.ssd_form == "auto" else model_cfg


def compile_train_step(config, topology: str) -> dict:
  """Compile the run's train step for `topology`; return the report (see module doc).
  Raises DoesNotFit when XLA refuses or the per-device peak exceeds HBM."""
  gen, topo, devices = tpu_devices(topology)
  chip = roofline.TPU_CHIPS[gen]
  chips = math.prod(int(d) for d in topo.split(":")[1].split("x"))
  per_device = chips / len(devices)  # v4's default config shows each TensorCore as a device
  hbm, peak = chip.hbm_bytes * per_device, chip.peak_flops * per_device
  bandwidth = chip.hbm_bandwidth * per_device

  resolved = run_config.validate(config, num_devices=len(devices), reference=base.get_config())
  model_cfg = for_tpu(resolved["model"])
  mesh = make_mesh(config.mesh, devices)
  optimizer, schedule = make_optimizer(config.optim, config.steps)
  step = trainer.make_train_step(model_cfg, optimizer, schedule, mesh, grad_accum=config.optim.grad_accum)
  state = abstract_train_state(model_cfg, optimizer, trainer.state_shardings(model_cfg, optimizer, mesh))
  batch = abstract_batch(config.batch_size, config.seq_len, mesh)
  state_bytes = state_bytes_per_device(state)
  report_state = {"state_bytes_per_device": state_bytes}

  report = {"topology": topo, "chip": chip.name, "devices": len(devices), "mesh": dict(mesh.shape),
            "model": model_cfg.to_dict(), "batch_size": config.batch_size, "seq_len": config.seq_len,
            "grad_accum": config.optim.grad_accum, "hbm_bytes_per_device": hbm, **report_state}
  t0 = time.perf_counter()
  lowered = step.lower(state, batch)
  report["lower_s"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001 - XLA:TPU refuses programs that overflow HBM
    msg = str(e)
    if "RESOURCE_EXHAUSTED" in msg or "memory" in msg.lower():
      first = msg.strip().splitlines()[0][:400]
      raise DoesNotFit(f"XLA could not fit the train step on {topo} ({chip.name}, "
                       f"{hbm / GIB:.0f} GiB HBM per device): {first}\nTo fit: "
                       f"{_advice(config, state_bytes, hbm)}") from None
    raise
  report["compile_s"] = time.perf_counter() - t0
  mem = roofline.compiled_memory(compiled)
  report["memory"] = mem
  cost = roofline.compiled_cost(compiled)
  report["cost"] = cost
  tokens = config.batch_size * config.seq_len
  model_flops = metrics.train_flops_per_token(model_cfg, config.seq_len) * tokens / len(devices)
  report["model_flops_per_device"] = model_flops
  # XLA's cost analysis counts a while-loop body once, and the layers run in a
  # scan: its FLOPs and bytes cover one layer plus what is outside the scan. The
  # step time therefore takes the larger of XLA's FLOPs and the model's count
  # (metrics.train_flops_per_token), and the bytes are a lower bound.
  flops = max(cost.get("flops", 0.0), model_flops)
  rl = roofline.roofline_seconds(flops, cost.get("bytes accessed", 0.0), peak, bandwidth)
  report["roofline"] = rl
  report["step_time_s"] = rl["time_s"]
  report["tokens_per_s"] = tokens / rl["time_s"]
  report["mfu_at_roofline"] = model_flops / peak / rl["time_s"]
  if mem is not None and mem["peak_bytes"] > hbm:
    raise DoesNotFit(f"the train step needs {mem['peak_bytes'] / GIB:.2f} GiB per device "
                     f"(state {mem['argument_bytes'] / GIB:.2f} GiB + scratch {mem['temp_bytes'] / GIB:.2f} GiB"
                     f" + outputs {mem['output_bytes'] / GIB:.2f} GiB - donated {mem['alias_bytes'] / GIB:.2f} GiB)"
                     f" but a {chip.name} device has {hbm / GIB:.0f} GiB of HBM.\nTo fit: "
                     f"{_advice(config, state_bytes, hbm)}")
  return report


def compile_forward(model_cfg, batch: int, seq_len: int, topology: str = "v6e:1x1") -> dict:
  """Compile the model's forward (logits) for one slice, batch split over all its devices;
  the compile-time and FLOP/byte figures of issue 9 (2.7b at l=4096 on one v6e chip)."""
  gen, topo, devices = tpu_devices(topology)
  chip = roofline.TPU_CHIPS[gen]
  mesh = make_mesh({"data": -1}, devices)
  model_cfg = for_tpu(model_cfg)
  model = nnx.eval_shape(lambda: Mamba2LM(model_cfg, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  rep = NamedSharding(mesh, P())
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), params)
  ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=NamedSharding(mesh, P("data")))
  fwd = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))
  t0 = time.perf_counter()
  lowered = fwd.lower(params, ids)
  lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  cost = roofline.compiled_cost(compiled)
  out = {"topology": topo, "chip": chip.name, "lower_s": lower_s, "compile_s": compile_s,
         "memory": roofline.compiled_memory(compiled), "cost": cost,
         "model_flops": metrics.forward_flops_per_token(model_cfg, seq_len) * batch * seq_len}
  if cost.get("flops"):
    out["roofline"] = roofline.roofline_seconds(cost["flops"], cost.get("bytes accessed", 0.0),
                                                chip.peak_flops, chip.hbm_bandwidth)
  return out


def format_report(r: dict) -> str:
  g = lambda b: f"{b / GIB:.2f} GiB"
  lines = [f"{r['chip']} slice {r['topology']}: {r['devices']} devices, mesh {r['mesh']}",
           f"batch {r['batch_size']} x {r['seq_len']} (grad_accum {r['grad_accum']}), "
           f"d_model {r['model']['d_model']}, n_layer {r['model']['n_layer']}, "
           f"{r['model']['compute_dtype']}, remat {r['model']['remat']}",
           f"compile: {r['compile_s']:.1f} s (+ lowering {r['lower_s']:.1f} s)"]
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
