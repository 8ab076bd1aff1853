"""Where one layer's HBM bytes go in the train step compiled for NVIDIA GPUs (the
CUDA plugin, no GPU): the one-layer step of a released size for h100-8, its ops
grouped by what they come from (the op_name JAX writes into the HLO), largest first.

  python -m benchmarks.gpu_bytes --size 1.3b --batch 32 --remat full     # 4 x 2048 a GPU
  python -m benchmarks.gpu_bytes --size 130m --batch 32 --top 25 --layer   # one layer's share alone

An op's bytes are its operands' plus its result's sizes as the optimised HLO prints
them, the rule XLA's cost analysis counts a fusion by (`tools/hlo.py`); a
Pallas kernel's are its cost estimate's (XLA counts the custom call as nothing).
The embedding, LM head, loss and optimizer of the whole model are in the one-layer
step too; --layer prints one layer's share alone instead (two layers unrolled less
one layer, group by group, as `tools/aot.py`'s `every_layer_cost` counts it).
`scripts/aot_compile.py` gives the every-layer totals. Figures: docs/bench/gpu.md.
"""

from __future__ import annotations

import argparse
import collections
import re

from configs import base
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


def grouped_bytes(text: str) -> list[tuple[float, str, int]]:
  """[(bytes, label, ops)] of the non-fused computations' ops, largest first."""
  groups = collections.defaultdict(lambda: [0.0, 0])
  for op in hlo.ops(text):
    if op.kind == "custom-call":  # kernels: their estimates, added by the caller
      continue
    name = _OP_NAME.search(op.line)
    g = groups[_where(name.group(1)) if name else op.kind]
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
  args = ap.parse_args(argv)
  ap_layer = args.layer
  _, _, devices = gpu_devices(args.topology)
  c = base.mamba2_pretrain(args.size)
  c.batch_size, c.runtime.remat = args.batch, args.remat
  plan = run_config.validate(c, num_devices=len(devices), platform="gpu", reference=base.get_config())
  mesh = make_mesh(c.mesh, devices, shape=plan.mesh_shape)
  batch = abstract_batch(c.batch_size, c.seq_len, mesh)

  def count(n_layer, unroll):
    p = plan.replace(model=plan.model.replace(n_layer=n_layer), runtime=plan.runtime.replace(unroll_layers=unroll))
    built = build(p, mesh, init=False)
    compiled = built.train_step.lower(built.state, batch).compile()
    kernels = hlo.kernel_costs(compiled, built.train_step.trace(built.state, batch).jaxpr)["bytes accessed"]
    groups = {k: (b, n) for b, k, n in grouped_bytes(compiled.as_text())}
    return hlo.xla_cost(compiled, "gpu").get("bytes accessed", 0.0), kernels, groups

  xla, kernels, groups = count(1, False)
  what = "one layer"
  if ap_layer:
    xla2, kernels2, groups2 = count(2, True)
    xla, kernels = xla2 - xla, kernels2 - kernels
    groups = {k: (groups2.get(k, (0, 0))[0] - groups.get(k, (0, 0))[0],
                  groups2.get(k, (0, 0))[1] - groups.get(k, (0, 0))[1]) for k in set(groups) | set(groups2)}
    what = "one layer's share (2 layers unrolled - 1)"
  rows = sorted(((b, k, n) for k, (b, n) in groups.items()), reverse=True)
  total = sum(b for b, _, _ in rows)
  print(f"{args.size}, {what}, {args.topology}, batch {args.batch} x {c.seq_len}, remat {args.remat}: "
        f"XLA {xla:.3e} bytes (the ops below: {total:.3e}), Pallas kernels {kernels:.3e} bytes")
  print("| bytes per GPU | share | ops | from (op_name) |\n|---|---|---|---|")
  for b, label, n in [(kernels, "Pallas SSD kernels (cost estimates)", 0)] + rows[:args.top]:
    print(f"| {b:.3e} | {100 * b / (total + kernels):.1f}% | {n or ''} | {label} |")


if __name__ == "__main__":
  main()
