"""Sequence parallelism: per-device memory and speed of the train step against the
sequence length, for sequence = 1, 2, 4, 8 (not a test).

  python -m benchmarks.sequence --part cpu   # 8 simulated CPU devices, tiny config
  python -m benchmarks.sequence --part tpu   # AOT with libtpu: 1.3b / 2.7b on v5p and v6e

--part cpu compiles the trainer's own step (`train.step.make_train_step`) for a
mesh of `sequence` simulated devices and reads XLA's memory analysis of it: the
per-device peak (arguments + outputs + scratch - donated). Lengths double until
the peak passes --budget_mib, so each split's longest fitting length shows. The
step is timed at the lengths up to --time_max_len; the simulated devices share
this machine's cores, so tokens/s shows the cost of the exchange, not a speed-up.

--part tpu compiles the 1.3b and 2.7b train steps for TPU slices on this CPU
(`mamba_train.tools.aot.compile_train_step`, which scripts/aot_compile.py runs) at
32k, 64k and 128k tokens, one sequence per data x fsdp group, doubling `mesh.sequence` from 1 until the step
fits the chip's HBM. XLA's cost analysis counts the scanned layer body once, so
the roofline uses the model's FLOP count (`metrics.train_flops_per_token`).

Prints markdown tables (docs/bench/sequence.md keeps the dated results).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_TPU = __name__ == "__main__" and "tpu" in sys.argv
if __name__ == "__main__" and not _TPU:
  # The simulated devices must exist before JAX starts.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from mamba_train.xla_flags import apply_cpu_defaults  # noqa: E402

if not _TPU:  # libtpu parses XLA_FLAGS too, and aborts on XLA:CPU-only flags
  apply_cpu_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mamba_train import Runtime, config_for, metrics  # noqa: E402
from mamba_train.parallel import sharding  # noqa: E402
from mamba_train.parallel.mesh import make_mesh  # noqa: E402
from mamba_train.train import (
  optim,  # noqa: E402
  state as train_state,
  step as trainer,
)

MIB = 2**20
OPTIM = dict(lr=1e-3, schedule="constant", warmup_frac=0.0, decay_frac=0.0, final_lr_frac=0.1,
             b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, state_dtype="float32")


def _batch(b, l, mesh, abstract):
  sh = sharding.batch_sharding(mesh)
  if abstract:
    spec = lambda dt: jax.ShapeDtypeStruct((b, l), dt, sharding=sh)
    return {"input_ids": spec(jnp.int32), "targets": spec(jnp.int32), "seq_idx": spec(jnp.int32),
            "loss_mask": spec(jnp.float32)}
  ids = np.random.default_rng(0).integers(0, 256, (b, l + 1), dtype=np.int32)
  host = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "seq_idx": np.zeros((b, l), np.int32),
          "loss_mask": np.ones((b, l), np.float32)}
  return {k: jax.device_put(v, sh) for k, v in host.items()}


def cpu_part(args):
  cfg = config_for("tiny", vocab_size=257)
  rt = Runtime(remat=args.remat).resolve("cpu")
  tx, schedule = optim.make_optimizer(OPTIM, 10)
  print(f"tiny config (d_model {cfg.d_model}, {cfg.n_layer} layers), batch 1, remat {rt.remat}, "
        f"SSD {rt.ssd_form}; budget {args.budget_mib} MiB per device\n")
  print("| sequence | length | peak MiB/device | scratch MiB/device | compile s | tokens/s |")
  print("|---:|---:|---:|---:|---:|---:|")
  longest = {}
  for sp in (1, 2, 4, 8):
    mesh = make_mesh({"sequence": sp}, jax.devices()[:sp])
    step = trainer.make_train_step(cfg, rt, tx, schedule, mesh)
    abstract = train_state.abstract_train_state(cfg, tx, mesh)
    l = args.min_len
    while l <= args.max_len:
      t0 = time.perf_counter()
      compiled = step.lower(abstract, _batch(1, l, mesh, True)).compile()
      compile_s = time.perf_counter() - t0
      mem = metrics.compiled_memory(compiled)
      speed = "-"
      if l <= args.time_max_len and mem["peak_bytes"] <= args.budget_mib * MIB:
        state = train_state.init_train_state(cfg, tx, mesh, seed=0)
        batch = _batch(1, l, mesh, False)
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for _ in range(args.steps):
          state, m = compiled(state, batch)
        jax.block_until_ready(m)
        speed = f"{args.steps * l / (time.perf_counter() - t0):,.0f}"
      print(f"| {sp} | {l:,} | {mem['peak_bytes'] / MIB:,.0f} | {mem['temp_bytes'] / MIB:,.0f} | "
            f"{compile_s:.1f} | {speed} |", flush=True)
      if mem["peak_bytes"] > args.budget_mib * MIB:
        break
      longest[sp] = l
      l *= 2
  print("\nlongest length within the budget: "
        + ", ".join(f"sequence={sp}: {l:,}" for sp, l in longest.items()))


def tpu_part(args):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, root)
  from configs import base  # noqa: E402
  from mamba_train.parallel.topology import tpu_devices  # noqa: E402
  from mamba_train.tools import aot  # noqa: E402
  print("| model | slice | length | sequence | mesh (data, fsdp, sequence, tensor) | batch | "
        "GiB/chip (HBM) | step s at roofline | MFU at roofline | compile s |")
  print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
  for size in args.sizes:
    for topo in args.topologies:
      for l in args.lengths:
        sp, done = args.min_sequence, False
        while not done:
          c = base.mamba2_pretrain(size)
          c.runtime.remat = "full"
          c.seq_len = l
          gen, name, devices = tpu_devices(topo)
          n = len(devices)
          if sp > n or l % sp:
            print(f"| {size} | {topo} | {l // 1024}k | > {n} | does not fit | | | | | |", flush=True)
            break
          c.mesh.update(data=1, fsdp=n // sp, sequence=sp, tensor=1)
          c.batch_size = n // sp  # one sequence per fsdp group
          try:
            r = aot.compile_train_step(c, topo, reference=base.get_config())
            done = True
          except aot.DoesNotFit as e:
            print(f"<!-- {size} {topo} {l} sequence={sp}: {str(e).splitlines()[0][:160]} -->",
                  flush=True)
            sp *= 2
            continue
          m, shape = r["memory"], r["mesh"]
          print(f"| {size} | {topo} | {l // 1024}k | {sp} | "
                f"{shape['data']}, {shape['fsdp']}, {shape['sequence']}, {shape['tensor']} | "
                f"{c.batch_size} | {m['peak_bytes'] / 2**30:.1f} ({r['hbm_bytes_per_device'] / 2**30:.0f}) | "
                f"{r['step_time_s']:.2f} | {100 * r['mfu_at_roofline']:.0f}% | {r['compile_s']:.0f} |",
                flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--part", choices=("cpu", "tpu"), required=True)
  p.add_argument("--budget_mib", type=int, default=1024, help="cpu: per-device memory budget")
  p.add_argument("--min_len", type=int, default=4096)
  p.add_argument("--max_len", type=int, default=262144)
  p.add_argument("--time_max_len", type=int, default=16384, help="cpu: time the step up to here")
  p.add_argument("--steps", type=int, default=2)
  p.add_argument("--remat", default="full", choices=("none", "full", "save_matmuls"))
  p.add_argument("--sizes", nargs="+", default=["1.3b", "2.7b"])
  p.add_argument("--topologies", nargs="+", default=["v5p:2x2x2", "v6e:4x4"])
  p.add_argument("--lengths", nargs="+", type=int, default=[32768, 65536, 131072])
  p.add_argument("--min_sequence", type=int, default=1)
  args = p.parse_args()
  (cpu_part if args.part == "cpu" else tpu_part)(args)


if __name__ == "__main__":
  main()
