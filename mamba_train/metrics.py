"""Measures of a run and of a program: the FLOP count of Mamba-2, the one table of
chip peaks, MFU, XLA's own counts and memory analysis of a compiled program, device
memory, the one timer, and the writer that puts logged values into
`metrics.jsonl` and Weights & Biases.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from typing import Any, Mapping

import jax

from mamba_train import storage
from mamba_train.model.config import Mamba2Config
from mamba_train.model.runtime import Runtime


def ssd_flops_per_token(h: int, p: int, n: int, g: int, q: int, seq_len: int,
                        form: str = "parallel") -> float:
  """Matmul FLOPs of the SSD's forward per token, as `ssd.ssd_chunked` computes them,
  for h heads of dim p, state n, g groups, chunk q and c = ceil(seq_len / q) chunks:
    1. C.B inside a chunk   2 q g n     and its product with x   2 q h p
    2. chunk end states     2 h p n
    3. state passing        2 (c+1)^2 h p n / seq_len   (a (c+1) x (c+1) product;
                            the scan form passes states elementwise: 0)
    4. state -> output      2 h p n
  The intra-chunk terms grow with q, the state passing with c: that is the chunk
  size trade-off. The decays' own small matmuls are left out (not the model's).
  """
  c = -(-seq_len // q)
  passing = 2 * (c + 1) ** 2 * h * p * n / seq_len if form == "parallel" else 0.0
  return 2 * q * g * n + 2 * q * h * p + 2 * h * p * n + passing + 2 * h * p * n


def forward_flops_per_token(cfg: Mamba2Config, runtime: Runtime, seq_len: int) -> float:
  """Matmul FLOPs of one forward pass, per token, as the model computes them with
  `runtime` (resolved: its form and chunk decide the SSD terms).

  With d d_model, i d_inner, h heads, g groups, n d_state, k conv kernel and V the
  padded vocabulary, per Mamba-2 layer: in_proj 2 d (2i + 2gn + h), out_proj
  2 i d, conv 2 k (i + 2gn), and the SSD (`ssd_flops_per_token`); plus the LM
  head 2 d V. A hybrid's other layers (`attention_flops_per_token`,
  `mlp_flops_per_token`) add theirs. Elementwise work (norms, gates,
  exponentials, softmax) is left out, as is the convention for MFU.
  """
  d, i, h = cfg.d_model, cfg.d_inner, cfg.nheads
  g, n, k = cfg.ngroups, cfg.d_state, cfg.d_conv
  form, q = runtime.ssd_plan(cfg.chunk_size)
  proj = 2 * d * (2 * i + 2 * g * n + h) + 2 * i * d
  conv = 2 * k * (i + 2 * g * n)
  ssd = ssd_flops_per_token(h, cfg.headdim, n, g, q, seq_len, form)
  return (cfg.count("M") * (proj + conv + ssd) + cfg.count("*") * attention_flops_per_token(cfg, seq_len)
          + cfg.count("-") * mlp_flops_per_token(cfg) + 2 * d * cfg.padded_vocab_size)


def attention_flops_per_token(cfg: Mamba2Config, seq_len: int) -> float:
  """One attention layer's matmul FLOPs per token: the q, k, v and o projections
  2 d e (2h + 2kv), and q.k and p.v over the whole l x l square, 4 h e l, as the
  model computes them (the causal mask is applied, not skipped; a kernel that
  skips the masked half does half of this term)."""
  d, h, kv, e = cfg.d_model, cfg.attn_num_heads, cfg.n_kv_heads, cfg.attn_head_dim
  return 2 * d * e * (2 * h + 2 * kv) + 4 * h * e * seq_len


def mlp_flops_per_token(cfg: Mamba2Config) -> float:
  """One MLP layer's matmul FLOPs per token: up and down 4 d f, plus the gate's
  2 d f for swiglu."""
  return (6 if cfg.mlp_act == "swiglu" else 4) * cfg.d_model * cfg.d_intermediate


def train_flops_per_token(cfg: Mamba2Config, runtime: Runtime, seq_len: int) -> float:
  """Forward plus backward (twice the forward); recomputation under remat is not counted."""
  return 3.0 * forward_flops_per_token(cfg, runtime, seq_len)


GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """Per-chip datasheet figures: dense bfloat16 FLOP/s, HBM bytes and bytes/s.
  `kinds` are the `device_kind` prefixes JAX reports for it."""
  name: str
  kinds: tuple[str, ...]
  peak_flops: float
  hbm_bytes: int
  hbm_bandwidth: float


# Vendor datasheets, per chip (TPU) or per GPU.
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", ("TPU v4",), 275e12, 32 * GIB, 1.2e12),
    "v5e": Chip("TPU v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16 * GIB, 819e9),
    "v5p": Chip("TPU v5p", ("TPU v5p", "TPU v5"), 459e12, 95 * GIB, 2.76e12),
    "v6e": Chip("TPU v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 32 * GIB, 1.6e12),
    "a100": Chip("NVIDIA A100", ("NVIDIA A100",), 312e12, 80 * GIB, 2.04e12),
    "h100": Chip("NVIDIA H100", ("NVIDIA H100",), 989e12, 80 * GIB, 3.35e12),
    "h200": Chip("NVIDIA H200", ("NVIDIA H200",), 989e12, 141 * 10**9, 4.8e12),
    "b200": Chip("NVIDIA B200", ("NVIDIA B200",), 2250e12, 180 * 10**9, 8e12),
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
    return chip.peak_flops
  if device.platform == "cpu":
    return CPU_PEAK_FLOPS
  return None


def mfu(tokens_per_sec: float, flops_per_token: float, peak_per_device: float | None,
        num_devices: int = 1) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
  if not peak_per_device:
    return None
  return tokens_per_sec * flops_per_token / (peak_per_device * num_devices)


def roofline_seconds(flops: float, bytes_accessed: float, peak_flops: float, bandwidth: float) -> dict:
  """The time a program needs at the peaks: the larger of its compute and memory times."""
  t_compute, t_memory = flops / peak_flops, bytes_accessed / bandwidth
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


def _plain(v):
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return None if math.isnan(v) else str(v)
  return v


def set_aside_after(path, step: int) -> str | None:
  """Keep in `path` (a metrics.jsonl, local or on a bucket) only the rows of steps <=
  `step`, so that a run resumed from the checkpoint of `step` logs each later step once.
  The other rows (and any line cut off by a kill) go, in order, to
  `<path>.after-<step>[.n]`, which is written before `path` is replaced; each of the two
  writes is atomic (`storage.write_text`: a rename on a disk, one upload on a bucket),
  so no row is ever lost. Returns the set-aside file's name, or None when there was
  nothing to move."""
  path = storage.path(path)
  if not path.exists():
    return None
  rows = path.read_text().split("\n")  # the last: "" or a line cut off by a kill
  lines = [l + "\n" for l in rows[:-1]] + ([rows[-1] + "\n"] if rows[-1] else [])
  keep, later = [], []
  for line in lines:
    try:
      row_step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
      row_step = None  # a torn line: never a record of a kept step
    (keep if row_step is not None and row_step <= step else later).append(line)
  if not later:
    return None
  aside, n = path.with_name(f"{path.name}.after-{step}"), 1
  while aside.exists():
    aside, n = path.with_name(f"{path.name}.after-{step}.{n}"), n + 1
  storage.write_text(aside, "".join(later))
  storage.write_text(path, "".join(keep))
  return aside.name


class MetricsWriter:
  """Appends one JSON object per call to `workdir/metrics.jsonl` and logs the
  same values to a W&B run (mode 'offline' needs no network or account;
  'disabled' writes nothing there). Only process 0 writes.

  `resumed_from`: the step a resumed run restored. Rows of later steps, logged by
  the run that stopped, are set aside (`set_aside_after`) and a marker row
  `{"step": N, "event": "resumed", ...}` says where the record continues.

  On a bucket, where an object cannot be appended to, rows go to a local copy that
  is uploaded whole (one atomic write) every `sync_every_s`, at `sync()` (the train
  loop calls it at each checkpoint, so the record reaches every saved step) and at
  `close()`; W&B then keeps its files under $WANDB_DIR or ./wandb, not in the bucket.
  """

  def __init__(self, workdir, *, wandb_cfg: Mapping[str, Any], run_config: Mapping[str, Any],
               is_main: bool = True, resumed_from: int | None = None, sync_every_s: float = 60.0):
    self.is_main = is_main
    self.path = storage.path(workdir) / "metrics.jsonl"
    self._remote = storage.is_remote(workdir)
    self._staging = None
    self._local = self.path
    if is_main and self._remote:
      self._staging = tempfile.mkdtemp(prefix="mamba_train_metrics_")
      self._local = os.path.join(self._staging, "metrics.jsonl")
    self.sync_every_s = sync_every_s
    self._synced = time.monotonic()
    self._file = None
    if is_main:
      self.rewind(resumed_from or 0, {"event": "resumed" if resumed_from else "restarted"},
                  always=bool(resumed_from))
    self._wandb = None
    if is_main and wandb_cfg["mode"] != "disabled":
      import wandb  # imported here: it is slow to import and tests mostly disable it
      self._wandb = wandb.init(
          mode=wandb_cfg["mode"], project=wandb_cfg["project"], name=wandb_cfg["name"] or None,
          dir=None if self._remote else os.fspath(workdir), config=dict(run_config), resume="allow")

  def rewind(self, step: int, marker: Mapping[str, Any], *, always: bool = True) -> None:
    """The run continues after `step` (a resume, a rollback): rows of later steps are set
    aside and a marker row `{"step": step, **marker, "set_aside": file}` is written
    (`always=False`: only if some rows were set aside)."""
    if not self.is_main:
      return
    if self._file is not None:
      self._file.close()
      self.sync()  # the whole record where set_aside_after reads it
    aside = set_aside_after(self.path, step)
    if self._remote:  # the local copy starts from the bucket's record
      with open(self._local, "w") as f:
        f.write(self.path.read_text() if self.path.exists() else "")
    self._file = open(self._local, "a")
    if always or aside:
      self._file.write(json.dumps({"step": int(step), **marker, "set_aside": aside}) + "\n")
      self._file.flush()
      self.sync()

  def write(self, step: int, values: Mapping[str, Any]) -> None:
    if not self.is_main:
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._remote and time.monotonic() - self._synced > self.sync_every_s:
      self.sync()
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=int(step))

  def sync(self) -> None:
    """On a bucket: upload the record whole (one atomic write). Nothing to do on a disk."""
    if self._remote and self.is_main and os.path.exists(self._local):
      with open(self._local) as f:
        storage.write_text(self.path, f.read())
    self._synced = time.monotonic()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
      self.sync()
    if self._staging is not None:
      shutil.rmtree(self._staging, ignore_errors=True)
      self._staging = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


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
