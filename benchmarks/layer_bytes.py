"""Where a Mamba-2 layer's HBM bytes go on TPU: XLA's counts of the one-layer
2.7b model compiled for one v6e chip (libtpu AOT, no TPU), and its largest
fusions by bytes.

  python -m benchmarks.layer_bytes                 # forward, l=4096, batch 1
  python -m benchmarks.layer_bytes --train         # also the loss's value_and_grad
  python -m benchmarks.layer_bytes --top 30 --dump /tmp/hlo
  python -m benchmarks.layer_bytes --config 1.3b --batch 2 --seq_len 2048 --train --no_forward \
      --remat auto --layer_impl mosaic   # a v6e-256 chip's share of the 512 x 2048 step

A fusion's bytes are its operands' plus its result's sizes as the optimised HLO
prints them (an upper bound where XLA reads only a slice of an operand;
`mamba_train/tools/hlo.py` reads them); XLA's own total (`cost_analysis`) is
printed beside them. Figures: docs/bench/tpu_ssd.md.
"""

from __future__ import annotations

import glob
import os
import tempfile

# The CPU defaults do not apply to the TPU compiler; XLA writes the optimised HLO
# here (`compiled.as_text()` fails on the TPU executable's async ops).
_DUMP = tempfile.mkdtemp(prefix="layer_bytes_")
os.environ["XLA_FLAGS"] = f"--xla_dump_to={_DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_"

import argparse

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_train import metrics
from mamba_train.model.config import config_for
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.runtime import Runtime
from mamba_train.parallel.mesh import make_mesh
from mamba_train.parallel.topology import tpu_devices
from mamba_train.tools.hlo import top_ops
from mamba_train.train.state import with_shardings
from mamba_train.train.step import loss_sums


def _on(sharding, tree):
  return with_shardings(tree, jax.tree.map(lambda _: sharding, tree))


def compile_layer(args):
  cfg = config_for(args.config, n_layer=args.n_layer)
  _, _, devices = tpu_devices(args.topology)
  rt = Runtime(compute_dtype=args.dtype, ssd_impl=args.ssd_impl, layer_impl=args.layer_impl,
               remat=args.remat, unroll_layers=args.unroll).resolve("tpu", devices[0].device_kind)
  # One device: a TPU7x chip shows two (its TensorCores), and a Mosaic kernel under a
  # mesh of two would need a shard_map; the count is one device's program either way.
  rep = NamedSharding(make_mesh({"data": 1}, devices[:1]), P())
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)))
  ids = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32, sharding=rep)
  progs = {}
  if not args.no_forward:
    # The logits row-major, as a host reads them: TPU's default layout for an
    # f32 (b, l, 50277) result is positions-minor, and meeting it copies the
    # logits once more (--default_out_layout keeps it).
    out = None if args.default_out_layout else Format(Layout(major_to_minor=(0, 1, 2)), rep)
    progs["forward"] = (jax.jit(lambda p, i: nnx.merge(graphdef, p)(i), out_shardings=out),
                        (_on(rep, params), ids))
  if args.train:
    model = nnx.merge(graphdef, params)
    pdict = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), model.params())
    batch = {k: ids for k in ("input_ids", "targets", "seq_idx")}
    batch["loss_mask"] = jax.ShapeDtypeStruct(ids.shape, jnp.float32, sharding=rep)
    grad = jax.value_and_grad(lambda p, b: loss_sums(p, b, cfg, rt, use_seq_idx=False), has_aux=True)
    progs["train (value_and_grad)"] = (jax.jit(grad), (pdict, batch))
  for name, (fn, a) in progs.items():
    with metrics.Timer() as t:
      compiled = fn.lower(*a).compile()
    cost = metrics.compiled_cost(compiled)
    print(f"== {args.config} n_layer={args.n_layer} {name}, b={args.batch} l={args.seq_len}, {args.dtype}, "
          f"ssd {args.ssd_impl}, layer {rt.layer_impl}, remat {rt.remat}, {args.topology}: "
          f"XLA {cost.get('flops', 0):.3e} FLOPs, "
          f"{cost.get('bytes accessed', 0):.3e} bytes (compile {t.seconds:.0f}s)", flush=True)
    files = sorted(glob.glob(os.path.join(_DUMP, "*after_optimizations.txt")), key=os.path.getmtime)
    with open(files[-1]) as f:
      hlo = f.read()
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      with open(os.path.join(args.dump, name.split()[0] + ".hlo.txt"), "w") as f:
        f.write(hlo)
    for b, op, kind, shapes in top_ops(hlo, args.top):
      print(f"  {b:10.3e}  {kind:12s} {op:40s} {shapes}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="2.7b")
  ap.add_argument("--n_layer", type=int, default=1)
  ap.add_argument("--seq_len", type=int, default=4096)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--ssd_impl", default="pallas")
  ap.add_argument("--layer_impl", default="auto", help="runtime.layer_impl (auto: the topology's chip's choice)")
  ap.add_argument("--remat", default="none", help="runtime.remat (auto: TPU's choice)")
  ap.add_argument("--topology", default="v6e:1x1")
  ap.add_argument("--unroll", action="store_true",
                  help="runtime.unroll_layers: each layer its own ops (no scan's stacked residuals)")
  ap.add_argument("--train", action="store_true", help="also compile value_and_grad of the training loss")
  ap.add_argument("--no_forward", action="store_true")
  ap.add_argument("--default_out_layout", action="store_true",
                  help="leave the forward's logits in TPU's default layout (a copy)")
  ap.add_argument("--top", type=int, default=20)
  ap.add_argument("--dump", default="", help="write the optimised HLO text here")
  compile_layer(ap.parse_args(argv))


if __name__ == "__main__":
  main()
