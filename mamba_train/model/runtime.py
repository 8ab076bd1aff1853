"""How the model runs on a machine, apart from what its weights are (`config.py`).

None of these fields changes a parameter, so a checkpoint restores across any of
them and a run may resume with others; all but one change only speed, memory and
rounding. The exception is `moe_capacity_factor`, which drops mixture-of-experts
assignments past an expert's capacity: a training-time choice, as MaxText's and
Megatron's capacity factor, that caps the expert-parallel exchange's buffers.

The caller resolves a runtime for the backend it compiles for
(`Runtime(...).resolve("tpu")`, and the chip's `device_kind` where choices differ
per chip: `resolve("tpu", "TPU v6 lite")`): the model, the FLOP count and an
ahead-of-time compile for a TPU then agree, whatever machine Python runs on. A model
built with an unresolved runtime resolves it for JAX's default backend and its devices.
"""

from __future__ import annotations

import dataclasses

from mamba_train.model.config import FrozenFields
from mamba_train.ops import table

COMPUTE_DTYPES = ("float32", "bfloat16")
# The projections' and LM head's arithmetic (`model/matmul.py` says what each does
# and what stays float32): 'default' the compute dtype, 'fp8', 'int8'.
MATMUL_PRECISIONS = ("default", "fp8", "int8")
# What a layer's backward pass recomputes (`lm.remat_policy` says what each
# saves): 'none', 'full', 'save_moe' (full but the MoE layers' expert rows),
# 'save_matmuls', 'save_in_proj', 'save_in_proj_ssd', or 'auto' (`default_remat`,
# for the large configs, where activations must shrink).
REMAT = ("auto", "none", "full", "save_moe", "save_matmuls", "save_in_proj", "save_in_proj_ssd")
SSD_FORMS = ("auto", "scan", "parallel")

# Who runs each operation: an implementation of the selection table (`ops/table.py`,
# which says what each is, where it runs and what it supports), or 'auto' (the
# backend's choice, `default_*` below). Named for the compiler or library that runs
# it: 'xla', 'mosaic' (Pallas TPU kernels), 'triton' (Pallas Triton kernels, NVIDIA
# GPUs), and outside libraries by name ('megablox', 'tokamax', 'splash', 'cudnn').
SSD_IMPLS = ("auto",) + table.names("ssd_impl")
# The conv + SiLU and the gated RMSNorm, or ('fused', 'fused_triton') the layer between the matmuls.
LAYER_IMPLS = ("auto",) + table.names("layer_impl")
DECODE_IMPLS = ("auto",) + table.names("decode_impl")  # a Mamba-2 layer's decoding step between its matmuls
MOE_IMPLS = ("auto",) + table.names("moe_impl")  # the routed experts' grouped matmuls
ATTENTION_FORMS = ("auto",) + table.names("attention")  # softmax(q k^T) v in attention layers
IMPL_FIELDS = {"ssd_impl": SSD_IMPLS, "layer_impl": LAYER_IMPLS, "decode_impl": DECODE_IMPLS,
               "moe_impl": MOE_IMPLS, "attention": ATTENTION_FORMS}

# Old spellings, still read (a run's saved config.json, users' command lines), each
# named once in docs/configuration.md: field -> {old value: (its name now, whether it asked for
# Pallas' interpreter)}; and the field `pallas_interpret`, now `interpret`.
ALIASES = {
    "ssd_impl": {"pallas": ("mosaic", False), "interpret": ("mosaic", True), "triton_interpret": ("triton", True)},
    "layer_impl": {"mosaic_interpret": ("mosaic", True), "triton_interpret": ("triton", True)},
    "decode_impl": {"pallas": ("mosaic", False), "interpret": ("mosaic", True)},
    "moe_impl": {"ragged": ("xla", False), "megablox_interpret": ("megablox", True)},
}
FIELD_ALIASES = {"pallas_interpret": "interpret"}

# How a decode loop runs the layers each token: 'unrolled' (one copy of the step
# per layer over per-layer weights), 'scan' (a `lax.scan` over the stacked
# weights), or 'auto' (`DEFAULT_DECODE_LAYERS`).
DECODE_LAYERS = ("auto", "unrolled", "scan")
# Unrolled on every backend: XLA:CPU copies each stacked weight's slice inside a
# layer scan before it multiplies (docs/bench/design_notes.md), and for TPU v6e the
# unrolled step moves no more bytes than the scan (docs/bench/decode_tpu.md).
DEFAULT_DECODE_LAYERS = "unrolled"

