"""The windowed SSD (`Mamba2Config.ssd_window`): XLA's counts, CPU speed, and what a
sequence split sends (not a test).

  python -m benchmarks.window --part counts     # SSD bytes and FLOPs at l=4096: CPU and v6e
  python -m benchmarks.window --part speed      # CPU forward and loss-gradient tokens/s
  python -m benchmarks.window --part exchange   # bytes a device sends in a sequence split (v6e)

--part counts compiles the SSD forward of one 130m layer (b 1, h 24, p 64, n 128,
g 1) three ways: the exact chunked form, the windowed one (W = --window), and the
naive form that materialises the (l x l) decay and score matrices (what the
design's "87% fewer memory accesses" is measured against), for XLA:CPU and for one
v6e chip through libtpu's AOT compiler, and reads `cost_analysis()`. The chunked
forms are counted in the 'parallel' form (no loop: XLA counts a loop body once).

--part speed times the tiny model (d_model 256, 4 layers, chunk 64) on this CPU:
the forward and the loss's value_and_grad, batch 1, at each --lengths, exact and
windowed, as the CPU runtime runs them; medians after a warm-up, compile apart.

--part exchange compiles the SSD of one 130m layer split over `sequence` = 8, 64
and 256 v6e chips (slices of --slice positions) and counts, in the lowered program,
the bytes each device sends: before (every slice's summary all-gathered and folded,
as the split did until the tree), after (summaries composed in log2 ppermute
rounds), and with the window (the left neighbour's last W positions).

Prints markdown tables (docs/bench/window.md keeps the dated results).
"""

from __future__ import annotations

import argparse
import math
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks.common import log, median_time  # noqa: E402
from mamba_train import Mamba2LM, Runtime, config_for, metrics  # noqa: E402
from mamba_train.ops import ssd  # noqa: E402
from mamba_train.parallel.mesh import make_mesh  # noqa: E402
from mamba_train.parallel.sequence import SequenceSplit  # noqa: E402
from mamba_train.parallel.topology import tpu_devices  # noqa: E402
from mamba_train.train.step import loss_sums  # noqa: E402

H, HP, N, G = 24, 64, 128, 1  # one 130m layer's SSD


def naive(x, dt, A, B, C, D):
  """The SSD as one (l x l) masked matrix per head: decays exp(segsum(dt A)) and
  scores C B^T materialised, then one product with dt x."""
  a = jnp.moveaxis(dt * A, 1, -1)  # (b, h, l)
  L = jnp.exp(ssd.segsum(a))  # (b, h, l, l), -inf above the diagonal -> 0
  cb = jnp.repeat(jnp.einsum("btgn,bsgn->bgts", C, B), H // G, axis=1)
  y = jnp.einsum("bhts,bshp->bthp", L * cb, x * dt[..., None])
  return y + x * D[:, None]


def _ssd_args(l, sharding=None):
  f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)
  return (f(1, l, H, HP), f(1, l, H), f(H), f(1, l, G, N), f(1, l, G, N), f(H))


def counts(args):
  print("| backend | form | chunk | GFLOP | GB accessed | vs naive bytes |")
  print("|---|---|---:|---:|---:|---:|")
  for backend in ("cpu", "v6e"):
    if backend == "cpu":
      shard = None
    else:
      devices = tpu_devices("v6e:1x1")[2]
      shard = NamedSharding(make_mesh({"data": 1}, devices), P())
    chunk = Runtime().resolve("tpu" if backend == "v6e" else "cpu").parallel_chunk_size
    forms = {"naive (l x l)": naive,
             "exact": lambda x, dt, A, B, C, D: ssd.ssd_chunked(x, dt, A, B, C, chunk, D=D)[0],
             f"W = {args.window}": lambda x, dt, A, B, C, D: ssd.ssd_chunked(
                 x, dt, A, B, C, chunk, D=D, window=args.window)[0]}
    base = None
    for name, fn in forms.items():
      cost = metrics.compiled_cost(jax.jit(fn).lower(*_ssd_args(args.length, shard)).compile())
      base = base or cost["bytes accessed"]
      print(f"| {backend} | {name} | {'' if name.startswith('naive') else chunk} | "
            f"{cost['flops'] / 1e9:.2f} | {cost['bytes accessed'] / 1e9:.3f} | "
            f"{100 * cost['bytes accessed'] / base:.0f}% |", flush=True)


def speed(args):
  print("| length | model | forward tok/s | value_and_grad tok/s | forward compile s | grad compile s |")
  print("|---:|---|---:|---:|---:|---:|")
  rt = Runtime().resolve("cpu")
  for l in args.lengths:
    for w in (0, args.window):
      cfg = config_for("tiny", vocab_size=257, ssd_window=w)
      params = jax.jit(lambda cfg=cfg: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt).params())()
      ids = jnp.asarray(np.random.default_rng(0).integers(0, 257, (1, l)), jnp.int32)
      batch = {"input_ids": ids, "targets": ids, "seq_idx": jnp.zeros_like(ids),
               "loss_mask": jnp.ones(ids.shape, jnp.float32)}
      fwd = jax.jit(lambda p, i, cfg=cfg: Mamba2LM.from_params(cfg, p, rt).backbone(i)[0])
      grad = jax.jit(jax.value_and_grad(lambda p, b, cfg=cfg: loss_sums(p, b, cfg, rt)[0]))
      out = []
      for fn, a in ((fwd, (params, ids)), (grad, (params, batch))):
        with metrics.Timer() as t:
          compiled = fn.lower(*a).compile()
        s = median_time(lambda: compiled(*a), args.repeats)
        out.append((l / s, t.seconds))
      print(f"| {l} | {'exact' if not w else f'W = {w}'} | {out[0][0]:.0f} | {out[1][0]:.0f} | "
            f"{out[0][1]:.1f} | {out[1][1]:.1f} |", flush=True)


