"""Which implementation of each operation runs, decided in one place.

`TABLE` has a row for every (operation, implementation): the function, the
backends it compiles for, and what it supports. `build` turns a resolved runtime,
the model config and the active mesh into `Ops`, the small frozen object the model
calls (`ops.ssd(...)`, `ops.conv(...)`, `ops.norm(...)`, `ops.decode`,
`ops.expert_mlp(...)`, `ops.attend(...)`). Every fallback (a window, a split
sequence, a mesh in decoding, a length splash cannot block, groups split over
devices) is a rule here with its reason, recorded in `Ops.choices`; the model's
math never branches on an implementation name.

The runtime field that picks each operation's row (`Runtime` spells each name
once; old spellings are aliases there): ssd_impl -> ssd; layer_impl -> conv and
norm, or with 'fused' (TPU) or 'fused_triton' (GPU) the mixer (the layer between
in_proj and out_proj as one op, the conv and norm plain or the GPU's kernels where it
does not run); decode_impl -> decode; moe_impl -> experts; attention -> attention.
A Pallas kernel runs on any backend in Pallas' interpreter (`Runtime.interpret`: for
tests).

Kernel modules are imported when a row is chosen, not before: importing the model
loads none it does not run. Like the kernels, this module imports nothing else of
the package: the runtime, the config and the mesh come in as arguments (the mesh as
the `parallel` package's split objects, whose methods run a kernel per device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from typing import Any, Callable

ALL = ("cpu", "gpu", "tpu")

# What a row can take beyond one device's plain sequence (`Impl.supports`).
WINDOW = "window"  # a truncated horizon (Mamba2Config.ssd_window)
SEQUENCE = "sequence"  # the length split over devices (the 'sequence' mesh axis)
MESH = "mesh"  # batch and heads split over devices
DOCUMENTS = "documents"  # packed documents (seq_idx)
INITIAL_STATE = "initial_state"  # continuing from a state
ANY_LENGTH = "any_length"  # any sequence length (splash blocks multiples of 128 only)
FLOAT32 = "float32"  # float32 matmuls (cuDNN's flash attention takes none)
SPLIT_GROUPS = "split groups"  # a norm group's channels over several devices


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation of an operation: `module.function` of this package's ops."""
  module: str
  function: str
  backends: tuple[str, ...]
  pallas: bool  # a Pallas kernel: takes `interpret`, and then runs on any backend
  supports: frozenset[str]
  about: str

  def load(self) -> Callable:
    return getattr(importlib.import_module(f"mamba_train.ops.{self.module}"), self.function)


def _row(module, function, backends, pallas, supports, about):
  return Impl(module, function, tuple(backends), pallas, frozenset(supports), about)


