"""The peaks of this device, measured in the same run as the benchmarks.

On CPUs and GPUs a datasheet says little about what a program can reach (a
shared 2-core VM, clocks, thread counts), so MFU and bandwidth utilisation
divide by rates measured here: a large matmul in the compute dtype, an
elementwise copy, and the batch-1 matrix-vector read that decoding is made of.
Decode's utilisation also needs the bytes one step must move, which only this
benchmark asks for. The datasheet table, MFU and the roofline time of a
compiled program are the library's (`mamba_train.metrics`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import peers
from benchmarks.common import CORES, log, median_time
from mamba_train.model.cache import Mamba2Cache
from mamba_train.train.state import param_shapes


def matmul_rate(dtype="float32", n: int = 2048, repeats: int = 5) -> float:
  """FLOP/s of an n x n x n `jnp.dot` in `dtype` with float32 accumulation (2 n^3 FLOPs)."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  return 2.0 * n**3 / median_time(lambda: dot(a, b), repeats)


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> dict[str, float]:
  """Bytes/s moved by an elementwise pass over a float32 buffer, read plus write
  counted (2 x nbytes per pass):
    fresh:   the result goes to a newly allocated buffer (what an undonated jit does);
    donated: the input buffer is donated, so XLA writes in place.
  """
  n = nbytes // 4
  x = jnp.zeros((n,), jnp.float32)
  fresh = jax.jit(lambda x: x + 1.0)
  t_fresh = median_time(lambda: fresh(x), repeats)
  inplace = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  state = {"x": jnp.zeros((n,), jnp.float32)}

  def step():
    state["x"] = inplace(state["x"])
    return state["x"]

  t_donated = median_time(step, repeats)
  return {"fresh": 2.0 * n * 4 / t_fresh, "donated": 2.0 * n * 4 / t_donated}


def matvec_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, k: int = 1024) -> float:
  """Bytes/s of a float32 (k x n) matrix read by a batch-1 `x @ W` (n = nbytes / 4k):
  the read stream that batch-1 decoding is made of. Only reads count (the output is
  tiny), where `copy_bandwidth` counts a read and a write stream; decode rows report
  utilisation against both. A chain of a real model's smaller matvecs reads slower
  than this one large one: per-call overhead, not bandwidth."""
  n = max(1, nbytes // (4 * k))
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  w = jax.random.normal(k1, (k, n), jnp.float32)
  x = jax.random.normal(k2, (1, k), jnp.float32)
  mv = jax.jit(lambda x, w: x @ w)
  return 4.0 * k * n / median_time(lambda: mv(x, w), repeats)


def decode_bytes_per_step(cfg, batch: int, context: int = 0) -> float:
  """Bytes one decoding step must move at least: every parameter read once (as
  stored, float32; the LM head is the tied embedding), the recurrent state (the
  decoding cache) read and written once, and a hybrid's key/value buffers over
  `context` positions read once. Divide by the batch for bytes per token."""
  params = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(param_shapes(cfg)))
  state = Mamba2Cache.bytes_for(cfg, batch)
  return float(params + 2 * state + Mamba2Cache.bytes_for(cfg, batch, context) - state)


def bandwidth_utilisation(tokens_per_s: float, bytes_per_token: float, bandwidth: float) -> float:
  """Bytes that must move per token, times tokens/s, over the bandwidth."""
  return tokens_per_s * bytes_per_token / bandwidth


def measure(args, results: dict) -> dict:
  """This run's roofline (once per run, kept in results['roofline']): the matmul
  rate in --dtype (and float32), the copy bandwidths, the matvec read rate, and on
  CPU the torch peer's matmul rate."""
  if "roofline" in results:
    return results["roofline"]
  n, mib = args.roofline_n, args.roofline_mib
  log(f"roofline: matmul {n}^3 in {args.dtype}" + (" and float32" if args.dtype != "float32" else "")
      + f", copy {mib} MiB ...")
  r = {"matmul_flops": matmul_rate(args.dtype, n=n, repeats=args.repeats)}
  if args.dtype != "float32":
    r["matmul_flops_f32"] = matmul_rate("float32", n=n, repeats=args.repeats)
  bw = copy_bandwidth(mib * 2**20, repeats=args.repeats)
  r.update({f"copy_bytes_per_s_{k}": v for k, v in bw.items()})
  r["copy_bytes_per_s"] = r["copy_bytes_per_s_donated"]
  r["matvec_bytes_per_s"] = matvec_bandwidth(mib * 2**20, repeats=args.repeats)
  if peers.have_torch() and jax.default_backend() == "cpu":  # the peers' CPU rate; off CPU it is not their device
    for dt in sorted({"float32", args.dtype}):
      r[f"torch_matmul_flops_{dt}"] = peers.torch_matmul_rate(dt, n, args.repeats, CORES)
  log("  " + ", ".join(f"{k} {v / 1e9:.1f}G" for k, v in r.items()))
  results["roofline"] = r
  return r
