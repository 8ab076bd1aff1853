"""Speed of mamba_train on this machine, beside the peers, in one run.

  python -m benchmarks all --compare --plots --out bench_out      # everything (tiny and 130m)
  python -m benchmarks ssd --compare                               # b2 l2048 h24 p64 n128, chunk sweep
  python -m benchmarks train --config 130m --batch 1 --seq_len 512 --compare
  python -m benchmarks forward --config 130m --seq_len 2048 --compare
  python -m benchmarks decode --config tiny --compare
  python -m benchmarks decode_tpu --config 130m,1.3b --dtype bfloat16   # decode step for TPU v6e (libtpu)
  python -m benchmarks compile          # compile time against depth; 2.7b for TPU v6e with libtpu
  python -m benchmarks memory --config 130m
  python -m benchmarks loader
  python -m benchmarks report --inputs dirA,dirB --out merged     # join earlier runs

Run from the repository root. Every figure is the median of --repeats runs after
a warm-up run; compile time is timed apart (`jit(...).lower(...).compile()`), in
wall seconds and in this process's CPU seconds (the better figure on a shared
machine). Memory is XLA's memory analysis of the compiled program (arguments +
outputs + scratch - donated). The same run measures the device's matmul rate in
the compute dtype and its copy bandwidth: MFU is model FLOPs/s
(mamba_train.metrics, SSD terms included) over that matmul rate; decode's
bandwidth utilisation is the bytes a step must move (all parameters, the state
read and written) over the copy bandwidth.

--compare adds the peers on the same shapes with random weights: transformers'
PyTorch Mamba2 (its CPU path; torch threads = this machine's cores) and the
pure-JAX mamba2-jax, when installed (`pip install -e '.[bench]'`). The ratio
column is our tokens/s over the row's: above 1 means we are faster.
Outputs under --out: results.json, results.md and, with --plots, PNGs.
"""

from __future__ import annotations

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend (see the module)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from benchmarks import (
  compile as compile_bench,  # noqa: E402
  decode,
  loader,
  model,
  report,
  ssd,
)
from benchmarks.common import CORES, log  # noqa: E402
from mamba_train.metrics import Timer  # noqa: E402

BENCHES = ["ssd", "forward", "train", "decode", "decode_tpu", "compile", "memory", "loader", "all", "report"]


