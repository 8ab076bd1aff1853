"""Measures of a run and of a program: the FLOP count of Mamba-2, the one table of
chip peaks, MFU, XLA's own counts and memory analysis of a compiled program, device
memory and the one timer.

Pure formulas and readings: it imports nothing else of the package (the configs it
counts are read by attribute), so the model, generation and the trainer may all use
it. The record these figures are written to is `mamba_train.workdir.record`.
"""

from __future__ import annotations

import dataclasses
import time

import jax

# The FLOP formulas take a `Mamba2Config` (cfg) and a resolved `Runtime` (runtime) and read
# them by attribute: importing the model here would make every user of the timer or the
# chip table load it.


def ssd_flops_per_token(h: int, p: int, n: int, g: int, q: int, seq_len: int,
                        form: str = "parallel", window: int = 0) -> float:
  """Matmul FLOPs of the SSD's forward per token, as `ssd.ssd_chunked` computes them,
  for h heads of dim p, state n, g groups, chunk q and c = ceil(seq_len / q) chunks:
    1. C.B inside a chunk   2 q g n     and its product with x   2 q h p
    2. chunk end states     2 h p n
    3. state passing        2 (c+1)^2 h p n / seq_len   (a (c+1) x (c+1) product;
                            the scan form passes states elementwise: 0)
    4. state -> output      2 h p n
  The intra-chunk terms grow with q, the state passing with c: that is the chunk
  size trade-off. The decays' own small matmuls are left out (not the model's).
  With a window W (either form): no state passing (the band is elementwise), and
  the one or two partly-visible chunks at the window's far edge (two unless q
  divides W) each cost term 1 again.
  """
  if window:
    far = 1 if window % q == 0 else 2
    return (1 + far) * (2 * q * g * n + 2 * q * h * p) + 4 * h * p * n
  c = -(-seq_len // q)
  passing = 2 * (c + 1) ** 2 * h * p * n / seq_len if form == "parallel" else 0.0
  return 2 * q * g * n + 2 * q * h * p + 2 * h * p * n + passing + 2 * h * p * n


def forward_flops_per_token(cfg, runtime, seq_len: int) -> float:
  """Matmul FLOPs of one forward pass, per token, as the model computes them with
  `runtime` (resolved: its form and chunk decide the SSD terms).

  With d d_model, i d_inner, h heads, g groups, n d_state, k conv kernel and V the
  padded vocabulary, per Mamba-2 layer: in_proj 2 d (2i + 2gn + h), out_proj
  2 i d, conv 2 k (i + 2gn), and the SSD (`ssd_flops_per_token`); plus the LM
  head 2 d V. A hybrid's other layers (`attention_flops_per_token`,
  `mlp_flops_per_token`, `moe_flops_per_token`: active experts only) add theirs. Elementwise work (norms, gates,
  exponentials, softmax) is left out, as is the convention for MFU.
  """
  d, i, h = cfg.d_model, cfg.d_inner, cfg.nheads
  g, n, k = cfg.ngroups, cfg.d_state, cfg.d_conv
  form, q = runtime.ssd_plan(cfg.chunk_size, cfg.ssd_window)
  proj = 2 * d * (2 * i + 2 * g * n + h) + 2 * i * d
  conv = 2 * k * (i + 2 * g * n)
  ssd = ssd_flops_per_token(h, cfg.headdim, n, g, q, seq_len, form, cfg.ssd_window)
  return (cfg.count("M") * (proj + conv + ssd) + cfg.count("*") * attention_flops_per_token(cfg, seq_len)
          + cfg.count("-") * mlp_flops_per_token(cfg) + cfg.count("E") * moe_flops_per_token(cfg)
          + 2 * d * cfg.padded_vocab_size)


def attention_flops_per_token(cfg, seq_len: int) -> float:
  """One attention layer's matmul FLOPs per token: the q, k, v and o projections
  2 d e (2h + 2kv), and q.k and p.v over the whole l x l square, 4 h e l, as the
  model computes them (the causal mask is applied, not skipped; a kernel that
  skips the masked half does half of this term)."""
  d, h, kv, e = cfg.d_model, cfg.attn_num_heads, cfg.n_kv_heads, cfg.attn_head_dim
  return 2 * d * e * (2 * h + 2 * kv) + 4 * h * e * seq_len


def mlp_flops_per_token(cfg) -> float:
  """One MLP layer's matmul FLOPs per token: up and down 4 d f, plus the gate's
  2 d f for swiglu."""
  return (6 if cfg.mlp_act == "swiglu" else 4) * cfg.d_model * cfg.d_intermediate


def moe_flops_per_token(cfg) -> float:
  """One mixture-of-experts layer's matmul FLOPs per token, its active parameters
  only (what MFU counts): the router 2 d E, the k chosen experts' up and down
  4 w f each (6 w f gated: swiglu), the latent projections 4 d w, the shared
  expert 4 d s (6 d s gated). The
  experts a token does not reach cost nothing: the dispatch is a grouped matmul
  over the t k assignments (model/moe.py)."""
  d, w = cfg.d_model, cfg.moe_width
  mats = 3 if cfg.mlp_act == "swiglu" else 2  # matmuls an expert runs
  return (2 * d * cfg.n_routed_experts + cfg.num_experts_per_tok * 2 * mats * w * cfg.moe_intermediate_size
          + (4 * d * w if cfg.moe_latent_size else 0) + 2 * mats * d * cfg.moe_shared_expert_intermediate_size)


def inactive_params(cfg) -> int:
  """Parameters a token does not use: of each MoE layer's routed experts, all but the
  num_experts_per_tok it is sent to (0 for a dense model). Total minus these is the
  active count."""
  if not cfg.count("E"):
    return 0
  per_expert = (3 if cfg.mlp_act == "swiglu" else 2) * cfg.moe_width * cfg.moe_intermediate_size
  return cfg.count("E") * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert


def train_flops_per_token(cfg, runtime, seq_len: int) -> float:
  """Forward plus backward (twice the forward); recomputation under remat is not counted."""
  return 3.0 * forward_flops_per_token(cfg, runtime, seq_len)


def quantized_flops_per_token(cfg, runtime, seq_len: int) -> float:
  """Of `train_flops_per_token`, the matmuls that run in `runtime.matmul_precision`
  (model/matmul.py `linear`): the Mamba-2 in_proj and out_proj, attention's q/k/v/o
  projections and the MLP, forward and both backward dots. 0 for 'default'. Not the
  LM head (the training loss keeps it in the compute dtype), the SSD, the convolution,
  attention's scores or the MoE experts (a grouped matmul in the compute dtype)."""
  if runtime.matmul_precision == "default":
    return 0.0
  d, i, h = cfg.d_model, cfg.d_inner, cfg.nheads
  g, n = cfg.ngroups, cfg.d_state
  proj = 2 * d * (2 * i + 2 * g * n + h) + 2 * i * d
  attn = 0.0
  if cfg.count("*"):  # attention's projections: its FLOPs less the l x l scores
    attn = attention_flops_per_token(cfg, seq_len) - 4 * cfg.attn_num_heads * cfg.attn_head_dim * seq_len
  return 3.0 * (cfg.count("M") * proj + cfg.count("*") * attn + cfg.count("-") * mlp_flops_per_token(cfg))


GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """Per-chip datasheet figures: dense bfloat16 FLOP/s, HBM bytes and bytes/s, and the
  dense int8 and fp8 matmul peaks (0: the chip has no faster path for that format, so
  its matmuls run at the bfloat16 peak). `kinds` are the `device_kind` prefixes JAX
  reports for it."""
  name: str
  kinds: tuple[str, ...]
  peak_flops: float
  hbm_bytes: int
  hbm_bandwidth: float
  peak_int8: float = 0.0
  peak_fp8: float = 0.0
  devices_per_chip: int = 1  # JAX devices one chip shows (TPU7x: each of its two TensorCores)

  def matmul_peak(self, precision: str) -> float:
    """The dense peak of matmuls in `precision` (`Runtime.matmul_precision`)."""
    low = {"int8": self.peak_int8, "fp8": self.peak_fp8}.get(precision, 0.0)
    return low or self.peak_flops


# Vendor datasheets, per chip (TPU) or per GPU; every peak dense (no 2:4 sparsity).
# int8 / fp8: TPU v5e 394 TOP/s, v5p 918, v6e 1836 (int8; no fp8 unit before v7); A100
# 624 TOP/s int8 (no fp8); H100 / H200 SXM 1979 TFLOP/s fp8 and TOP/s int8; B200 4500.
# TPU v4's int8 runs at its bfloat16 rate. TPU7x (Ironwood): 2307 TFLOP/s bf16, 4614 fp8,
# 192 GiB at about 7.37 TB/s a chip, split between two TensorCores that JAX shows as two
# devices; GB200 2.5 PFLOP/s bf16 (5 fp8), 186 GB at 8 TB/s.
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", ("TPU v4",), 275e12, 32 * GIB, 1.2e12),
    "v5e": Chip("TPU v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16 * GIB, 819e9, peak_int8=394e12),
    "v5p": Chip("TPU v5p", ("TPU v5p", "TPU v5"), 459e12, 95 * GIB, 2.76e12, peak_int8=918e12),
    "v6e": Chip("TPU v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 32 * GIB, 1.6e12, peak_int8=1836e12),
    "a100": Chip("NVIDIA A100", ("NVIDIA A100",), 312e12, 80 * GIB, 2.04e12, peak_int8=624e12),
    "h100": Chip("NVIDIA H100", ("NVIDIA H100",), 989e12, 80 * GIB, 3.35e12, peak_int8=1979e12,
                 peak_fp8=1979e12),
    "h200": Chip("NVIDIA H200", ("NVIDIA H200",), 989e12, 141 * 10**9, 4.8e12, peak_int8=1979e12,
                 peak_fp8=1979e12),
    "tpu7x": Chip("TPU7x", ("TPU7x",), 2307e12, 192 * GIB, 7.37e12, peak_fp8=4614e12,
                  devices_per_chip=2),
    "b200": Chip("NVIDIA B200", ("NVIDIA B200",), 2250e12, 180 * 10**9, 8e12, peak_int8=4500e12,
                 peak_fp8=4500e12),
    "gb200": Chip("NVIDIA GB200", ("NVIDIA GB200",), 2500e12, 186 * 10**9, 8e12, peak_int8=5000e12,
                  peak_fp8=5000e12),
}

# CPUs vary too much for a table; a nominal float32 matmul rate of a 2-core
# development machine (docs/bench/design_notes.md). Set config.peak_flops for yours.
CPU_PEAK_FLOPS = 170e9


def chip_of(device: jax.Device) -> Chip | None:
  """The table entry whose `kinds` start the device's kind (longest match), or None."""
  kind = getattr(device, "device_kind", "")
  matches = [(len(k), c) for c in CHIPS.values() for k in c.kinds if kind.startswith(k)]
  return max(matches, key=lambda m: m[0])[1] if matches else None


def peak_flops_per_device(device: jax.Device, override: float = 0.0) -> float | None:
  """The override if positive, else the chip table's peak, else CPU_PEAK_FLOPS on
  a CPU, else None (MFU is then not reported)."""
  if override and override > 0:
    return float(override)
  chip = chip_of(device)
  if chip is not None:
    return chip.peak_flops / chip.devices_per_chip
  if device.platform == "cpu":
    return CPU_PEAK_FLOPS
  return None


def mfu(tokens_per_sec: float, flops_per_token: float, peak_per_device: float | None,
        num_devices: int = 1) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
  if not peak_per_device:
    return None
  return tokens_per_sec * flops_per_token / (peak_per_device * num_devices)


def roofline_seconds(flops: float, bytes_accessed: float, peak_flops: float, bandwidth: float,
                     low_flops: float = 0.0, low_peak: float = 0.0) -> dict:
  """The time a program needs at the peaks: the larger of its compute and memory times.
  `low_flops` of the `flops` run at `low_peak` (the int8 / fp8 matmuls, `Chip.matmul_peak`),
  the rest at `peak_flops`."""
  low_flops = min(low_flops, flops) if low_peak else 0.0
  t_compute = (flops - low_flops) / peak_flops + (low_flops / low_peak if low_flops else 0.0)
  t_memory = bytes_accessed / bandwidth
  return {"compute_s": t_compute, "memory_s": t_memory, "time_s": max(t_compute, t_memory),
          "bound": "compute" if t_compute >= t_memory else "memory",
          "intensity": flops / max(bytes_accessed, 1.0)}


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
  """XLA's own FLOP and byte counts of a compiled program (empty if unavailable).
  XLA counts a scanned (while-loop) body once, whatever its trip count: scale the
  body by the trip count, or count an unrolled copy, before calling them totals."""
  try:
    c = compiled.cost_analysis()
  except Exception:  # noqa: BLE001
    return {}
  if isinstance(c, (list, tuple)):
    c = c[0] if c else {}
  c = c or {}
  return {k: float(c[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in c}


def every_layer_counts(one_layer: dict, n_layer: int, *, more: dict, fewer: dict) -> dict[str, float]:
  """XLA's FLOPs and bytes of a program whose n_layer layers run as a loop, every layer
  counted: `compiled_cost` of its one-layer program, plus n_layer - 1 layer bodies,
  a body being the difference of two programs one layer apart (`more` - `fewer`:
  two unrolled layers and one, or one layer and none)."""
  return {k: one_layer.get(k, 0.0) + (n_layer - 1) * (more.get(k, 0.0) - fewer.get(k, 0.0))
          for k in ("flops", "bytes accessed")}


def memory_stats(device: jax.Device) -> dict[str, float]:
  """Bytes in use and peak, in GiB, where the backend reports them (not on CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 - backends without the call
    stats = None
  if not stats:
    return {}
  out = {}
  for key, name in (("bytes_in_use", "memory_gib"), ("peak_bytes_in_use", "peak_memory_gib")):
    if key in stats:
      out[name] = stats[key] / 2**30
  return out


class Timer:
  """Wall and process-CPU seconds: `with Timer() as t: ...` then `t.seconds` and
  `t.cpu_seconds`; or `t = Timer()` and read `t.elapsed` as it runs."""

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self._t0, self._c0 = time.perf_counter(), time.process_time()
    self.seconds = self.cpu_seconds = 0.0

  @property
  def elapsed(self) -> float:
    return time.perf_counter() - self._t0

  def __enter__(self):
    self.reset()
    return self

  def __exit__(self, *exc):
    self.seconds = self.elapsed
    self.cpu_seconds = time.process_time() - self._c0
    return False