# Every field with a fixed set of values, and the set.
CHOICES = {"compute_dtype": COMPUTE_DTYPES, "matmul_precision": MATMUL_PRECISIONS, "remat": REMAT,
           "ssd_form": SSD_FORMS, "decode_layers": DECODE_LAYERS, **IMPL_FIELDS}


def default_attention(backend: str, compute_dtype: str) -> str:
  """cuDNN's flash attention on GPUs when the matmuls run in bfloat16 (it takes no
  float32); Pallas splash attention on TPUs; the plain XLA form elsewhere."""
  if backend == "tpu":
    return "splash"
  return "cudnn" if backend in ("gpu", "cuda") and compute_dtype == "bfloat16" else "xla"
def default_form(backend: str) -> str:
  """The SSD form for a backend: 'scan' on CPU, where memory traffic dominates and
  each chunk's (t, s) terms stay in cache; 'parallel' on the matrix units of GPUs
  and TPUs (docs/bench/results.md, docs/bench/gpu.md)."""
  return "scan" if backend == "cpu" else "parallel"


def default_impl(backend: str) -> str:
  """The SSD implementation for a backend: the Pallas kernels of `ops/ssd_tpu.py` on TPUs
  and those of `ops/ssd_gpu.py` (Pallas Triton) on NVIDIA GPUs, where they keep each chunk's
  (t, s) terms out of HBM; the plain-JAX `ssd.ssd_chunked` on CPU (XLA:CPU keeps
  those terms in cache; Pallas runs there only in its interpreter)."""
  if backend == "tpu":
    return "mosaic"
  return "triton" if backend in ("gpu", "cuda") else "xla"


# The TPUs (`device_kind` prefixes) where XLA's counts of the 1.3b train step, the
# scanned two-layer program and the unrolled step both, say the fused layer moves fewer
# bytes than XLA's, and the step stays memory-bound with the kernels' recompute added
# (docs/bench/fused_layer.md, "Row-major blocks" for v6e, "TPU7x with the row-major
# kernel" for TPU7x). Not v5p, which is compute-bound there, so the recompute's FLOPs
# make it slower; not v5e or v4: not counted.
FUSED_LAYER_CHIPS = ("TPU v6 lite", "TPU v6e", "TPU7x")


def default_layer_impl(backend: str, device_kind: str = "") -> str:
  """The layer between in_proj and out_proj as one kernel ('fused') on the TPUs of
  FUSED_LAYER_CHIPS; as Pallas Triton kernels ('fused_triton', `layer_fused_gpu`) on
  NVIDIA GPUs, where the 1.3b step's counts for h100-8 and b200-8, scanned and unrolled
  alike, say they move fewer bytes than the separate layer kernels of `layer_gpu`
  (docs/bench/gpu.md, "The fused GPU layer"); the plain forms elsewhere, other TPUs (and
  a TPU of unknown kind) included: the Mosaic kernels of `layer_tpu` ('mosaic') move more
  bytes than XLA's fusions in the scanned 1.3b train step, whose remat recomputes them in
  the backward pass where XLA fuses the recompute into its consumers
  (docs/bench/tpu_ssd.md, "The layer's elementwise chain as Mosaic kernels")."""
  if backend == "tpu" and device_kind.startswith(FUSED_LAYER_CHIPS):
    return "fused"
  return "fused_triton" if backend in ("gpu", "cuda") else "xla"


def tokamax_imports() -> bool:
  """Whether tokamax (the `gpu` extra) imports here: installed, and for this jax."""
  try:
    import tokamax  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except Exception:  # noqa: BLE001 - missing, or built against another jax: ragged_dot instead
    return False
  return True


def default_decode_impl(backend: str) -> str:
  """The fused step on TPUs, where the plain step is about 50 launches a layer and
  batch-1 decoding is launch-bound, the fused one 3 (docs/bench/decode_tpu.md); the
  plain step elsewhere (the fused kernels are Mosaic's, TPU only)."""
  return "mosaic" if backend == "tpu" else "xla"


