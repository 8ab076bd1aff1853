"""The architecture: what the weights are. Small, frozen and typed, built once at
the entry point.

Field names follow mamba_ssm (d_model, n_layer, d_state, ...). Derived sizes
(d_inner, nheads, padded vocabulary) are properties, never configured. How the
model runs on a machine (compute dtype, remat, SSD form and chunk caps) is not here:
see `runtime.Runtime`.
"""

from __future__ import annotations

import dataclasses
import math

# Fields on which no parameter depends: a checkpoint restores across them.
NOT_IN_WEIGHTS = ("chunk_size",)


class FrozenFields:
  """What the frozen config dataclasses share: copies with changes, and plain dicts
  (JSON, ml_collections) both ways, strict about field names."""

  @classmethod
  def field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)

  def to_dict(self) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

  @classmethod
  def from_dict(cls, d: dict):
    unknown = sorted(set(d) - cls.field_names())
    if unknown:
      raise ValueError(f"Unknown {cls.__name__} fields {unknown}; known fields: {sorted(cls.field_names())}")
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class Mamba2Config(FrozenFields):
  d_model: int = 768
  n_layer: int = 24
  vocab_size: int = 50277
  d_state: int = 128
  d_conv: int = 4
  expand: int = 2
  headdim: int = 64
  ngroups: int = 1
  # The chunk of the SSD's block decomposition, as mamba_ssm and transformers
  # record it. Every chunk size computes the same function, so no parameter
  # depends on it; the runtime may cap it (`runtime.Runtime`).
  chunk_size: int = 256
  dt_min: float = 0.001
  dt_max: float = 0.1
  dt_init_floor: float = 1e-4
  dt_limit: tuple[float, float] = (0.0, math.inf)
  A_init_range: tuple[float, float] = (1.0, 16.0)
  norm_eps: float = 1e-5
  pad_vocab_size_multiple: int = 16
  tie_embeddings: bool = True

  def __post_init__(self):
    object.__setattr__(self, "dt_limit", tuple(float(v) for v in self.dt_limit))
    object.__setattr__(self, "A_init_range", tuple(float(v) for v in self.A_init_range))
    problems = []
    for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand",
                 "headdim", "ngroups", "chunk_size", "pad_vocab_size_multiple"):
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
