"""The architecture: what the weights are. Small, frozen and typed, built once at
the entry point.

Field names follow mamba_ssm (d_model, n_layer, d_state, d_intermediate,
attn_*, ...). Derived sizes (d_inner, nheads, padded vocabulary, the layer
kinds) are properties, never configured.

`layer_pattern` makes a hybrid: one character per layer, as Megatron-Core's
`--hybrid-override-pattern` and Nemotron-H write it: 'M' a Mamba-2 layer, '3' a
Mamba-3 layer (model/mamba3.py; its fields named as mamba_ssm's Mamba3 names them), '*'
causal self-attention, '-' an MLP, 'E' a mixture-of-experts layer (model/moe.py;
its fields are named as transformers' NemotronHConfig names them). Empty (the default) is 'M' * n_layer, the
pure Mamba-2 model, whose parameters and files are unchanged by the option. How the
model runs on a machine (compute dtype, remat, SSD form and chunk caps) is not here:
see `runtime.Runtime`.
"""

from __future__ import annotations

import dataclasses
import math

# Fields on which no parameter depends: a checkpoint restores across them.
NOT_IN_WEIGHTS = ("chunk_size",)
# Fields that shape only the random initialization: weights loaded from elsewhere
# are the same weights whatever they say.
INIT_ONLY = ("dt_min", "dt_max", "dt_init_floor", "A_init_range")
# Architecture fields a run may set apart from the model it starts from (init_from):
# the window changes the function, and finetuning is how an exact model learns it.
FINETUNE_MAY_CHANGE = ("ssd_window",)