def default_remat(backend: str, layer_impl: str = "xla", unrolled: bool = False) -> str:
  """The remat that, of those that fit, moves the fewest bytes a chip in XLA's counts
  of the 1.3b and 2.7b train steps (docs/bench/tpu_ssd.md, docs/bench/gpu.md,
  docs/bench/fused_layer.md): REMAT_TPU on TPUs, 'save_in_proj_ssd' with the fused
  layer and the layers unrolled; 'save_matmuls' on NVIDIA GPUs; 'full' on CPUs, where
  nothing was counted and memory, not bytes, is what a large model runs out of first."""
  if backend == "tpu":
    # The fused layer's gated y kept (its backward kernel passes the states itself):
    # unrolled, the backward pass runs no forward kernel again; in a layer scan the
    # scan's stack of the kept y costs more than the rerun.
    return "save_in_proj_ssd" if layer_impl == "fused" and unrolled else REMAT_TPU
  return "save_matmuls" if backend in ("gpu", "cuda") else "full"


# Of the policies that fit the 1.3b and 2.7b train steps on TPU v6e-256, the fewest
# bytes a chip in the real (scanned) step's count, and the FLOPs v5p is bound by
# (docs/bench/tpu_ssd.md, "Remat that fits the fused layer" and "The every-layer count
# against a looped one"); 'save_in_proj_ssd' saves the SSD kernel's rerun (FLOPs) but
# its stacked y and states cost more bytes than that rerun there, and twice the memory.
REMAT_TPU = "save_in_proj"


def default_moe_impl(backend: str) -> str:
  """megablox on TPUs, where libtpu lowers ragged_dot on v6e to a product over
  every local expert (docs/bench/moe.md) and megablox's kernel stays grouped;
  tokamax's grouped matmul on NVIDIA GPUs when it imports, as XLA:GPU rewrites
  ragged_dot into a dense product over every local expert too (docs/bench/moe.md),
  else XLA's ragged_dot; XLA's on CPU."""
  if backend == "tpu":
    return "megablox"
  if backend in ("gpu", "cuda") and tokamax_imports():
    return "tokamax"
  return "xla"


