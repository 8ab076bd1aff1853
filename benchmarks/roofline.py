"""How close a program runs to the hardware: the device's measured matmul rate
and copy bandwidth, the datasheet figures of TPU chips, and the utilisation
figures built on them (MFU, bandwidth utilisation, roofline time).

Measured peaks are what `scripts/bench.py` divides by on CPUs and GPUs, where a
datasheet means little (a shared 2-core VM, clocks, thread counts); the TPU
table is what `scripts/aot_compile.py` divides by when no chip is at hand.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Chip:
  """Per-chip datasheet figures: dense bfloat16 FLOP/s, HBM bytes and bytes/s."""
  name: str
  peak_flops: float
  hbm_bytes: int
  hbm_bandwidth: float


GIB = 2**30

# Google Cloud TPU datasheets (per chip).
TPU_CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 275e12, 32 * GIB, 1.2e12),
    "v5e": Chip("TPU v5e", 197e12, 16 * GIB, 819e9),
    "v5p": Chip("TPU v5p", 459e12, 95 * GIB, 2.76e12),
    "v6e": Chip("TPU v6e", 918e12, 32 * GIB, 1.6e12),
}


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
  """Median wall seconds of `fn()` (its result blocked on) over `repeats` runs after `warmup`."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def matmul_rate(dtype="float32", n: int = 2048, repeats: int = 5) -> float:
  """FLOP/s of an n x n x n `jnp.dot` in `dtype` with float32 accumulation (2 n^3 FLOPs)."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  return 2.0 * n**3 / time_call(lambda: dot(a, b), repeats)


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> dict[str, float]:
  """Bytes/s moved by an elementwise pass over a float32 buffer, read plus write
  counted (2 x nbytes per pass):
    fresh:   the result goes to a newly allocated buffer (what an undonated jit does);
    donated: the input buffer is donated, so XLA writes in place.
  """
  n = nbytes // 4
  x = jnp.zeros((n,), jnp.float32)
  fresh = jax.jit(lambda x: x + 1.0)
  t_fresh = time_call(lambda: fresh(x), repeats)
  inplace = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  state = {"x": jnp.zeros((n,), jnp.float32)}

  def step():
    state["x"] = inplace(state["x"])
    return state["x"]

  t_donated = time_call(step, repeats)
  return {"fresh": 2.0 * n * 4 / t_fresh, "donated": 2.0 * n * 4 / t_donated}


def matvec_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, k: int = 1024) -> float:
  """Bytes/s of a float32 (k x n) matrix read by a batch-1 `x @ W` (n = nbytes / 4k):
  the read stream that batch-1 decoding is made of. Only reads count (the output is
  tiny), where `copy_bandwidth` counts a read and a write stream; decode rows report
  utilisation against both. (On the 2-core dev VM the two came out alike, ~23 GB/s,
  while a chain of a 130m model's smaller matvecs read ~17 GB/s, numpy's alike:
  per-call overhead, not bandwidth.)"""
  n = max(1, nbytes // (4 * k))
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  w = jax.random.normal(k1, (k, n), jnp.float32)
  x = jax.random.normal(k2, (1, k), jnp.float32)
  mv = jax.jit(lambda x, w: x @ w)
  return 4.0 * k * n / time_call(lambda: mv(x, w), repeats)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s over the peak."""
  return tokens_per_s * flops_per_token / peak_flops


def bandwidth_utilisation(tokens_per_s: float, bytes_per_token: float, bandwidth: float) -> float:
  """Bytes that must move per token, times tokens/s, over the bandwidth."""
  return tokens_per_s * bytes_per_token / bandwidth


def roofline_seconds(flops: float, bytes_accessed: float, peak_flops: float, bandwidth: float) -> dict:
  """The time a program needs at the peaks: the larger of its compute and memory times."""
  t_compute, t_memory = flops / peak_flops, bytes_accessed / bandwidth
  return {"compute_s": t_compute, "memory_s": t_memory, "time_s": max(t_compute, t_memory),
          "bound": "compute" if t_compute >= t_memory else "memory",
          "intensity": flops / max(bytes_accessed, 1.0)}


def decode_bytes_per_step(cfg, batch: int) -> float:
  """Bytes one decoding step must move at least: every parameter read once (float32,
  as stored; the LM head is the tied embedding) and the recurrent state (conv
  window and SSM state, float32) read and written once. Divide by the batch for
  bytes per token."""
  d, i, h, gn, k, v = (cfg.d_model, cfg.d_inner, cfg.nheads, cfg.ngroups * cfg.d_state,
                       cfg.d_conv, cfg.padded_vocab_size)
  per_layer = (d + d * (2 * i + 2 * gn + h) + k * (i + 2 * gn) + (i + 2 * gn)
               + 3 * h + i + i * d)
  params = cfg.n_layer * per_layer + v * d * (1 if cfg.tie_embeddings else 2) + d
  state = cfg.n_layer * batch * ((k - 1) * (i + 2 * gn) + h * cfg.headdim * cfg.d_state)
  return 4.0 * (params + 2 * state)


def compiled_memory(compiled) -> dict[str, int] | None:
  """Bytes of a compiled program from XLA's memory analysis: arguments, outputs,
  temporaries (scratch), aliased (outputs written into donated inputs), and the
  peak estimate arguments + outputs + temporaries - aliased."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - backends without the analysis
    return None
  if m is None:
    return None
  out = {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
         "temp_bytes": int(m.temp_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
         "generated_code_bytes": int(m.generated_code_size_in_bytes)}
  out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                       - out["alias_bytes"])
  return out


def compiled_cost(compiled) -> dict[str, float]:
  """XLA's own FLOP and byte counts of a compiled program (empty if unavailable)."""
  try:
    c = compiled.cost_analysis()
  except Exception:  # noqa: BLE001
    return {}
  if isinstance(c, (list, tuple)):
    c = c[0] if c else {}
  c = c or {}
  return {k: float(c[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in c}