# The layer kinds of `layer_pattern`, by their character.
MAMBA, ATTENTION, MLP, MOE, MAMBA3 = "M", "*", "-", "E", "3"
KINDS = {MAMBA: "Mamba-2", ATTENTION: "attention", MLP: "MLP", MOE: "mixture of experts", MAMBA3: "Mamba-3"}
# Characters other tools use for kinds this library does not build.
UNSUPPORTED_KINDS: dict[str, str] = {}
MLP_ACTS = ("relu2", "swiglu")  # squared ReLU (Nemotron-H); gated SiLU (mamba_ssm's GatedMLP, Granite)
ROUTER_SCORES = ("sigmoid", "softmax")  # NemotronH's; GraniteMoeHybrid's (`moe.route`)
# Mamba-3's A = -max(f(dd_A), A_floor): f is mamba_ssm's heavy-tail activation (1 + u for
# u >= 0, 1 / (1 - u) below) since its PR #962, softplus before; checkpoints use either.
A_ACTIVATIONS = ("heavy_tail", "softplus")
ROPE_FRACTIONS = (0.5, 1.0)  # mamba_ssm's Mamba3 asserts these two


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
  # The SSD's truncated horizon: 0 (the default) is the exact model; W > 0 is the
  # model in which each position's state holds only the last W positions' inputs
  # (`ssd.ssd_chunked`'s `window`). It changes the function, so it is recorded with
  # the weights and checkpoints with another window are refused; transformers and
  # mamba_ssm cannot express it, so exports refuse it. At least chunk_size.
  ssd_window: int = 0
  dt_min: float = 0.001
  dt_max: float = 0.1
  dt_init_floor: float = 1e-4
  dt_limit: tuple[float, float] = (0.0, math.inf)
  A_init_range: tuple[float, float] = (1.0, 16.0)
  norm_eps: float = 1e-5
  pad_vocab_size_multiple: int = 16
  tie_embeddings: bool = True
  # Hybrids (see the module docstring). Attention: attn_num_heads query heads and
  # attn_num_heads_kv key/value heads (0: as many as query heads; fewer is
  # grouped-query attention) of attn_head_dim; no positional encoding unless
  # attn_rotary_emb_dim > 0 (rotary on that many leading dims of each head,
  # rotate-half form, base attn_rotary_base). MLP: d_intermediate hidden units,
  # activation mlp_act.
  layer_pattern: str = ""
  attn_num_heads: int = 0
  attn_num_heads_kv: int = 0
  attn_head_dim: int = 64
  attn_rotary_emb_dim: int = 0
  attn_rotary_base: float = 10000.0
  d_intermediate: int = 0
  mlp_act: str = "relu2"
  # Mixture of experts ('E', model/moe.py), as NemotronH: n_routed_experts squared-ReLU
  # experts of moe_intermediate_size, num_experts_per_tok of them per token, chosen
  # by sigmoid scores plus a correction bias within the topk_group best of n_group
  # groups; their weights renormalised (norm_topk_prob) and scaled by
  # routed_scaling_factor; a shared expert of moe_shared_expert_intermediate_size
  # (0: none) beside them; moe_latent_size > 0 runs the routed experts in a
  # latent space of that width (projected down before, up after).
  n_routed_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  moe_shared_expert_intermediate_size: int = 0
  moe_latent_size: int = 0
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  # How the router scores experts (Megatron-Core's moe_router_score_function):
  # 'sigmoid', NemotronH's (above); 'softmax', GraniteMoeHybrid's and Mixtral's: the
  # top num_experts_per_tok router logits chosen (within the topk_group best groups
  # when n_group > 1), their weights the softmax over those k logits times
  # routed_scaling_factor (Megatron's moe_router_pre_softmax=False); it has no
  # correction bias, and norm_topk_prob does not apply (the weights sum to 1).
  moe_router_score_function: str = "sigmoid"
  # Granite's multipliers (transformers' GraniteMoeHybridConfig names): the embedding
  # times embedding_multiplier; each layer adds residual_multiplier times its output
  # to the residual stream; attention's softmax scale attention_multiplier (0: the
  # usual 1/sqrt(attn_head_dim)); the logits divided by logits_scaling. MLP and
  # expert activations (relu2 or swiglu) follow mlp_act, in 'E' layers too.
  embedding_multiplier: float = 1.0
  residual_multiplier: float = 1.0
  attention_multiplier: float = 0.0
  logits_scaling: float = 1.0
  # The Mamba-2 layers' heads where d_inner is not a multiple of d_model
  # (NemotronH's mamba_num_heads: Nemotron-3-Nano has 64 heads of 64 on d_model
  # 2688); 0, the default, derives them as expand * d_model / headdim.
  mamba_num_heads: int = 0
  # Mamba-3 layers ('3', model/mamba3.py; docs/mamba3.md), named as mamba_ssm's Mamba3
  # names its arguments. They share d_state, expand, headdim, ngroups, chunk_size and
  # dt_min/dt_max/dt_init_floor with the Mamba-2 fields above (no conv, A_log or dt_limit).
  # The share of each B/C head's d_state rotated by the data-dependent angle: 0.5 or 1.0
  # (num_rope_angles angles).
  rope_fraction: float = 0.5
  # A = -max(f(dd_A), A_floor).
  A_floor: float = 1e-4
  # f above: 'heavy_tail' (mamba_ssm since its PR #962) or 'softplus' (before). Our name:
  # mamba_ssm hard-codes f, so its checkpoints' configs cannot say which.
  A_activation: str = "heavy_tail"
  # A gated RMSNorm per head (norm before the gate, weight gate_norm) where y * silu(z) is.
  is_outproj_norm: bool = False
  # Multi-input multi-output of rank mimo_rank (mimo_x, mimo_z, mimo_o).
  is_mimo: bool = False
  # The MIMO rank R (a model without is_mimo has rank 1 whatever this says, as in mamba_ssm).
  mimo_rank: int = 4

  def __post_init__(self):
    object.__setattr__(self, "dt_limit", tuple(float(v) for v in self.dt_limit))
    object.__setattr__(self, "A_init_range", tuple(float(v) for v in self.A_init_range))
    problems = []
    for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand",
                 "headdim", "ngroups", "chunk_size", "pad_vocab_size_multiple"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        problems.append(f"{name} must be a positive integer, got {v!r}")
    mh = self.mamba_num_heads
    if not isinstance(mh, int) or isinstance(mh, bool) or mh < 0:
      problems.append(f"mamba_num_heads must be 0 (derived) or a number of heads, got {mh!r}")
    if not problems:
      if self.d_inner % self.headdim:
        problems.append(f"expand*d_model = {self.d_inner} must be a multiple of headdim "
                        f"= {self.headdim}; change d_model, expand or headdim")
      elif self.nheads % self.ngroups:
        problems.append(f"the number of heads ({self.nheads}) must be a multiple of "
                        f"ngroups ({self.ngroups})")
    w = self.ssd_window
    if not isinstance(w, int) or isinstance(w, bool) or w < 0:
      problems.append(f"ssd_window must be 0 (exact) or a number of positions, got {w!r}")
    elif 0 < w < self.chunk_size and isinstance(self.chunk_size, int):
      problems.append(f"ssd_window ({w}) must be at least chunk_size ({self.chunk_size}): "
                      f"set ssd_window >= {self.chunk_size}, a smaller chunk_size, or 0 for the exact model")
    if not 0.0 <= self.dt_limit[0] < self.dt_limit[1]:
      problems.append(f"dt_limit must be (low, high) with 0 <= low < high, got {self.dt_limit}")
    if not 0.0 < self.dt_min <= self.dt_max:
      problems.append(f"need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
      v = getattr(self, name)
      if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
        problems.append(f"{name} must be a number > 0 (1 is none), got {v!r}")
    v = self.attention_multiplier
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
      problems.append(f"attention_multiplier must be 0 (1/sqrt(attn_head_dim)) or a scale > 0, got {v!r}")
    problems += self._pattern_problems()
    if not problems and MAMBA3 in self.pattern:
      problems += self._mamba3_problems()
    if problems:
      raise ValueError("Invalid Mamba2Config: " + "; ".join(problems))

  def _pattern_problems(self) -> list[str]:
    p, out = self.layer_pattern, []
    if not isinstance(p, str):
      return [f"layer_pattern must be a string such as 'M-M*', got {p!r}"]
    for ch in sorted(set(p)):
      if ch in UNSUPPORTED_KINDS:
        out.append(f"layer_pattern has {ch!r}: {UNSUPPORTED_KINDS[ch]}")
      elif ch not in KINDS:
        out.append(f"layer_pattern has {ch!r}; each character must be one of "
                   + ", ".join(f"{k!r} ({v})" for k, v in KINDS.items()))
    if p and isinstance(self.n_layer, int) and len(p) != self.n_layer:
      out.append(f"layer_pattern has {len(p)} layers but n_layer is {self.n_layer}; "
                 f"set n_layer={len(p)} or give one character per layer")
    if out:
      return out
    ints = ("attn_num_heads", "attn_num_heads_kv", "attn_head_dim", "attn_rotary_emb_dim",
            "d_intermediate")
    for name in ints:
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        out.append(f"{name} must be an integer >= 0, got {v!r}")
    if out:
      return out
    if ATTENTION in p:
      if self.attn_num_heads < 1 or self.attn_head_dim < 1:
        out.append("layer_pattern has attention layers ('*'): set attn_num_heads and "
                   "attn_head_dim (both >= 1)")
      elif self.n_kv_heads < 1 or self.attn_num_heads % self.n_kv_heads:
        out.append(f"attn_num_heads ({self.attn_num_heads}) must be a multiple of "
                   f"attn_num_heads_kv ({self.attn_num_heads_kv})")
      if self.attn_rotary_emb_dim % 2 or self.attn_rotary_emb_dim > self.attn_head_dim:
        out.append(f"attn_rotary_emb_dim ({self.attn_rotary_emb_dim}) must be even and at "
                   f"most attn_head_dim ({self.attn_head_dim}); 0 turns rotary off")
    if MLP in p and self.d_intermediate < 1:
      out.append("layer_pattern has MLP layers ('-'): set d_intermediate (their hidden size)")
    if (MLP in p or MOE in p) and self.mlp_act not in MLP_ACTS:
      out.append(f"mlp_act must be one of {MLP_ACTS}, got {self.mlp_act!r}")
    if MOE in p:
      out += self._moe_problems()
    return out

  def _moe_problems(self) -> list[str]:
    ints = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "moe_shared_expert_intermediate_size", "moe_latent_size", "n_group", "topk_group")
    out = [f"{n} must be an integer >= 0, got {getattr(self, n)!r}" for n in ints
           if not isinstance(getattr(self, n), int) or isinstance(getattr(self, n), bool)
           or getattr(self, n) < 0]
    if out:
      return out
    e, k, g, tg = self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group
    if e < 1 or self.moe_intermediate_size < 1 or k < 1:
      return ["layer_pattern has mixture-of-experts layers ('E'): set n_routed_experts, "
              "num_experts_per_tok and moe_intermediate_size (all >= 1)"]
    if g < 1 or e % g:
      out.append(f"n_group ({g}) must divide n_routed_experts ({e})")
    elif g > 1 and e // g < 2:
      out.append(f"grouped routing scores a group by its two best experts: n_routed_experts / "
                 f"n_group = {e // g} must be at least 2")
    elif not 1 <= tg <= g:
      out.append(f"topk_group ({tg}) must be between 1 and n_group ({g})")
    elif k > tg * (e // g):
      out.append(f"num_experts_per_tok ({k}) exceeds the experts of the topk_group ({tg}) groups "
                 f"a token may use ({tg * (e // g)})")
    if self.moe_router_score_function not in ROUTER_SCORES:
      out.append(f"moe_router_score_function must be one of {ROUTER_SCORES}, got "
                 f"{self.moe_router_score_function!r}")
    if not isinstance(self.routed_scaling_factor, (int, float)) or self.routed_scaling_factor <= 0:
      out.append(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")
    return out

  def _mamba3_problems(self) -> list[str]:
    out = []
    if self.rope_fraction not in ROPE_FRACTIONS:
      out.append(f"rope_fraction must be one of {ROPE_FRACTIONS} (as mamba_ssm's Mamba3), got {self.rope_fraction!r}")
    elif self.num_rope_angles < 1:
      out.append(f"d_state ({self.d_state}) leaves no rotary angle at rope_fraction {self.rope_fraction}: "
                 "use d_state >= 4")
    if self.A_activation not in A_ACTIVATIONS:
      out.append(f"A_activation must be one of {A_ACTIVATIONS}, got {self.A_activation!r}")
    if not isinstance(self.A_floor, (int, float)) or isinstance(self.A_floor, bool) or not self.A_floor > 0:
      out.append(f"A_floor must be a number > 0, got {self.A_floor!r}")
    for name in ("is_outproj_norm", "is_mimo"):
      if not isinstance(getattr(self, name), bool):
        out.append(f"{name} must be true or false, got {getattr(self, name)!r}")
    r = self.mimo_rank
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
      out.append(f"mimo_rank must be a positive integer, got {r!r}")
    if self.is_mimo is True and self.d_state % 2:
      out.append(f"a MIMO Mamba-3 layer rotates the pairs (i, i + d_state/2): d_state ({self.d_state}) must be even")
    if self.ssd_window:
      out.append(f"ssd_window ({self.ssd_window}) is Mamba-2's truncated horizon; Mamba-3 layers ('3') "
                 "have no exact windowed form (the trapezoid's look-ahead and the rotation angle run over "
                 "the whole history): set ssd_window=0")
    return out

  def weight_differences(self, other: "Mamba2Config", *, init: bool = True) -> dict[str, tuple]:
    """{field: (self's value, other's)} for each field that differs and that the
    weights depend on: every field but NOT_IN_WEIGHTS, and, with init=False (weights
    a run starts from), but INIT_ONLY and FINETUNE_MAY_CHANGE too. Values as
    `to_dict` writes them. Empty: the two configs describe the same weights."""
    skip = NOT_IN_WEIGHTS + (() if init else INIT_ONLY + FINETUNE_MAY_CHANGE)
    ours, theirs = self.to_dict(), other.to_dict()
    return {k: (ours[k], theirs[k]) for k in ours if k not in skip and ours[k] != theirs[k]}

  @property
  def pattern(self) -> str:
    """One character per layer ('M' * n_layer unless layer_pattern says otherwise)."""
    return self.layer_pattern or MAMBA * self.n_layer

  def count(self, kind: str) -> int:
    """How many layers of `kind` ('M', '*', '-' or 'E') the model has."""
    return self.pattern.count(kind)

  @property
  def moe_width(self) -> int:
    """The width the routed experts read and write: moe_latent_size, or d_model without one."""
    return self.moe_latent_size or self.d_model

  @property
  def attn_scale(self) -> float:
    """Attention's softmax scale: attention_multiplier, or 1/sqrt(attn_head_dim) without one."""
    return self.attention_multiplier or 1.0 / math.sqrt(self.attn_head_dim)

  @property
  def n_kv_heads(self) -> int:
    return self.attn_num_heads_kv or self.attn_num_heads

  @property
  def d_inner(self) -> int:
    return self.mamba_num_heads * self.headdim if self.mamba_num_heads else self.expand * self.d_model

  @property
  def nheads(self) -> int:
    return self.d_inner // self.headdim

  @property
  def mamba3_rank(self) -> int:
    """A Mamba-3 layer's MIMO rank R (1 unless is_mimo, as mamba_ssm's Mamba3 sets it)."""
    return self.mimo_rank if self.is_mimo else 1

  @property
  def num_rope_angles(self) -> int:
    """A Mamba-3 layer's rotary angles: int(d_state * rope_fraction), made even, halved
    (mamba_ssm's Mamba3.num_rope_angles)."""
    split = int(self.d_state * self.rope_fraction)
    return (split - split % 2) // 2

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

# Hybrid sizes: one attention layer in eight, as NVIDIA's Mamba-2-Hybrid used
# about 8% (Waleffe et al. 2024), at the width and depth of the pure model it
# sits beside; attention heads of 128 (grouped-query), no MLPs.
# The '*' sits mid-period, so no two attention layers are adjacent and the
# first layers are Mamba-2, as in their 8B hybrid.
for _name, _heads, _kv in (("1.3b", 16, 8), ("2.7b", 20, 4)):
  _n = SIZES[_name]["n_layer"]
  SIZES[f"{_name}-hybrid"] = dict(SIZES[_name], layer_pattern="MMMM*MMM" * (_n // 8),
                                  attn_num_heads=_heads, attn_num_heads_kv=_kv, attn_head_dim=128)
# NVIDIA's Nemotron-3-Nano-30B-A3B (Megatron-Bridge's Nemotron3NanoProvider): 52 layers,
# 23 Mamba-2 (64 heads of 64 on d_model 2688), 23 MoE (128 squared-ReLU experts of
# 1856, 6 a token, scaled by 2.5, one shared expert of 3712), 6 grouped-query
# attention layers; 31.6B parameters, 3.2B active a token. What `init_from` a
# transformers directory of it reads must equal this (the trainer says which field differs).
SIZES["nemotron3-nano"] = dict(
    d_model=2688, n_layer=52, vocab_size=131072, d_state=128, headdim=64, expand=1,
    mamba_num_heads=64, ngroups=8, chunk_size=128, dt_limit=(0.001, math.inf), tie_embeddings=False,
    layer_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    attn_num_heads=32, attn_num_heads_kv=2, attn_head_dim=128,
    n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5, norm_topk_prob=True)
# Mamba-3 (mamba_ssm's Mamba3 defaults: chunk 64, rope_fraction 0.5), pure and hybrid.
SIZES["tiny-mamba3"] = dict(SIZES["tiny"], layer_pattern="3333")
SIZES["tiny-mamba3-hybrid"] = dict(SIZES["tiny"], layer_pattern="33*-", attn_num_heads=4,
                                   attn_num_heads_kv=2, attn_head_dim=64, d_intermediate=512)
SIZES["tiny-hybrid"] = dict(SIZES["tiny"], layer_pattern="MM*-", attn_num_heads=4,
                            attn_num_heads_kv=2, attn_head_dim=64, d_intermediate=512)


def config_for(size: str, **overrides) -> Mamba2Config:
  if size not in SIZES:
    raise ValueError(f"Unknown model size {size!r}; choose one of {sorted(SIZES)}")
  return Mamba2Config(**{**SIZES[size], **overrides})
