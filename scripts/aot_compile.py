"""Compile the real train step for a TPU slice or NVIDIA GPU hosts on any machine
(a CPU laptop too) and say whether it fits, before renting them.

  pip install -e '.[tpu]'     # libtpu from PyPI: the TPU compiler, no TPU needed
  pip install -e '.[gpu]'     # the CUDA plugin and ptxas: the GPU compiler, no GPU needed
  python scripts/aot_compile.py --config configs/130m.py --topology v5e:2x2
  python scripts/aot_compile.py --config configs/1.3b.py --topology v5p-128 --config.batch_size=512
  python scripts/aot_compile.py --config configs/tiny.py --topology v6e:1x1 --json out.json
  python scripts/aot_compile.py --config configs/long_context.py --topology v5p:2x2x2
  python scripts/aot_compile.py --config configs/1.3b.py --topology h100-8 --config.batch_size=32 \
      --config.runtime.compute_dtype=bfloat16

--topology takes the names `jax.experimental.topologies` knows (v4:2x2x2,
v5e:4x4, v5p:4x4x4, v6e:2x2, ...) or Cloud TPU slice names (v5p-128, v5e-16,
v6e-8, v4-32; see mamba_train/parallel/topology.py), or NVIDIA GPUs as h100-N /
h200-N (N GPUs, 8 a host: h100-8 is one host, h100-64 eight). On GPUs the counts
are XLA's HLO cost analysis of the optimised GPU module plus the Pallas kernels'
own cost estimates (XLA counts a custom call as nothing there); nothing is
autotuned without a GPU, so the roofline is the measure, not the binary's speed.

The compile and its report are `mamba_train.tools.aot.compile_train_step`: the
trainer's own train step, with the run's mesh over the slice's devices, the runtime
resolved for TPU, and the state and batch shardings it trains with; the state and
batch are abstract (shapes and shardings only), so nothing is allocated. Reported:
per-device memory from XLA's memory analysis against the chip's HBM, XLA's FLOP and
byte counts with every layer counted (two more small compiles: one layer, and two
layers unrolled; on GPUs the one compile's loop bodies times their trip counts), the
step time and MFU they imply at the datasheet peaks, and the compile time. Exits with
status 2 and says what to change when the step does not fit.
"""

from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `configs` lives at the repository root
  sys.path.insert(0, _ROOT)

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import base  # noqa: E402
from mamba_train import cli, metrics, platforms  # noqa: E402
from mamba_train.parallel.topology import is_gpu_topology  # noqa: E402
from mamba_train.tools import aot  # noqa: E402
from mamba_train.train import run_config  # noqa: E402

# Only the platforms, not apply_cpu_defaults' XLA:CPU flag: libtpu reads XLA_FLAGS too and
# aborts on a CPU-only flag. On a machine with no accelerator JAX then starts only its CPU
# client, which compiling for a slice or GPU hosts needs, and no plugin prints its failure.
platforms.choose()

GIB = metrics.GIB


