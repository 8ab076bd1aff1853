"""The model's own config: small, frozen and typed, built once at the entry point.

Field names follow mamba_ssm (d_model, n_layer, d_state, ...). Derived sizes
(d_inner, nheads, padded vocabulary) are properties, never configured.
"""

from __future__ import annotations

import dataclasses
import math

_COMPUTE_DTYPES = ("float32", "bfloat16")
_REMAT = ("none", "full", "save_matmuls")
_SSD_FORMS = ("auto", "scan", "parallel")
# Fields that steer how the model runs, not its weights: a checkpoint restores
# across them, and resuming a run may change them.
RUNTIME_FIELDS = ("compute_dtype", "remat", "chunk_size", "ssd_form", "scan_chunk_size",
                  "parallel_chunk_size")


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
  d_model: int = 768
  n_layer: int = 24
  vocab_size: int = 50277
  d_state: int = 128
  d_conv: int = 4
  expand: int = 2
  headdim: int = 64
  ngroups: int = 1
  chunk_size: int = 256
  dt_min: float = 0.001
  dt_max: float = 0.1
  dt_init_floor: float = 1e-4
  dt_limit: tuple[float, float] = (0.0, math.inf)
  A_init_range: tuple[float, float] = (1.0, 16.0)
  norm_eps: float = 1e-5
  pad_vocab_size_multiple: int = 16
  tie_embeddings: bool = True
  # Precision and memory: parameters are always float32; these steer the matmuls
  # and what the backward pass recomputes.
  compute_dtype: str = "float32"
  remat: str = "none"
  # How the SSD combines chunks (mamba_train.ssd.ssd_chunked): 'parallel' (every
  # chunk at once, for GPUs/TPUs), 'scan' (chunk by chunk, ~2x faster on CPU) or
  # 'auto' (scan on CPU, parallel elsewhere). The scan form runs at
  # scan_chunk_size (if smaller than chunk_size): its work per token grows with
  # the chunk and it gains nothing from longer ones (64 is ~2x faster than 256 on
  # CPU). The parallel form runs at parallel_chunk_size (if smaller): its (t, s)
  # decay and score stacks grow with the chunk and its state passing with the
  # number of chunks, and 128 balances them: on an H200 the 130m and 1.3b forward
  # ran 1.5x faster than at 256 (docs/bench/gpu.md), and for a TPU v6e XLA counts
  # 23% fewer bytes for the 2.7b forward at l=4096 (64 counts 50% more than 256).
  # None of these changes the math, only the rounding.
  ssd_form: str = "auto"
  scan_chunk_size: int = 64
  parallel_chunk_size: int = 128

  def __post_init__(self):
    object.__setattr__(self, "dt_limit", tuple(float(v) for v in self.dt_limit))
    object.__setattr__(self, "A_init_range", tuple(float(v) for v in self.A_init_range))
    problems = []
    for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand",
                 "headdim", "ngroups", "chunk_size", "pad_vocab_size_multiple", "scan_chunk_size",
                 "parallel_chunk_size"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        problems.append(f"{name} must be a positive integer, got {v!r}")
    if not problems:
      if self.d_inner % self.headdim:
        problems.append(f"expand*d_model = {self.d_inner} must be a multiple of headdim "
                        f"= {self.headdim}; change d_model, expand or headdim")
      elif self.nheads % self.ngroups:
        problems.append(f"the number of heads ({self.nheads}) must be a multiple of "
                        f"ngroups ({self.ngroups})")
    if not 0.0 <= self.dt_limit[0] < self.dt_limit[1]:
      problems.append(f"dt_limit must be (low, high) with 0 <= low < high, got {self.dt_limit}")
    if not 0.0 < self.dt_min <= self.dt_max:
      problems.append(f"need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")
    if self.compute_dtype not in _COMPUTE_DTYPES:
      problems.append(f"compute_dtype must be one of {_COMPUTE_DTYPES}, got {self.compute_dtype!r}")
    if self.remat not in _REMAT:
      problems.append(f"remat must be one of {_REMAT}, got {self.remat!r}")
    if self.ssd_form not in _SSD_FORMS:
      problems.append(f"ssd_form must be one of {_SSD_FORMS}, got {self.ssd_form!r}")
    if problems:
      raise ValueError("Invalid Mamba2Config: " + "; ".join(problems))

  @property
  def d_inner(self) -> int:
    return self.expand * self.d_model

  @property
  def nheads(self) -> int:
    return self.d_inner // self.headdim

  @property
  def conv_dim(self) -> int:
    return self.d_inner + 2 * self.ngroups * self.d_state

  @property
  def padded_vocab_size(self) -> int:
    m = self.pad_vocab_size_multiple
    return -(-self.vocab_size // m) * m

  def ssd_plan(self) -> tuple[str, int]:
    """(form, chunk) the SSD runs with on the current default backend."""
    from mamba_train.ssd import default_form  # ssd imports nothing from the package
    form = default_form() if self.ssd_form == "auto" else self.ssd_form
    cap = self.scan_chunk_size if form == "scan" else self.parallel_chunk_size
    return form, min(self.chunk_size, cap)

  def replace(self, **kw) -> "Mamba2Config":
    return dataclasses.replace(self, **kw)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["dt_limit"] = list(d["dt_limit"])
    d["A_init_range"] = list(d["A_init_range"])
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "Mamba2Config":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"Unknown Mamba2Config fields {unknown}; known fields: {sorted(names)}")
    return cls(**d)


# One table of sizes: the released state-spaces/mamba2-* models and a laptop one.
# Everything not listed takes the Mamba2Config defaults (d_state 128, headdim 64,
# expand 2, ngroups 1, chunk 256, vocab 50277 padded to 50288).
SIZES: dict[str, dict] = {
    "tiny": dict(d_model=256, n_layer=4, d_state=64, headdim=32, chunk_size=64, vocab_size=512),
    "130m": dict(d_model=768, n_layer=24),
    "370m": dict(d_model=1024, n_layer=48),
    "780m": dict(d_model=1536, n_layer=48),
    "1.3b": dict(d_model=2048, n_layer=48),
    "2.7b": dict(d_model=2560, n_layer=64),
}


def config_for(size: str, **overrides) -> Mamba2Config:
  if size not in SIZES:
    raise ValueError(f"Unknown model size {size!r}; choose one of {sorted(SIZES)}")
  return Mamba2Config(**{**SIZES[size], **overrides})
