"""Where one layer's HBM bytes go in the train step compiled for NVIDIA GPUs (the
CUDA plugin, no GPU): the one-layer step of a released size for h100-8, its ops
grouped by what they come from (the op_name JAX writes into the HLO), largest first.

  python -m benchmarks.gpu_bytes --size 1.3b --batch 32 --remat full     # 4 x 2048 a GPU
  python -m benchmarks.gpu_bytes --size 130m --batch 32 --top 25 --layer   # one layer's share alone
  python -m benchmarks.gpu_bytes --config configs/nemotron3-nano.py --batch 8 --pattern ME --base M \
      --phases    # one MoE layer of the Nano recipe: the ME step less the M step

An op's bytes are its operands' plus its result's sizes as the optimised HLO prints
them, the rule XLA's cost analysis counts a fusion by (`tools/hlo.py`); a
Pallas kernel's are its cost estimate's (XLA counts the custom call as nothing).
The embedding, LM head, loss and optimizer of the whole model are in the one-layer
step too; --layer prints one layer's share alone instead (two layers unrolled less
one layer, group by group, as `tools/aot.py`'s `every_layer_cost` counts it). A
hybrid from a config file (--config): the layers --pattern unrolled, less those of
--base (`aot.hybrid_every_layer_cost`'s differences); --phases labels each group
forward, recompute (full remat's), backward or optimizer (the step outside the
layers), from the transforms JAX writes into op_name.
`scripts/aot_compile.py` gives the every-layer totals. Figures: docs/bench/gpu.md.
"""

from __future__ import annotations

import argparse
import collections
import re
import runpy

from configs import base
from mamba_train.model import lora as lora_lib
from mamba_train.model.params import weight_names
from mamba_train.ops import table
from mamba_train.parallel.mesh import make_mesh
from mamba_train.parallel.topology import gpu_devices
from mamba_train.tools import hlo
from mamba_train.train import run_config
from mamba_train.train.step import abstract_batch, build

_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _where(op_name: str) -> str:
  """A short label for an op: the last two parts of its op_name path (the jvp /
  transpose / checkpoint wrappers dropped), so the same model code's ops group."""
  parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "jvp(", "transpose(", "checkpoint",
                                                                      "remat", "while", "body", "cond", "pjit",
                                                                      "rematted_computation", "vmap("))]
  return "/".join(parts[-2:]) if parts else "(unnamed)"


def _phase(op_name: str) -> str:
  """Which pass of the train step an op belongs to, from JAX's transforms in its op_name."""
  if "rematted_computation" in op_name:
    return "recompute"
  return "backward" if "transpose(" in op_name else ("forward" if "jvp(" in op_name else "optimizer")


