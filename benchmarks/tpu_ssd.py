"""XLA's counts of the SSD forms compiled for one TPU v6e chip (libtpu, no TPU).

  python -m benchmarks.tpu_ssd [--out DIR]     # XLA_FLAGS unset: libtpu parses it too

For one 2.7b layer's shapes (b 1, l 4096, h 80, p 64, g 1, n 128, chunk 128;
x, B, C bfloat16, dt float32): the SSD forward alone, as `ssd_chunked`'s parallel
form and as the one-pass Pallas kernel; with and without documents (seq_idx). Then
the one-layer 2.7b model forward (`ssd_impl` xla and pallas), whole and without the
embedding and LM head (the layer, which `scaled_forward_counts` multiplies by the
depth). Compile only: the counts are XLA's cost analysis. (The two-kernel Pallas
form that docs/bench/tpu_ssd.md compares against was removed after it; its rows
come from this benchmark at commit 702e113.)"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import log
from benchmarks.compile import TPU, compile_forward, outside_scan_cost
from mamba_train import metrics
from mamba_train.model.config import config_for
from mamba_train.model.runtime import Runtime
from mamba_train.ops import ssd, ssd_tpu
from mamba_train.parallel.mesh import make_mesh
from mamba_train.parallel.topology import tpu_devices

SHAPE = {"b": 1, "l": 4096, "h": 80, "p": 64, "g": 1, "n": 128}  # one 2.7b layer's SSD
CHUNK = 128


def ssd_forms(interpret: bool = False) -> dict:
  """name -> SSD forward fn(x, dt, A, B, C, D, seq_idx) -> (y, final state)."""
  return {
      "ssd_chunked (parallel form)": functools.partial(ssd.ssd_chunked, form="parallel"),
      "Pallas, one pass": functools.partial(ssd_tpu.ssd_fused, interpret=interpret),
  }


def ssd_counts(topology: str = TPU) -> list[dict]:
  _, _, devices = tpu_devices(topology)
  rep = NamedSharding(make_mesh({"data": -1}, devices[:1]), P())
  s = SHAPE
  S = lambda shape, d=jnp.float32: jax.ShapeDtypeStruct(shape, d, sharding=rep)
  args = (S((s["b"], s["l"], s["h"], s["p"]), jnp.bfloat16), S((s["b"], s["l"], s["h"])), S((s["h"],)),
          S((s["b"], s["l"], s["g"], s["n"]), jnp.bfloat16), S((s["b"], s["l"], s["g"], s["n"]), jnp.bfloat16),
          S((s["h"],)))
  rows = []
  for docs in (False, True):
    for name, fn in ssd_forms().items():
      def fwd(x, dt, A, B, C, D, *seq, fn=fn):
        return fn(x, dt, A, B, C, CHUNK, D=D, seq_idx=seq[0] if seq else None)
      extra = (S((s["b"], s["l"]), jnp.int32),) if docs else ()
      with metrics.Timer() as t:
        cost = metrics.compiled_cost(jax.jit(fwd).lower(*args, *extra).compile())
      rows.append({"what": "SSD forward", "form": name, "seq_idx": docs, "compile_s": t.seconds,
                   "flops": cost.get("flops"), "bytes": cost.get("bytes accessed")})
      log(f"  SSD {name}{' seq_idx' if docs else ''}: {cost.get('flops', 0):.3e} FLOPs, "
          f"{cost.get('bytes accessed', 0):.3e} bytes ({t.seconds:.1f} s)")
  return rows


def model_counts() -> list[dict]:
  cfg = config_for("2.7b", n_layer=1)
  rows = []
  outside = None
  for name, impl in (("xla (parallel form)", "xla"), ("pallas, one pass", "pallas")):
    rt = Runtime(compute_dtype="bfloat16", ssd_impl=impl, ssd_form="parallel" if impl == "xla" else "auto")
    r = compile_forward(cfg, rt, 1, 4096)
    if outside is None:
      outside = outside_scan_cost(cfg, rt, 1, 4096)
    c = r["cost"]
    rows.append({"what": "2.7b forward, 1 layer", "form": name, "compile_s": r["compile_s"],
                 "flops": c.get("flops"), "bytes": c.get("bytes accessed"),
                 "layer_flops": c.get("flops", 0) - outside.get("flops", 0),
                 "layer_bytes": c.get("bytes accessed", 0) - outside.get("bytes accessed", 0)})
    log(f"  2.7b 1-layer forward, {name}: {c.get('flops', 0):.3e} FLOPs, {c.get('bytes accessed', 0):.3e} bytes; "
        f"layer {rows[-1]['layer_bytes']:.3e} bytes ({r['compile_s']:.1f} s)")
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.tpu_ssd", description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=None, help="write results.json here")
  ap.add_argument("--skip_model", action="store_true", help="the SSD alone only")
  args = ap.parse_args(argv)
  rows = ssd_counts()
  if not args.skip_model:
    rows += model_counts()
  print("| what | form | seq_idx | XLA FLOPs | XLA bytes | layer bytes (no embed/head) |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    lb = f"{r['layer_bytes']:.3e}" if "layer_bytes" in r else ""
    print(f"| {r['what']} | {r['form']} | {r.get('seq_idx', '')} | {r['flops']:.3e} | {r['bytes']:.3e} | {lb} |")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