def parse(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  ap.add_argument("what", choices=BENCHES, help="report: merge the results.json of --inputs into --out")
  ap.add_argument("--inputs", default="", help="report: comma-separated directories of earlier runs")
  ap.add_argument("--config", default=None, help="model size(s), comma separated: tiny,130m,... "
                  "(default: tiny; 'all' runs tiny,130m)")
  ap.add_argument("--batch", type=int, default=None)
  ap.add_argument("--seq_len", type=int, default=None, help="one length (default: a sweep per bench)")
  ap.add_argument("--lengths", default=None, help="comma-separated lengths for the sweeps")
  ap.add_argument("--chunk_size", type=int, default=None, help="override the config's chunk size")
  ap.add_argument("--chunks", default=None, help="ssd: comma-separated chunk sizes (default 64,128,256)")
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--new_tokens", type=int, default=32, help="decode: tokens per timed loop")
  ap.add_argument("--compare", action="store_true", help="time the peers on the same shapes")
  ap.add_argument("--skip_tpu", action="store_true", help="compile: skip the TPU AOT figure")
  ap.add_argument("--remat", default=None, choices=["none", "full", "save_matmuls"],
                  help="what the backward pass recomputes (default: the runtime's, none)")
  ap.add_argument("--decode_layers", default="auto", choices=["auto", "unrolled", "scan"],
                  help="decode: how the decode loop runs the layers (the runtime's decode_layers)")
  ap.add_argument("--ssd_form", default="auto", help="auto (the backend's default), scan or parallel; "
                  "ssd also takes 'scan,parallel' to time both")
  ap.add_argument("--roofline_n", type=int, default=None, help="matmul size of the roofline "
                  "(default 2048 on CPU, 8192 on accelerators)")
  ap.add_argument("--roofline_mib", type=int, default=None, help="buffer size of the copy bandwidth "
                  "(default 256 MiB on CPU, 2048 on accelerators)")
  ap.add_argument("--out", default=None, help="write results.json and results.md here")
  ap.add_argument("--plots", action="store_true", help="PNG plots into --out")
  args = ap.parse_args(argv)
  if args.repeats < 1:
    ap.error("--repeats must be >= 1")
  if not set(args.ssd_form.split(",")) <= {"auto", "scan", "parallel"} or (
      "," in args.ssd_form and args.what != "ssd"):
    ap.error(f"--ssd_form must be auto, scan or parallel (ssd also takes 'scan,parallel'), got {args.ssd_form!r}")
  accel = jax.default_backend() != "cpu"
  args.roofline_n = args.roofline_n or (8192 if accel else 2048)
  args.roofline_mib = args.roofline_mib or (2048 if accel else 256)
  args.chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else None
  return args


def default_shapes(accel: bool) -> dict[str, dict]:
  """Per size: (forward lengths, batch), (train lengths, batch), decode contexts.
  On CPU, what fits a 2-core machine; on an accelerator, batches that fill it."""
  if not accel:
    return {
        "tiny": dict(fwd=([256, 512, 1024, 2048], 4), train=([256, 512, 1024], 4), ctx=[128, 512, 2048]),
        "130m": dict(fwd=([512, 2048], 1), train=([512], 1), ctx=[128, 1024]),
    }
  return {
      "130m": dict(fwd=([2048], 16), train=([2048], 16), ctx=[128, 2048]),
      "370m": dict(fwd=([2048], 16), train=([2048], 8), ctx=[128, 2048]),
      "1.3b": dict(fwd=([2048], 8), train=([2048], 4), ctx=[128, 2048]),
  }


def main(argv=None) -> dict:
  args = parse(argv)
  sizes = (args.config or ("tiny,130m" if args.what == "all" else "tiny")).split(",")
  lengths_arg = [int(x) for x in args.lengths.split(",")] if args.lengths else None

  def lengths(default):
    return [args.seq_len] if args.seq_len else (lengths_arg or default)

  defaults = default_shapes(jax.default_backend() != "cpu")
  results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "machine": f"{platform.processor() or platform.machine()}, {CORES} cores, "
                        f"{jax.devices()[0].device_kind}",
             "command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
             "rows": []}
  what = args.what
  if what == "report":
    report.merge([d for d in args.inputs.split(",") if d], results)
  with Timer() as total:
    if what in ("ssd", "all"):
      ssd.bench_ssd(args, results)
    for size in sizes:
      d = defaults.get(size, dict(fwd=([512], 1), train=([512], 1), ctx=[128]))
      if what in ("forward", "all"):
        model.bench_forward(args, results, size, lengths(d["fwd"][0]), args.batch or d["fwd"][1])
      if what in ("train", "all"):
        model.bench_train(args, results, size, lengths(d["train"][0]), args.batch or d["train"][1])
      if what in ("decode", "all"):
        decode.bench_decode(args, results, size, lengths(d["ctx"]), args.batch or 1)
      if what == "decode_tpu":
        decode.bench_decode_tpu(args, results, size)
      if what in ("memory", "all"):
        compile_bench.bench_memory(args, results, size, lengths([512, 1024, 2048, 4096]), args.batch or 1)
      if what in ("compile", "all"):
        compile_bench.bench_compile(args, results, size)
        args.skip_tpu = True  # the TPU figure once per run
    if what in ("loader", "all"):
      loader.bench_loader(args, results)
  results["seconds"] = total.seconds
  md = report.markdown(results)
  print(md)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, "results.md"), "w") as f:
      f.write(md)
    if args.plots:
      for p in report.plots(results, args.out):
        log(f"wrote {p}")
  return results


if __name__ == "__main__":
  main()
