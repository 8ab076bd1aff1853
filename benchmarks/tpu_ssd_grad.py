"""XLA's FLOPs and bytes of the SSD alone, forward and value_and_grad, compiled for
one TPU chip through libtpu (no TPU needed): the XLA form, and the one-pass Pallas
kernel with its backward kernel. `benchmarks.tpu_ssd` counts the forwards. (The
earlier forms that docs/bench/tpu_ssd.md compares against, the two-kernel form and
the reference backwards, were removed after it; their rows come from this
benchmark at commit 702e113.)

  env -u XLA_FLAGS python -m benchmarks.tpu_ssd_grad       # 2.7b layer: b1 l4096 h80 p64 g1 n128, chunk 128
  env -u XLA_FLAGS python -m benchmarks.tpu_ssd_grad --only "one pass"   # rows whose name has it

libtpu parses XLA_FLAGS and aborts on CPU-only flags, hence the `env -u`. The SSD
has no loop in any of these forms (the parallel XLA form, the Pallas grids), so
XLA's counts cover the whole program.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mamba_train import metrics
from mamba_train.ops import ssd, ssd_tpu
from mamba_train.parallel.topology import tpu_devices

# name -> SSD fn(x, dt, A, B, C, chunk, *, D, seq_idx) -> (y, final state)
FORMS = {
    "xla (ssd_chunked, parallel form)": functools.partial(ssd.ssd_chunked, form="parallel"),
    "pallas one pass, one-pass backward kernel": ssd_tpu.ssd_fused,
}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--topology", default="v6e:1x1")
  ap.add_argument("--seq_len", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=80)
  ap.add_argument("--docs", action="store_true", help="pass seq_idx (packed documents)")
  ap.add_argument("--only", default="", help="run the forms whose name contains this")
  args = ap.parse_args(argv)
  gen, topo, devices = tpu_devices(args.topology)
  chip = metrics.CHIPS[gen]
  rep = NamedSharding(Mesh(np.array(devices[:1]), ("d",)), P())
  S = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)
  b, l, h, p, g, n, q = 1, args.seq_len, args.heads, 64, 1, 128, 128
  bf = jnp.bfloat16
  xs = (S((b, l, h, p), bf), S((b, l, h)), S((h,)), S((b, l, g, n), bf), S((b, l, g, n), bf), S((h,)))
  seq = S((b, l), jnp.int32) if args.docs else None
  print(f"SSD alone, b={b} l={l} h={h} p={p} g={g} n={n} chunk {q}, x/B/C bfloat16, {topo} "
        f"({chip.name}: {chip.peak_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e12:.1f} TB/s)")
  print("| form | program | XLA FLOPs | XLA bytes | roofline ms | bound | compile s |")
  print("|---|---|---|---|---|---|---|")
  for name, fn in FORMS.items():
    if args.only not in name:
      continue
    def run(x, dt, A, B, C, D, seq, fn=fn):
      y, s = fn(x, dt, A, B, C, q, D=D, seq_idx=seq)
      return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s)
    progs = {"forward": jax.jit(run),
             "value_and_grad": jax.jit(jax.value_and_grad(run, argnums=tuple(range(6))))}
    for prog, f in progs.items():
      t = time.perf_counter()
      compiled = f.lower(*xs, seq).compile()
      secs = time.perf_counter() - t
      c = metrics.compiled_cost(compiled)
      rl = metrics.roofline_seconds(c["flops"], c["bytes accessed"], chip.peak_flops, chip.hbm_bandwidth)
      print(f"| {name} | {prog} | {c['flops']:.3g} | {c['bytes accessed']:.3g} | "
            f"{rl['time_s'] * 1e3:.2f} | {rl['bound']} | {secs:.0f} |", flush=True)


if __name__ == "__main__":
  main()
