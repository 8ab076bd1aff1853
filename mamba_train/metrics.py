"""Training metrics: the FLOP count of Mamba-2, MFU, device memory, and the
writers that put logged values into `metrics.jsonl` and Weights & Biases.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping

import jax

from mamba_train.config import Mamba2Config


def forward_flops_per_token(cfg: Mamba2Config, seq_len: int) -> float:
  """Matmul FLOPs of one forward pass, per token, as `ssd_chunked` computes them.

  With d d_model, i d_inner, h heads, p headdim, g groups, n d_state, k conv
  kernel, V padded vocabulary, Q chunk size and c = ceil(seq_len / Q) chunks,
  per layer:
    in_proj    2 d (2i + 2gn + h)        out_proj  2 i d
    conv       2 k (i + 2gn)
    SSD  1. C.B inside a chunk   2 Q g n     and its product with x   2 Q h p
         2. chunk end states     2 h p n
         3. state passing        2 (c+1)^2 h p n / seq_len   (a (c+1) x (c+1) product)
         4. state -> output      2 h p n
  plus the LM head 2 d V. The intra-chunk terms grow with Q, the state passing
  with c: that is the chunk-size trade-off. Q and the form are those the model
  runs with (`cfg.ssd_plan()`); the scan form passes states elementwise, so term 3
  is 0 there. Elementwise work (norms, gates, exponentials) and the decays' own
  small matmuls are left out, as is the convention for MFU.
  """
  d, i, h, p = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.headdim
  g, n, k = cfg.ngroups, cfg.d_state, cfg.d_conv
  form, q = cfg.ssd_plan()
  c = -(-seq_len // q)
  proj = 2 * d * (2 * i + 2 * g * n + h) + 2 * i * d
  conv = 2 * k * (i + 2 * g * n)
  passing = 2 * (c + 1) ** 2 * h * p * n / seq_len if form == "parallel" else 0.0
  ssd = 2 * q * g * n + 2 * q * h * p + 2 * h * p * n + passing + 2 * h * p * n
  return cfg.n_layer * (proj + conv + ssd) + 2 * d * cfg.padded_vocab_size


def train_flops_per_token(cfg: Mamba2Config, seq_len: int) -> float:
  """Forward plus backward (twice the forward); recomputation under remat is not counted."""
  return 3.0 * forward_flops_per_token(cfg, seq_len)


# Dense bfloat16 peak FLOP/s per device (per chip; per GPU), from vendor data sheets.
PEAK_FLOPS: dict[str, float] = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
    "NVIDIA B200": 2250e12,
}


# CPUs vary too much for a table; this nominal figure is XLA's float32 matmul
# rate measured on this project's 2-core dev machine (shared/REFERENCE.md).
CPU_PEAK_FLOPS = 170e9


def peak_flops_per_device(device: jax.Device, override: float = 0.0) -> float | None:
  """The override if positive, else the table entry whose name starts the device
  kind, else CPU_PEAK_FLOPS on a CPU, else None (MFU is then not reported)."""
  if override and override > 0:
    return float(override)
  kind = getattr(device, "device_kind", "")
  for name in sorted(PEAK_FLOPS, key=len, reverse=True):
    if kind.startswith(name):
      return PEAK_FLOPS[name]
  if device.platform == "cpu":
    return CPU_PEAK_FLOPS
  return None


def mfu(tokens_per_sec: float, flops_per_token: float, peak_per_device: float | None,
        num_devices: int) -> float | None:
  if not peak_per_device:
    return None
  return tokens_per_sec * flops_per_token / (peak_per_device * num_devices)


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


def _plain(v):
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return None if math.isnan(v) else str(v)
  return v


class MetricsWriter:
  """Appends one JSON object per call to `workdir/metrics.jsonl` and logs the
  same values to a W&B run (mode 'offline' needs no network or account;
  'disabled' writes nothing there). Only process 0 writes."""

  def __init__(self, workdir: str, *, wandb_cfg: Mapping[str, Any], run_config: Mapping[str, Any],
               is_main: bool = True):
    self.is_main = is_main
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a") if is_main else None
    self._wandb = None
    if is_main and wandb_cfg["mode"] != "disabled":
      import wandb  # imported here: it is slow to import and tests mostly disable it
      self._wandb = wandb.init(
          mode=wandb_cfg["mode"], project=wandb_cfg["project"], name=wandb_cfg["name"] or None,
          dir=workdir, config=dict(run_config), resume="allow")

  @property
  def wandb_dir(self) -> str | None:
    return None if self._wandb is None else os.path.dirname(self._wandb.dir)

  def write(self, step: int, values: Mapping[str, Any]) -> None:
    if not self.is_main:
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=int(step))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


class Timer:
  """`with Timer() as t: ...` then `t.seconds`."""

  def __enter__(self):
    self._t0, self.seconds = time.perf_counter(), 0.0
    return self

  def __exit__(self, *exc):
    self.seconds = time.perf_counter() - self._t0
    return False