_SSD = (WINDOW, SEQUENCE, MESH, DOCUMENTS, INITIAL_STATE, ANY_LENGTH, FLOAT32)
TABLE: dict[tuple[str, str], Impl] = {
    ("ssd", "xla"): _row("ssd", "ssd_chunked", ALL, False, _SSD,
                         "the chunked scan in einsums, scan or parallel form (`ssd_form`); the reference"),
    ("ssd", "mosaic"): _row("ssd_tpu", "ssd_fused", ["tpu"], True, set(_SSD) - {WINDOW},
                            "Pallas TPU kernels, one pass forward and backward"),
    ("ssd", "triton"): _row("ssd_gpu", "ssd_gpu", ["gpu"], True, set(_SSD) - {WINDOW},
                            "Pallas Triton kernels, forward and backward"),
    ("conv", "xla"): _row("layer_math", "causal_conv_silu", ALL, False, [SEQUENCE, MESH, DOCUMENTS, FLOAT32],
                          "the causal conv + SiLU in XLA; the reference"),
    ("conv", "mosaic"): _row("layer_tpu", "causal_conv_silu_tpu", ["tpu"], True, [MESH, DOCUMENTS, FLOAT32],
                             "a Pallas TPU kernel"),
    ("conv", "triton"): _row("layer_gpu", "causal_conv_silu_gpu", ["gpu"], True, [MESH, DOCUMENTS, FLOAT32],
                             "a Pallas Triton kernel"),
    ("norm", "xla"): _row("layer_math", "gated_rms_norm", ALL, False, [SEQUENCE, MESH, SPLIT_GROUPS, FLOAT32],
                          "the gated RMSNorm in XLA; the reference"),
    ("norm", "mosaic"): _row("layer_tpu", "gated_rms_norm_tpu", ["tpu"], True, [MESH, FLOAT32],
                             "a Pallas TPU kernel (whole groups on each device)"),
    ("norm", "triton"): _row("layer_gpu", "gated_rms_norm_gpu", ["gpu"], True, [MESH, FLOAT32],
                             "a Pallas Triton kernel (whole groups on each device)"),
    ("mixer", "fused"): _row("layer_fused_tpu", "mixer_core_tpu", ["tpu"], True,
                             [MESH, DOCUMENTS, INITIAL_STATE, ANY_LENGTH, FLOAT32],
                             "one Pallas TPU kernel from in_proj's outputs to the gated y and its norm "
                             "statistics (conv, SSD, gate), and one for its backward"),
    ("mixer", "fused_triton"): _row("layer_fused_gpu", "mixer_core_gpu", ["gpu"], True,
                                    [MESH, DOCUMENTS, INITIAL_STATE, ANY_LENGTH, FLOAT32],
                                    "Pallas Triton kernels: one from in_proj's outputs to the gated y and its norm "
                                    "statistics (x's conv, SSD, gate; the conv of B and C, and dt, in XLA), two for "
                                    "its backward"),
    ("ssd3", "xla"): _row("ssd3", "ssd3_chunked", ALL, False,
                          [SEQUENCE, MESH, DOCUMENTS, INITIAL_STATE, ANY_LENGTH, FLOAT32],
                          "Mamba-3's chunked exponential-trapezoidal scan in einsums; the reference"),
    ("ssd3", "mosaic"): _row("ssd3_tpu", "ssd3_fused", ["tpu"], True,
                             [MESH, DOCUMENTS, INITIAL_STATE, ANY_LENGTH, FLOAT32],
                             "ssd_tpu's one-pass Pallas TPU kernels, forward and backward, with the trapezoid's "
                             "input weights; the look-ahead and diagonal correction in XLA"),
    ("decode", "xla"): _row("ssd", "ssd_step", ALL, False, [WINDOW, MESH, FLOAT32],
                            "the plain step, about 50 XLA ops a layer"),
    ("decode", "mosaic"): _row("decode_tpu", "mixer_step_fused", ["tpu"], True, [FLOAT32],
                               "three Pallas TPU kernels a layer: pre-norm + in_proj, the step, out_proj + residual"),
    ("decode3", "xla"): _row("ssd3", "ssd3_step", ALL, False, [MESH, FLOAT32],
                             "Mamba-3's one-step recurrence, plain XLA ops"),
    ("experts", "xla"): _row("experts", "expert_mlp_xla", ALL, False, [MESH, FLOAT32],
                             "jax.lax.ragged_dot, XLA's grouped matmul"),
    ("experts", "megablox"): _row("experts_tpu", "expert_mlp_megablox", ["tpu"], True, [MESH, FLOAT32],
                                  "JAX's Pallas TPU grouped matmul"),
    ("experts", "tokamax"): _row("experts_gpu", "expert_mlp_tokamax", ["gpu"], False, [MESH, FLOAT32],
                                 "tokamax's ragged dot, Pallas Triton (the `gpu` extra)"),
    ("attention", "xla"): _row("attention", "attend", ALL, False,
                               [SEQUENCE, MESH, DOCUMENTS, ANY_LENGTH, FLOAT32],
                               "einsums and a float32 softmax; the reference"),
    ("attention", "dot_product"): _row("attention", "attend", ALL, False,
                                       [SEQUENCE, MESH, DOCUMENTS, ANY_LENGTH, FLOAT32],
                                       "jax.nn.dot_product_attention, XLA's implementation"),
    ("attention", "cudnn"): _row("attention", "attend", ["gpu"], False, [SEQUENCE, MESH, DOCUMENTS, ANY_LENGTH],
                                 "jax.nn.dot_product_attention, cuDNN's flash attention (bfloat16)"),
    ("attention", "tokamax"): _row("attention_gpu", "flash", ["gpu"], False, [MESH, DOCUMENTS],
                                   "tokamax's flash attention, Pallas Triton (the `gpu` extra; bfloat16)"),
    ("attention", "splash"): _row("attention_tpu", "splash", ["tpu"], True, [MESH, DOCUMENTS],
                                  "JAX's Pallas splash attention kernel (lengths a multiple of 128)"),
}