def _gather_then_fold(split, x, dt, A, B, C, chunk, *, D):
  """The split as it was before the tree: every device all-gathers every slice's
  summary and folds them with the (slices+1)^2 state passing (no documents)."""
  ax = split.axis
  b, l, h, p = x.shape

  def local(x, dt, B, C, A, D):
    zero = jax.lax.pcast(jnp.zeros((b, h, p, N), jnp.float32), (ax,), to="varying")
    y, own = ssd.ssd_chunked(x, dt, A, B, C, chunk, D=D, initial_state=zero)
    total = jnp.sum(dt * A, axis=1)
    gather = lambda t: jax.lax.all_gather(t, ax)
    entering, final = ssd.pass_states(jnp.zeros((b, h, p, N)), gather(own), gather(total))
    i = jax.lax.axis_index(ax)
    return y + ssd.state_outputs(C, entering[i], dt, A), final[None]

  seq = P(None, ax)
  return split._map(local, (seq, seq, seq, seq, P(), P()), (seq, P(ax)))(x, dt, B, C, A, D)


_TENSOR = re.compile(r"tensor<([0-9x]+)x(f32|i32|bf16|i1)>")
_BYTES = {"f32": 4, "i32": 4, "bf16": 2, "i1": 1}


def sent_bytes(text: str, devices: int) -> dict[str, int]:
  """Bytes one device sends, by collective, from a lowered (StableHLO) module: a
  collective_permute sends its operand once; an all_gather sends its operand to
  each of the other devices."""
  out = {"all_gather": 0, "collective_permute": 0}
  for line in text.splitlines():
    m = re.search(r'"?stablehlo\.(all_gather|collective_permute)"?', line)
    if not m:
      continue
    operands = line.split(":")[-1].split("->")[0]
    size = sum(math.prod(int(d) for d in dims.split("x")) * _BYTES[t]
               for dims, t in _TENSOR.findall(operands))
    out[m.group(1)] += size * (devices - 1 if m.group(1) == "all_gather" else 1)
  return out


def exchange(args):
  print("| sequence | slice | method | all-gather MB | ppermute MB | sent per device MB | compile s |")
  print("|---:|---:|---|---:|---:|---:|---:|")
  chunk = Runtime().resolve("tpu").parallel_chunk_size
  for n, topo in ((8, "v6e:2x4"), (64, "v6e:8x8"), (256, "v6e:16x16")):
    devices = tpu_devices(topo)[2]
    mesh = make_mesh({"sequence": n}, devices)
    split = SequenceSplit(mesh, "sequence")
    l = n * args.slice
    seq_shard = NamedSharding(mesh, P(None, "sequence"))
    rep = NamedSharding(mesh, P())
    x, dt, A, B, C, D = _ssd_args(l)
    sh = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    avals = (sh(x, seq_shard), sh(dt, seq_shard), sh(A, rep), sh(B, seq_shard), sh(C, seq_shard), sh(D, rep))
    methods = {
        "before: all-gather + fold": lambda x, dt, A, B, C, D: _gather_then_fold(split, x, dt, A, B, C, chunk, D=D),
        "after: tree of ppermutes": lambda x, dt, A, B, C, D: split.ssd(
            ssd.ssd_chunked, ssd.state_outputs, x, dt, A, B, C, chunk, D=D),
        f"window {args.window}: left tail": lambda x, dt, A, B, C, D: split.ssd(
            ssd.ssd_chunked, ssd.state_outputs, x, dt, A, B, C, chunk, D=D, window=args.window),
    }
    for name, fn in methods.items():
      lowered = jax.jit(fn).lower(*avals)
      with metrics.Timer() as t:
        lowered.compile()
      b = sent_bytes(lowered.as_text(), n)
      print(f"| {n} | {args.slice} | {name} | {b['all_gather'] / 1e6:.2f} | "
            f"{b['collective_permute'] / 1e6:.2f} | {sum(b.values()) / 1e6:.2f} | {t.seconds:.1f} |",
            flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--part", choices=("counts", "speed", "exchange"), nargs="+",
                 default=["counts", "speed", "exchange"])
  p.add_argument("--window", type=int, default=1024)
  p.add_argument("--length", type=int, default=4096, help="counts: the SSD's length")
  p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help="speed: lengths")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--slice", type=int, default=1024, help="exchange: positions per device")
  args = p.parse_args()
  log(f"jax {jax.__version__}; {os.cpu_count()} CPUs")
  for part in args.part:
    {"counts": counts, "speed": speed, "exchange": exchange}[part](args)


if __name__ == "__main__":
  main()