def grouped_bytes(text: str, phases: bool = False) -> list[tuple[float, str, int]]:
  """[(bytes, label, ops)] of the non-fused computations' ops, largest first; with
  `phases` each label starts with the op's pass and ends with its result's dtypes."""
  groups = collections.defaultdict(lambda: [0.0, 0])
  for op in hlo.ops(text):
    if op.kind == "custom-call":  # kernels: their estimates, added by the caller
      continue
    name = _OP_NAME.search(op.line)
    label = _where(name.group(1)) if name else op.kind
    if phases:
      dtypes = ",".join(dict.fromkeys(r.split("[")[0] for r in op.result.split()))
      label = f"{_phase(name.group(1)) if name else 'optimizer'}: {label} ({op.kind}, {dtypes})"
    g = groups[label]
    g[0] += op.bytes
    g[1] += 1
  return sorted(((b, k, n) for k, (b, n) in groups.items()), reverse=True)


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bytes", description=__doc__.split("\n")[0])
  ap.add_argument("--size", default="1.3b")
  ap.add_argument("--topology", default="h100-8")
  ap.add_argument("--batch", type=int, default=32, help="global batch (sequences of 2048)")
  ap.add_argument("--remat", default="full", choices=["none", "full", "save_matmuls"])
  ap.add_argument("--top", type=int, default=20)
  ap.add_argument("--layer", action="store_true", help="one layer's share alone (two more compiles)")
  ap.add_argument("--config", default="", help="a run config file (configs/*.py) instead of --size")
  ap.add_argument("--seq_len", type=int, default=2048)
  ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: a full finetune)")
  ap.add_argument("--pattern", default="", help="with --config: the layers compiled, unrolled (e.g. ME)")
  ap.add_argument("--base", default="", help="with --pattern: the layers whose step is subtracted (e.g. M)")
  ap.add_argument("--phases", action="store_true", help="label groups forward/recompute/backward/optimizer")
  args = ap.parse_args(argv)
  ap_layer = args.layer
  _, _, devices = gpu_devices(args.topology)
  if args.config:
    c = runpy.run_path(args.config)["get_config"]()
    c.runtime.attention = "xla"  # cuDNN's attention cannot be compiled without a GPU
    c.seq_len = args.seq_len
    if args.lora:
      c.lora.rank = args.lora
  else:
    c = base.mamba2_pretrain(args.size)
  c.batch_size, c.runtime.remat = args.batch, args.remat
  plan = run_config.validate(c, num_devices=len(devices), platform="gpu", reference=base.get_config())
  mesh = make_mesh(c.mesh, devices, shape=plan.mesh_shape)
  batch = abstract_batch(c.batch_size, c.seq_len, mesh)

  def compiled_counts(p):
    with table.cross_compile(p.runtime):
      built = build(p, mesh, init=False)
      compiled = built.train_step.lower(built.state, batch).compile()
      kernels = hlo.kernel_costs(compiled, built.train_step.trace(built.state, batch).jaxpr)["bytes accessed"]
    groups = {k: (b, n) for b, k, n in grouped_bytes(compiled.as_text(), args.phases)}
    return hlo.xla_cost(compiled, "gpu").get("bytes accessed", 0.0), kernels, groups

  def count(n_layer, unroll):
    if args.pattern:  # a hybrid's layers by pattern, as tools/aot.py counts them
      pattern = args.pattern if unroll else args.base
      model = plan.model.replace(n_layer=len(pattern), layer_pattern=pattern)
      lora = plan.lora
      if lora is not None:  # the adapters of the weights the smaller pattern has
        present = weight_names(model)
        lora = lora.replace(targets=tuple(t for t in lora.targets
                                          if t == lora_lib.HEAD or lora_lib.TARGETS[t][1][0] in present))
      return compiled_counts(plan.replace(model=model, lora=lora, runtime=plan.runtime.replace(unroll_layers=True)))
    return compiled_counts(plan.replace(model=plan.model.replace(n_layer=n_layer),
                                        runtime=plan.runtime.replace(unroll_layers=unroll)))

  xla, kernels, groups = count(1, False)
  what = "one layer"
  if args.pattern:
    ap_layer = bool(args.base)
    what = f"layers {args.pattern}" if not args.base else f"layers {args.pattern} less {args.base}"
  if ap_layer:
    xla2, kernels2, groups2 = count(2, True)
    xla, kernels = xla2 - xla, kernels2 - kernels
    groups = {k: (groups2.get(k, (0, 0))[0] - groups.get(k, (0, 0))[0],
                  groups2.get(k, (0, 0))[1] - groups.get(k, (0, 0))[1]) for k in set(groups) | set(groups2)}
    what = what if args.pattern else "one layer's share (2 layers unrolled - 1)"
  rows = sorted(((b, k, n) for k, (b, n) in groups.items()), reverse=True)
  total = sum(b for b, _, _ in rows)
  print(f"{args.config or args.size}, {what}, {args.topology}, batch {args.batch} x {c.seq_len}, remat {args.remat}: "
        f"XLA {xla:.3e} bytes (the ops below: {total:.3e}), Pallas kernels {kernels:.3e} bytes")
  print("| bytes per GPU | share | ops | from (op_name) |\n|---|---|---|---|")
  kernel_label = "Pallas kernels (their cost estimates; tokamax's: hlo.ragged_dot_cost)"
  for b, label, n in [(kernels, kernel_label, 0)] + rows[:args.top]:
    print(f"| {b:.3e} | {100 * b / (total + kernels):.1f}% | {n or ''} | {label} |")


if __name__ == "__main__":
  main()