# The layer_impl names that run the layer between the matmuls as one op (the 'mixer'
# rows), and the conv's and norm's rows where it does not run.
FUSED = {"fused": "xla", "fused_triton": "triton"}

# The runtime field that chooses each operation's row.
FIELDS = {"ssd": "ssd_impl", "ssd3": "ssd_impl", "decode3": "decode_impl", "conv": "layer_impl", "norm": "layer_impl",
          "mixer": "layer_impl", "decode": "decode_impl",
          "experts": "moe_impl", "attention": "attention"}


def names(field: str) -> tuple[str, ...]:
  """The implementation names a runtime field takes (without 'auto')."""
  ops = [op for op, f in FIELDS.items() if f == field]
  return tuple(dict.fromkeys(impl for (op, impl) in TABLE if op in ops))


def markdown() -> str:
  """The table as docs/configuration.md shows it (generated from this; a test holds the two equal)."""
  rows = ["| operation (runtime field) | implementation | backends | supports | what it is |",
          "|---|---|---|---|---|"]
  for (op, impl), row in TABLE.items():
    backends = ", ".join(row.backends) + (" (any, interpreted)" if row.pallas else "")
    rows.append(f"| {op} (`{FIELDS[op]}`) | `{impl}` | {backends} | {', '.join(sorted(row.supports)) or '-'} "
                f"| {row.about} |")
  return "\n".join(rows)


def ssd_plan(runtime, chunk_size: int, window: int = 0) -> tuple[str, int]:
  """(how, chunk) the SSD runs with for a model whose chunk is `chunk_size`: how is
  the runtime's `ssd_form` when XLA runs it, else its `ssd_impl` (a kernel, at most
  parallel_chunk_size). A windowed model runs XLA's 'parallel' form whatever
  `ssd_impl` says: the kernels take no window."""
  if "auto" in (runtime.ssd_form, runtime.ssd_impl):
    raise ValueError("ssd_form / ssd_impl 'auto' is not resolved: call Runtime.resolve(backend) first")
  if window and WINDOW not in TABLE["ssd", runtime.ssd_impl].supports:
    return "parallel", min(chunk_size, runtime.parallel_chunk_size)
  if runtime.ssd_impl != "xla":
    return runtime.ssd_impl, min(chunk_size, runtime.parallel_chunk_size)
  cap = runtime.scan_chunk_size if runtime.ssd_form == "scan" else runtime.parallel_chunk_size
  return runtime.ssd_form, min(chunk_size, cap)


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
  """A Mamba-2 layer's fused decoding step (`ops/decode_tpu.py`), partial'd with the
  runtime's options: the pre-norm + in_proj, the step between the matmuls, out_proj +
  residual, and the packing of the small parameters made once before the loop."""
  norm_in_proj: Callable
  step: Callable
  out_proj_residual: Callable
  pack_small: Callable


@dataclasses.dataclass(frozen=True)
class Ops:
  """The implementations a model runs with (`build`); what the model calls."""
  ssd: Callable  # ssd_chunked's arguments and results
  ssd_chunk: int
  ssd3: Callable | None  # ssd3_chunked's (None: the model has no Mamba-3 layer)
  ssd3_chunk: int
  ssd3_step: Callable  # ssd3_step's
  ssd_chunk_major: bool  # the kernel reads x, and writes y, chunk-major with positions minor (whole chunks)
  ssd_y_positions_minor: bool  # the kernel writes y positions-minor (the gate reads it channels-minor)
  ssd_save_names: tuple[str, ...]  # what `save_in_proj_ssd` keeps of the SSD kernel and of the fused layer
  ssd_saved_with_matmuls: tuple[str, ...]  # what `save_matmuls` keeps of it and of the GPU layer kernels
  conv: Callable  # causal_conv_silu's
  norm: Callable  # gated_rms_norm's
  # layer_math.mixer_core's (the layer between in_proj and out_proj for an
  # unpadded sequence), or None: conv, SSD and norm run one by one
  mixer: Callable | None
  split_in_proj: bool  # z, x and B|C as three GEMM outputs (the Mosaic conv kernel reads x whole)
  # The norm takes in_proj's joined z|x|B|C output as its gate, its first d_inner
  # channels (the GPU norm kernel reads them in place: no slice copied for it).
  norm_gate_joined: bool
  decode: DecodeKernels | None  # None: the plain step
  expert_mlp: Callable  # experts.expert_mlp_xla's
  expert_mlp_checks_vma: bool  # shard_map's varying-axes check holds for it (XLA's op only)
  attend: Callable  # (q, k, v, seq_idx, key_mask, cd, scale) -> (b, l, h, e) float32
  choices: tuple[tuple[str, str, str], ...]  # (operation, implementation, why)

  def chose(self, op: str) -> str:
    """The implementation that runs `op`."""
    return next(impl for o, impl, _ in self.choices if o == op)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """What the active mesh asks of the kernels (None and False: one device). heads:
  a `parallel.heads.HeadSplit` (a Pallas call per device's batch and heads);
  sequence: a `parallel.sequence.SequenceSplit` (the length split over devices);
  kv_heads: `parallel.sharding.kv_head_map()`; active: any mesh at all."""
  heads: Any = None
  sequence: Any = None
  kv_heads: Callable | None = None
  active: bool = False