@dataclasses.dataclass(frozen=True)
class Runtime(FrozenFields):
  # The matmuls' dtype; parameters, residual stream, norms, decay and loss stay float32.
  compute_dtype: str = "float32"
  # The matmuls' format below the compute dtype (MATMUL_PRECISIONS): qwix's quantized
  # dots, forward and backward, in training; weights quantized once in decoding.
  matmul_precision: str = "default"
  # What the backward pass recomputes (REMAT): nothing, everything, all but the
  # matmuls, all but the in_proj results (and the SSD kernels' output and states, or
  # the fused layer's output), or 'auto' (`default_remat` of the backend the runtime
  # is resolved for, its layer kernel and `unroll_layers`).
  remat: str = "none"
  # How the SSD combines chunks (`ssd.ssd_chunked`): 'parallel', 'scan', or 'auto'
  # (`default_form` of the backend the runtime is resolved for).
  ssd_form: str = "auto"
  # Caps on the chunk each form runs at (min with `Mamba2Config.chunk_size`). The
  # scan form's work per token grows with the chunk and it gains nothing from long
  # ones; the parallel form's (t, s) stacks grow with the chunk and its state
  # passing with the number of chunks, and 128 balances them. The figures behind
  # both caps are in docs/bench/results.md and docs/bench/gpu.md.
  scan_chunk_size: int = 64
  parallel_chunk_size: int = 128
  # How attention layers run (ATTENTION_FORMS); hybrids only.
  attention: str = "auto"
  # Run every Pallas kernel that runs in Pallas' interpreter: any backend, slow; for
  # tests on a CPU.
  interpret: bool = False
  # Who computes the SSD (SSD_IMPLS): 'xla' (`ssd.ssd_chunked`, in `ssd_form`),
  # 'mosaic' (the TPU kernels, at parallel_chunk_size), 'triton' (the GPU kernels, at
  # most parallel_chunk_size), or 'auto' (`default_impl`).
  ssd_impl: str = "auto"
  # Who computes the conv + SiLU and the gated RMSNorm (LAYER_IMPLS): 'xla', 'mosaic'
  # (TPU kernels), 'triton' (GPU kernels); or the layer between in_proj and out_proj as
  # one op, 'fused' (TPU) or 'fused_triton' (GPU), the conv and norm as 'xla' and
  # 'triton' where it does not run; 'auto' (`default_layer_impl`).
  layer_impl: str = "auto"
  # Run the layers as an unrolled loop instead of a `lax.scan`: compile time then
  # grows with depth. XLA's cost analysis counts a loop body once, so an unrolled
  # compile is how `scripts/aot_compile.py` counts every layer.
  unroll_layers: bool = False
  # How the decode loop of `generate` runs the layers (DECODE_LAYERS).
  decode_layers: str = "auto"
  # Who computes a Mamba-2 layer's decoding step between its matmuls (DECODE_IMPLS).
  decode_impl: str = "auto"
  # Mixture-of-experts layers: 0 is dropless dispatch; cf > 0 lets each expert take at
  # most ceil(cf * l * k / E) of a sequence's assignments, and drops the rest
  # (`moe.capacity`). Set by the run config's moe.capacity_factor.
  moe_capacity_factor: float = 0.0
  # Who runs the experts' grouped matmuls (MOE_IMPLS).
  moe_impl: str = "auto"

  def __post_init__(self):
    # Old spellings (ALIASES) become today's names: a value that asked for Pallas'
    # interpreter sets `interpret`.
    for field, old in ALIASES.items():
      if getattr(self, field) in old:
        name, interpret = old[getattr(self, field)]
        object.__setattr__(self, field, name)
        if interpret:
          object.__setattr__(self, "interpret", True)
    problems = [f"{field} must be one of {names}, got {getattr(self, field)!r}"
                for field, names in CHOICES.items() if getattr(self, field) not in names]
    if self.attention == "cudnn" and self.compute_dtype != "bfloat16":
      problems.append("attention='cudnn' needs compute_dtype='bfloat16' (cuDNN's flash "
                      "attention takes no float32); use 'dot_product' or 'xla' in float32")
    cf = self.moe_capacity_factor
    if not isinstance(cf, (int, float)) or isinstance(cf, bool) or cf < 0:
      problems.append(f"moe_capacity_factor must be 0 (dropless) or a number > 0, got {cf!r}")
    for name in ("unroll_layers", "interpret"):
      if not isinstance(getattr(self, name), bool):
        problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
    for name in ("scan_chunk_size", "parallel_chunk_size"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        problems.append(f"{name} must be a positive integer, got {v!r}")
    if problems:
      raise ValueError("Invalid Runtime: " + "; ".join(problems))

  @property
  def resolved(self) -> bool:
    return "auto" not in (self.ssd_form, self.ssd_impl, self.attention, self.decode_layers, self.layer_impl,
                          self.moe_impl, self.decode_impl, self.remat)

  def resolve(self, backend: str | None = None, device_kind: str | None = None) -> "Runtime":
    """This runtime with 'auto' replaced by `backend`'s choice (default: JAX's
    default backend, the machine this process runs on, and its devices' kind);
    `device_kind` (a device's, as JAX reports it) refines the choice per chip where
    the counts differ between chips (`default_layer_impl`)."""
    if self.resolved:
      return self
    if backend is None:
      import jax  # only here: choosing for the host is the one place that asks it
      backend = jax.default_backend()
      device_kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    layer_impl = default_layer_impl(backend, device_kind or "") if self.layer_impl == "auto" else self.layer_impl
    return self.replace(
        ssd_form=default_form(backend) if self.ssd_form == "auto" else self.ssd_form,
        ssd_impl=default_impl(backend) if self.ssd_impl == "auto" else self.ssd_impl,
        layer_impl=layer_impl,
        moe_impl=default_moe_impl(backend) if self.moe_impl == "auto" else self.moe_impl,
        decode_impl=default_decode_impl(backend) if self.decode_impl == "auto" else self.decode_impl,
        remat=default_remat(backend, layer_impl, self.unroll_layers) if self.remat == "auto" else self.remat,
        attention=(default_attention(backend, self.compute_dtype) if self.attention == "auto"
                   else self.attention),
        decode_layers=(DEFAULT_DECODE_LAYERS if self.decode_layers == "auto" else self.decode_layers))

  @classmethod
  def from_dict(cls, d: dict) -> "Runtime":
    """As `FrozenFields.from_dict`, reading old field names too (FIELD_ALIASES): a
    true old one turns its new one on."""
    d = dict(d)
    for old, new in FIELD_ALIASES.items():
      if old in d:
        d[new] = bool(d.pop(old)) or bool(d.get(new, False))
    return super().from_dict(d)

  def ssd_plan(self, chunk_size: int, window: int = 0) -> tuple[str, int]:
    """(how, chunk) the SSD runs with for a model whose chunk is `chunk_size`
    (`table.ssd_plan`: `ssd_form` when XLA runs it, else `ssd_impl`)."""
    return table.ssd_plan(self, chunk_size, window)
