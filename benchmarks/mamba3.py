"""Mamba-3 against Mamba-2 at the same width on this CPU, in one run (not a test).

  python -m benchmarks.mamba3                          # tiny width, batch 2 x 512
  python -m benchmarks.mamba3 --batch 1 --seq_len 1024 --repeats 7
  python -m benchmarks.mamba3 --part counts --seq_len 2048   # one 1.5b-width layer, one v6e chip

Three models of the tiny size (d_model 256, 4 layers, d_state 64, headdim 32, byte
vocabulary): Mamba-2 (chunk 64), Mamba-3 SISO (chunk 64, mamba_ssm's SISO default)
and Mamba-3 MIMO rank 4 (chunk 16: 64 rows of chunk x rank, mamba_ssm's advice of
64 / mimo_rank). Each is timed on the forward pass (logits) and the train step's
loss value_and_grad, as the CPU runtime runs them; compile is timed apart. The
repeats go round the models in turn, so a load on the shared machine falls on all
three alike, and the table gives each one's tokens/s and its ratio to Mamba-2's: the
ratios are the figure to read (docs/bench/mamba3.md keeps dated results).

--part counts compiles the loss value_and_grad of a one-layer model at the width of
configs/mamba3-1.5b.py (d_model 2048, 64 heads of 64, d_state 128; vocabulary 256 so
the head is negligible) for one TPU v6e chip through libtpu, at --seq_len 2048 and
--batch 2 (a v6e-256 chip's share of the recipe's 512 rows), bfloat16 matmuls, and
reads XLA's FLOPs and bytes: Mamba-2 and Mamba-3 SISO and MIMO each as the TPU runs it
(Pallas kernels; their cost estimates count their bytes) and in plain XLA.
A layer whose FLOPs / bytes falls below the chip's balance (918 TFLOP/s over 1.6 TB/s,
574) is memory-bound: the kernel question.
"""

from __future__ import annotations

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend

import argparse  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import log, random_batch  # noqa: E402
from mamba_train import Mamba2LM, Runtime, config_for, metrics  # noqa: E402
from mamba_train.train.step import loss_sums  # noqa: E402

MODELS = {
    "Mamba-2": dict(),
    "Mamba-3 SISO": dict(layer_pattern="3333"),
    "Mamba-3 MIMO R4": dict(layer_pattern="3333", is_mimo=True, mimo_rank=4, chunk_size=16),
}


def counts(args):
  from jax.sharding import NamedSharding, PartitionSpec

  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.parallel.topology import tpu_devices
  device = tpu_devices("v6e:1x1")[2]
  rep = NamedSharding(make_mesh({"data": 1}, device), PartitionSpec())
  width = dict(d_model=2048, n_layer=1, vocab_size=256, d_state=128, headdim=64, chunk_size=256)
  siso, mimo = dict(layer_pattern="3", chunk_size=64), dict(layer_pattern="3", is_mimo=True, mimo_rank=4, chunk_size=16)
  plain = dict(ssd_impl="xla", layer_impl="xla")
  layers = {"Mamba-2 (TPU kernels)": ({}, {}), "Mamba-2 (plain XLA)": ({}, plain),
            "Mamba-3 SISO (TPU kernel)": (siso, {}), "Mamba-3 SISO (plain XLA)": (siso, plain),
            "Mamba-3 MIMO R4 (TPU kernel)": (mimo, {}), "Mamba-3 MIMO R4 (plain XLA)": (mimo, plain)}
  layers = {k: v for k, v in layers.items() if not args.rows or any(s in k for s in args.rows.split(","))}
  tokens = args.batch * args.seq_len
  log(f"one layer, loss value_and_grad, batch {args.batch} x {args.seq_len}, bfloat16 matmuls, one v6e chip")
  log("| layer | model GFLOP | XLA GFLOP | GB accessed | FLOPs / byte | bound at v6e (574) | compile s |")
  log("|---|---:|---:|---:|---:|---|---:|")
  for name, (over, rt_over) in layers.items():
    cfg = config_for("tiny", **{**width, **over})
    rt = Runtime(compute_dtype="bfloat16", **rt_over).resolve("tpu")
    params = jax.eval_shape(lambda cfg=cfg: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt).params())
    batch = jax.eval_shape(lambda cfg=cfg: random_batch(cfg, args.batch, args.seq_len))
    place = lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=rep)
    grad = jax.jit(jax.value_and_grad(lambda p, b, cfg=cfg, rt=rt: loss_sums(p, b, cfg, rt)[0]))
    with metrics.Timer() as t:
      compiled = grad.lower(jax.tree.map(place, params), jax.tree.map(place, batch)).compile()
    cost = metrics.compiled_cost(compiled)
    flops, nbytes = cost["flops"], cost["bytes accessed"]
    model = metrics.train_flops_per_token(cfg, rt, args.seq_len) * tokens
    ratio = flops / nbytes
    log(f"| {name} | {model / 1e9:.1f} | {flops / 1e9:.1f} | {nbytes / 1e9:.2f} | {ratio:.0f} | "
        f"{'memory' if ratio < 574 else 'compute'} | {t.seconds:.0f} |")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--part", choices=("speed", "counts"), default="speed")
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq_len", type=int, default=512)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--rows", default="", help="--part counts: only the rows whose name holds one of these "
                  "comma-separated strings (e.g. 'Mamba-3'); each row's compile takes minutes")
  args = ap.parse_args(argv)
  if args.part == "counts":
    return counts(args)
  rt = Runtime().resolve("cpu")
  fns = {}
  for name, over in MODELS.items():
    cfg = config_for("tiny", vocab_size=257, **over)
    params = jax.jit(lambda cfg=cfg: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt).params())()
    batch = random_batch(cfg, args.batch, args.seq_len)
    fwd = jax.jit(lambda p, i, cfg=cfg: Mamba2LM.from_params(cfg, p, rt)(i))
    grad = jax.jit(jax.value_and_grad(lambda p, b, cfg=cfg: loss_sums(p, b, cfg, rt)[0]))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    for part, fn, a in (("forward", fwd, (params, batch["input_ids"])), ("train step", grad, (params, batch))):
      with metrics.Timer() as t:
        compiled = fn.lower(*a).compile()
      jax.block_until_ready(compiled(*a))  # warm-up
      fns[name, part] = (compiled, a, t.seconds, n_params)
  times = {k: [] for k in fns}
  for _ in range(args.repeats):  # round robin: a load falls on every model alike
    for k, (compiled, a, _, _) in fns.items():
      with metrics.Timer() as t:
        jax.block_until_ready(compiled(*a))
      times[k].append(t.seconds)
  tokens = args.batch * args.seq_len
  log(f"batch {args.batch} x {args.seq_len}, median of {args.repeats}, CPU runtime ({jax.device_count()} device)")
  log("| model | parameters | forward tok/s | vs Mamba-2 | train step tok/s | vs Mamba-2 | compile s (fwd, step) |")
  log("|---|---:|---:|---:|---:|---:|---:|")
  rate = {k: tokens / statistics.median(v) for k, v in times.items()}
  for name in MODELS:
    f, s = rate[name, "forward"], rate[name, "train step"]
    log(f"| {name} | {fns[name, 'forward'][3] / 1e6:.2f}M | {f:.0f} | {f / rate['Mamba-2', 'forward']:.2f} | "
        f"{s:.0f} | {s / rate['Mamba-2', 'train step']:.2f} | "
        f"{fns[name, 'forward'][2]:.1f}, {fns[name, 'train step'][2]:.1f} |")


if __name__ == "__main__":
  main()