def _impl(op: str, runtime) -> str:
  impl = getattr(runtime, FIELDS[op])
  # The fused mixer holds them; where it does not run, the plain forms (TPU) or the
  # GPU's own kernels.
  if impl in FUSED and op in ("conv", "norm"):
    return FUSED[impl]
  if impl == "auto":
    raise ValueError(f"runtime.{FIELDS[op]} 'auto' is not resolved: call Runtime.resolve(backend) first")
  if (op, impl) not in TABLE:
    raise ValueError(f"runtime.{FIELDS[op]}={impl!r}: not one of {names(FIELDS[op])}")
  return impl


def _module(op: str, impl: str):
  return importlib.import_module(f"mamba_train.ops.{TABLE[op, impl].module}")


def _kernel(op: str, impl: str, runtime) -> Callable:
  fn = TABLE[op, impl].load()
  return functools.partial(fn, interpret=runtime.interpret) if TABLE[op, impl].pallas else fn


def build(runtime, cfg, mesh: Mesh = Mesh()) -> Ops:
  """The implementations of `cfg`'s operations as `runtime` (resolved) asks, under
  `mesh`, with each fallback's reason in `choices`."""
  choices = []

  def choose(op: str, needs: dict[str, bool]) -> str:
    """The runtime's row for op, or the plain one ('xla') where it lacks something needed."""
    impl = _impl(op, runtime)
    lacks = [why for what, why in needs.items() if why and what not in TABLE[op, impl].supports]
    if lacks and impl != "xla":
      choices.append((op, "xla", f"{impl} takes no {lacks[0]}"))
      return "xla"
    choices.append((op, impl, "runtime"))
    return impl

  seq = mesh.sequence
  # --- the SSD ---
  form, chunk = ssd_plan(runtime, cfg.chunk_size, cfg.ssd_window)
  impl = choose("ssd", {WINDOW: bool(cfg.ssd_window) and "window (ssd_window)"})
  if impl == "xla":
    ssd = functools.partial(TABLE["ssd", "xla"].load(), form=form)
    if seq is not None:
      ssd = functools.partial(seq.ssd, ssd, _state_outputs())
  else:
    # XLA cannot partition a Pallas call: under a mesh it runs per device's batch and
    # heads; a split sequence runs it per slice from a zero state and adds what the
    # entering state gives in XLA (parallel/sequence.py).
    ssd = _kernel("ssd", impl, runtime)
    ssd = ssd if mesh.heads is None else functools.partial(mesh.heads.ssd, ssd)
    if seq is not None:
      ssd = functools.partial(seq.ssd, ssd, _state_outputs(), kernel=True)
  save_names = () if impl == "xla" else _module("ssd", impl).SAVE_NAMES
  # `save_matmuls` keeps the GPU kernels' outputs only with the layers unrolled (`gpu_saved` below).
  gpu_unrolled = impl == "triton" and runtime.unroll_layers

  # --- Mamba-3's scan (a kernel name without a Mamba-3 row falls back to the plain form) ---
  ssd3, step3, chunk3 = None, TABLE["decode3", "xla"].load(), min(cfg.chunk_size, runtime.parallel_chunk_size)
  if cfg.count("3"):
    ask = runtime.ssd_impl
    if ("ssd3", ask) not in TABLE:
      impl3 = "xla"
      choices.append(("ssd3", "xla", f"{ask} has no Mamba-3 form"))
    else:
      # A split sequence runs the plain form per slice: its map checks varying axes,
      # which a Pallas call does not declare (Mamba-2's kernel path has its own).
      impl3 = choose("ssd3", {SEQUENCE: seq is not None and "split sequence (the 'sequence' mesh axis)"})
    if impl3 == "xla":
      ssd3 = TABLE["ssd3", "xla"].load()
      if ask == "xla" and runtime.ssd_form == "scan":
        chunk3 = min(cfg.chunk_size, runtime.scan_chunk_size)
      if seq is not None:  # per slice, the carries exchanged (parallel/sequence.py)
        ssd3 = functools.partial(seq.ssd3, ssd3, importlib.import_module("mamba_train.ops.ssd3").state_outputs3)
    else:
      ssd3 = _kernel("ssd3", impl3, runtime)
      if mesh.heads is not None:
        ssd3 = functools.partial(mesh.heads.ssd3, ssd3)
    dec3 = runtime.decode_impl
    choices.append(("decode3", "xla", "runtime" if dec3 == "xla" else f"{dec3} has no Mamba-3 step"))

  # --- the conv + SiLU and the gated norm ---
  # A split sequence keeps the plain forms: its conv exchanges a halo inside its own map.
  layer = choose("conv", {SEQUENCE: seq is not None and "split sequence (the 'sequence' mesh axis)"})
  conv = _kernel("conv", layer, runtime)
  if seq is not None:
    conv = functools.partial(seq.conv, conv)
  elif layer != "xla" and mesh.heads is not None:
    conv = functools.partial(mesh.heads.conv, conv)
  # A group split over devices needs its sum of squares from all of them: the plain
  # form, whose reduction XLA partitions, unless whole groups are local.
  split_groups = layer != "xla" and mesh.heads is not None and cfg.ngroups % mesh.heads.head_devices != 0
  norm_impl = choose("norm", {SEQUENCE: seq is not None and "split sequence (the 'sequence' mesh axis)",
                              SPLIT_GROUPS: split_groups and "group split over devices (ngroups % heads' devices)"})
  norm = _kernel("norm", norm_impl, runtime)
  if norm_impl != "xla" and mesh.heads is not None:
    norm = functools.partial(mesh.heads.norm, norm)

  # --- the layer between the matmuls as one op ---
  mixer = None
  if runtime.layer_impl in FUSED:
    split_groups = mesh.heads is not None and mesh.heads.head_devices > 1 and cfg.ngroups % mesh.heads.head_devices
    m = choose("mixer", {SEQUENCE: seq is not None and "split sequence (the 'sequence' mesh axis)",
                         WINDOW: bool(cfg.ssd_window) and "window (ssd_window)",
                         SPLIT_GROUPS: bool(split_groups) and "group split over devices (ngroups % heads' devices)"})
    if m != "xla":
      mixer = _kernel("mixer", m, runtime)
      save_names = (*save_names, *_module("mixer", m).SAVE_NAMES)
      if m == "fused_triton":  # whether the remat keeps its states (`layer_fused_gpu`'s two VJPs)
        kept = runtime.remat in ("none", "save_in_proj_ssd") or (runtime.remat == "save_matmuls" and gpu_unrolled)
        mixer = functools.partial(mixer, keep_states=kept)
      if mesh.heads is not None:
        mixer = functools.partial(mesh.heads.mixer, mixer)

  # --- decoding ---
  # The fused step holds the (h, p, n) state, not a window's inputs; XLA cannot
  # partition its Pallas calls, and the plain step's sharding is the rules table's.
  dec = choose("decode", {WINDOW: bool(cfg.ssd_window) and "window (ssd_window)",
                          MESH: mesh.active and "mesh (decoding under a mesh)"})
  decode = None
  if dec != "xla":
    mod = _module("decode", dec)
    # Weights and states held in HBM for the kernels' own DMAs, except in a layer
    # scan, where they are XLA's slices of the stacked ones (`decode_tpu.in_hbm`).
    kw = dict(interpret=runtime.interpret, hbm=runtime.decode_layers != "scan", compute_dtype=runtime.compute_dtype)
    decode = DecodeKernels(functools.partial(mod.norm_in_proj, **kw), functools.partial(mod.mixer_step_fused, **kw),
                           functools.partial(mod.out_proj_residual, **kw), mod.pack_small)

  # --- the experts' grouped matmuls ---
  experts = choose("experts", {}) if cfg.count("E") else "xla"
  expert_mlp = _kernel("experts", experts, runtime)

  # --- attention ---
  attention = "xla"
  if cfg.count("*"):
    attention = choose("attention", {SEQUENCE: seq is not None and "split sequence (the 'sequence' mesh axis)"})
  attend = _attend(attention, runtime, mesh)

  # The Mosaic conv kernel takes x as an operand of its own (`mamba2._project_in`);
  # the fused layer reads z|x joined (`mamba2._project_in_fused`).
  split_in_proj = _impl("conv", runtime) == "mosaic"
  # What `save_matmuls` keeps of the GPU kernels beside the matmuls' results, as the 1.3b
  # step's counts for h100-8 and b200-8 chose per program (docs/bench/gpu.md):
  # with the layers unrolled, the SSD kernel's output and entering states and the layer
  # kernels' outputs (the conv's activation, the norm's output), so the backward pass
  # runs no forward kernel again; in a layer scan nothing, since the scan copies each
  # saved value into its stack and out again (the SSD's float32 entering states alone
  # 1.1e9 bytes a layer), more than rerunning the forward kernels moves.
  gpu_saved = ()
  if gpu_unrolled:
    gpu_saved = tuple(save_names)
    if layer == "triton" and norm_impl == "triton":
      gpu_saved += _module("conv", "triton").SAVE_NAMES
  # The GPU norm reads its gate in place from in_proj's joined output where the heads
  # are on one device: no slice of it copied, in the forward pass and again in the backward's.
  norm_joined = norm_impl == "triton" and (mesh.heads is None or mesh.heads.head_devices == 1)
  return Ops(ssd=ssd, ssd_chunk=chunk, ssd3=ssd3, ssd3_chunk=chunk3, ssd3_step=step3,
             ssd_chunk_major=impl == "mosaic" and seq is None,
             ssd_y_positions_minor=impl == "mosaic", ssd_save_names=tuple(save_names),
             # The TPU step's counts were taken without (docs/bench/tpu_ssd.md).
             ssd_saved_with_matmuls=gpu_saved,
             conv=conv, norm=norm, split_in_proj=split_in_proj, mixer=mixer,
             norm_gate_joined=norm_joined and not split_in_proj and mixer is None,
             decode=decode, expert_mlp=expert_mlp, expert_mlp_checks_vma=experts == "xla",
             attend=attend, choices=tuple(choices))