def format_report(r: dict) -> str:
  g = lambda b: f"{b / GIB:.2f} GiB"
  lines = [f"{r['chip']} {'hosts' if r['chip'].startswith('NVIDIA') else 'slice'} {r['topology']}: "
           f"{r['devices']} devices, mesh {r['mesh']}, layout {r.get('layout', 'fsdp')}",
           f"batch {r['batch_size']} x {r['seq_len']} (grad_accum {r['grad_accum']}), "
           f"d_model {r['model']['d_model']}, n_layer {r['model']['n_layer']}"
           + (f" (layers {r['model']['layer_pattern']}, attention {r['runtime']['attention']})"
              if r['model'].get('layer_pattern') else "") + ", "
           f"{r['runtime']['compute_dtype']}, remat {r['runtime']['remat']}, "
           f"SSD {r['runtime']['ssd_impl']} ({r['runtime']['ssd_form']} form if xla)",
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
      how = ("the layers unrolled, each counted as compiled" if r["runtime"].get("unroll_layers") else
             f"as compiled, the scanned layer body once: {c.get('flops', 0):.3e} FLOPs, "
             f"{c.get('bytes accessed', 0):.3e} bytes")
      if r.get("cost_trip_scaled"):
        how = ("each loop body of the compiled step times its trip count, CPU cost analysis; " + how
               + "; loops " + ", ".join(str(n) for _, n in r["cost_trip_scaled"]["loops"]))
      lines.append(f"XLA counts per device: {f['flops']:.3e} FLOPs, {f['bytes accessed']:.3e} bytes, every layer "
                   f"counted ({how}); model FLOPs {r['model_flops_per_device']:.3e}")
    else:
      why = ("--trip_counts could not read the compiled module: " + r["cost_trip_scaled_error"]
             if r.get("cost_trip_scaled_error") else "--every_layer=false")
      lines.append(f"XLA counts per device: {c.get('flops', 0):.3e} FLOPs, {c.get('bytes accessed', 0):.3e} bytes "
                   f"(the scanned layer bodies counted once: {why}); model FLOPs "
                   f"{r['model_flops_per_device']:.3e}")
  k = r.get("kernel_cost")
  if k:
    w = r["cost_with_kernels"]
    where = " and in the CPU analysis of --trip_counts" if r.get("cost_trip_scaled") else ""
    lines.append(f"Pallas kernels per device (their cost estimates{', every layer' if f else ''}; XLA counts "
                 f"them as 0 on GPUs{where}): "
                 f"{k['flops']:.3e} FLOPs, {k['bytes accessed']:.3e} bytes; with XLA's: {w['flops']:.3e} FLOPs, "
                 f"{w['bytes accessed']:.3e} bytes, {w['flops'] / max(w['bytes accessed'], 1):.0f} FLOP/byte")
  rl = r.get("roofline")
  if rl:
    counted = (", every layer" if f else ", a lower bound") + (" plus the kernels'" if k else "")
    lines.append(f"at datasheet peaks (the larger FLOP count; XLA bytes{counted}): "
                 f"step {rl['time_s'] * 1e3:.1f} ms ({rl['bound']}-bound; compute "
                 f"{rl['compute_s'] * 1e3:.1f} ms, memory {rl['memory_s'] * 1e3:.1f} ms), "
                 f"{r['tokens_per_s']:.3g} tokens/s, MFU {100 * r['mfu_at_roofline']:.0f}%")
    if r.get("quantized_flops_per_device"):
      lines.append(f"  of which {r['quantized_flops_per_device']:.3e} FLOPs of {r['runtime']['matmul_precision']} "
                   f"matmuls at {r['quantized_peak_per_device'] / 1e12:.0f} TFLOP/s a device, the rest at the "
                   f"bfloat16 peak; MFU is of the bfloat16 peak")
  return "\n".join(lines)


_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2", "TPU slice (v5e:2x2, v6e:4x4, v5p:4x4x4, v5p-128, ...) "
                                "or NVIDIA GPUs (h100-8, h200-8, h100-64, ...)")
_JSON = flags.DEFINE_string("json", "", "Also write the report as JSON here.")
_EVERY_LAYER = flags.DEFINE_bool("every_layer", True, "Count every layer's FLOPs and bytes (two more "
                                 "small compiles; on GPUs --trip_counts' count instead, but for a "
                                 "hybrid); false: the scanned layer body once, a lower bound. With "
                                 "--config.runtime.unroll_layers=True the step holds every layer and is "
                                 "counted whole either way.")

_TRIP_COUNTS = flags.DEFINE_bool("trip_counts", False, "Count every layer from the one compile: each loop "
                                 "body of the compiled step scaled by its trip count (XLA's cost analysis "
                                 "through the CPU client), instead of --every_layer's smaller compiles.")

_HLO_DUMP = flags.DEFINE_string("hlo_dump", "", "Keep XLA's dump of the optimised train step in this folder "
                                "(its HLO as protobuf), for reading the program op by op.")


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config configs/<name>.py is required")
  if is_gpu_topology(_TOPOLOGY.value):
    # cuDNN's flash attention (what 'auto' picks for bfloat16 on GPUs) checks the cuDNN
    # library and the device's compute capability while tracing: with no GPU it fails
    # deep in jax.nn.dot_product_attention, so say so before any work.
    rt = config.runtime
    if ("*" in (config.model.get("layer_pattern") or "") and rt.attention in ("auto", "cudnn")
        and (rt.attention != "auto" or rt.compute_dtype == "bfloat16")):
      raise app.UsageError(f"runtime.attention={rt.attention!r} runs cuDNN's attention on GPUs, which cannot be "
                           "compiled without a GPU: pass --config.runtime.attention=xla (the plain form; its "
                           "l x l scores make the memory an upper bound)")
    # Compiling for GPUs needs only the CPU client (and the CUDA plugin's topology):
    # no TPU or GPU backend start-up. Before JAX initialises a backend.
    import jax
    jax.config.update("jax_platforms", "cpu")
  try:
    report = aot.compile_train_step(config, _TOPOLOGY.value, _EVERY_LAYER.value,
                                    reference=base.get_config(), trip_counts=_TRIP_COUNTS.value,
                                    hlo_dump=_HLO_DUMP.value)
  except aot.DoesNotFit as e:
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
  cli.run(main)