def _state_outputs():
  return importlib.import_module("mamba_train.ops.ssd").state_outputs


def _attend(impl: str, runtime, mesh: Mesh) -> Callable:
  """(q, k, v, seq_idx, key_mask, cd, scale) -> attention's output, by `impl`. Splash
  blocks the length in multiples of 128: another length takes the plain form."""
  plain_mod = importlib.import_module("mamba_train.ops.attention")

  def plain(q, k, v, seq_idx, key_mask, cd, scale, form="xla" if impl == "splash" else impl):
    l = q.shape[1]
    ok = None if seq_idx is None and key_mask is None else plain_mod.allowed(l, l, seq_idx=seq_idx,
                                                                              key_mask=key_mask)
    return plain_mod.attend(q, k, v, ok, form, cd, scale)

  if impl == "tokamax":
    return functools.partial(_kernel("attention", "tokamax", runtime), shard=mesh.kv_heads)
  if impl != "splash":
    return plain
  splash = functools.partial(_kernel("attention", "splash", runtime), shard=mesh.kv_heads)

  def attend(q, k, v, seq_idx, key_mask, cd, scale):
    if not plain_mod.splash_fits(q.shape[1]):
      return plain(q, k, v, seq_idx, key_mask, cd, scale)
    return splash(q, k, v, seq_idx, key_mask, cd, scale)

  return attend


def cross_compile(runtime):
  """The context an ahead-of-time compile for GPUs lowers in: tokamax (the GPU experts,
  attention='tokamax') refuses to lower for a default device that is no GPU unless told
  it cross-compiles."""
  if runtime.moe_impl == "tokamax" or runtime.attention == "tokamax":
    return importlib.import_module("mamba_train.ops.experts_gpu").import_tokamax().config.cross_compile(True)
  return contextlib.nullcontext()
