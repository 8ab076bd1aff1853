"""Logical axis names, the one table that maps them to mesh axes, and the
shardings built from it.

Every parameter carries `logical_axes` metadata (see model/params.py); activations
are constrained at block boundaries with `constrain`. The trainer activates a mesh
and rules with `use_rules`; outside that context `constrain` does nothing, so the
model runs unsharded on one device with no setup. Parameter, batch and cache
shardings come from the same table; the train state's are composed from them in
train/state.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mamba_train.parallel.embedding import EmbeddingSplit
from mamba_train.parallel.experts import ExpertSplit
from mamba_train.parallel.heads import HeadSplit
from mamba_train.parallel.sequence import SequenceSplit

# The sequence axis sits next to tensor: after it, the fastest links. Its traffic
# is small (a state summary and a conv halo per layer), but on the critical path.
# The expert axis (mixture-of-experts layers' experts; parallel/experts.py) splits
# the batch too, like a data axis, and exchanges tokens by all-to-all twice per
# MoE layer: it sits inside fsdp, on faster links than data.
MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")

# Logical name -> mesh axis (or axes, or None = replicated).
# Parameters: 'embed' is the model dimension FSDP shards; 'inner'/'heads'/'vocab'
# are split by tensor parallelism (whole heads, since d_inner = heads * headdim
# is laid out head-major). Activations use the act_* names so that the model
# dimension of activations stays whole while the batch is split. 'act_length'
# splits one sequence over the 'sequence' axis (parallel/sequence.py); the mixer
# then runs its convolution and SSD under shard_map (`sequence_split`).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("act_length", "sequence"),
    ("act_embed", None),
    ("act_inner", "tensor"),
    ("act_vocab", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("layers", None),
    ("embed", "fsdp"),
    ("inner", "tensor"),
    # out_proj (i, d)'s rows: whole heads over tensor, as 'inner', and each tensor
    # shard's rows over fsdp, not its d columns as 'embed' would: a chip holds whole
    # rows, gathered on the axis the weight's layout keeps major (d minor, as the GEMMs
    # read it). XLA:TPU turns a gather of pieces of 64 KiB or less into an all-reduce
    # whichever axis is split (1.3b at fsdp 256); above that this split is what makes it
    # an all-gather (docs/bench/fused_layer.md, "out_proj split on its rows").
    ("inner_fsdp", ("tensor", "fsdp")),
    ("heads", "tensor"),
    ("state", None),
    ("conv", None),
    ("vocab", "tensor"),
    # Hybrids: attention splits whole query and key/value heads, the MLP its
    # hidden units (Megatron's column-then-row split: one reduction per layer).
    ("attn_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    # Mixture of experts (model/moe.py): an expert's width over fsdp like 'embed',
    # its hidden units over tensor like 'mlp'.
    ("experts", "expert"),
    ("expert_embed", "fsdp"),
    ("expert_mlp", "tensor"),
)

# Named layouts (config.layout): which mesh axes the weights that are not experts
# are split over. The experts are split over 'expert' (and their width over fsdp)
# in both, and every optimizer moment and gradient lies as its parameter does.
#   fsdp         the non-expert weights over fsdp only: replicated along 'expert'.
#   fsdp_expert  over fsdp x expert (ZeRO-3 inside the expert group, as
#                Megatron-Core's distributed optimizer shards over the data-parallel
#                ranks the expert-parallel ones are carved from): one 8-GPU host at
#                expert 8 holds an eighth of them, their gradients and moments, and
#                gathers each layer's weights for its step. The expert axis splits the
#                batch, so this is plain FSDP over the devices along it.
# Only 'embed' (and out_proj's 'inner_fsdp') moves: every non-expert matrix, norm and
# the embedding carry one of them (the model dimension, or out_proj's rows); the few
# small vectors without them (A, D, dt bias, conv) stay whole.
_ZERO3 = {"embed": ("fsdp", "expert"), "inner_fsdp": ("tensor", "fsdp", "expert")}
EXPERT_ZERO3_RULES = tuple((k, _ZERO3.get(k, v)) for k, v in DEFAULT_RULES)
LAYOUTS: dict[str, tuple] = {"fsdp": DEFAULT_RULES, "fsdp_expert": EXPERT_ZERO3_RULES}


def resolve_layout(name: str, mesh_shape: Mapping[str, int], d_model: int, moe: bool) -> str:
  """config.layout -> a name of LAYOUTS. 'auto': fsdp_expert where the non-expert
  weights would otherwise be whole on every device of an expert group (a model with
  MoE layers, mesh expert > 1, fsdp 1: one 8-GPU host) and they divide d_model, else
  fsdp (the Nano recipe on v5p-64, fsdp 4: fsdp_expert saves 5.6 GiB a chip that is
  not needed, and XLA:TPU turns its 32-way gathers into windowed einsums counted at
  1.8x the bytes; docs/bench/moe.md). Raises ValueError for an unknown name, or fsdp_expert on axes that do not
  divide d_model (the weights would stay whole where they were meant to be split)."""
  axes = _axis_names(dict(EXPERT_ZERO3_RULES)["embed"])
  n = math.prod(mesh_shape.get(a, 1) for a in axes)
  if name == "auto":
    group = moe and mesh_shape.get("expert", 1) > 1 and mesh_shape.get("fsdp", 1) == 1
    name = "fsdp_expert" if group and d_model % n == 0 else "fsdp"
  if name not in LAYOUTS:
    raise ValueError(f"layout must be 'auto' or one of {sorted(LAYOUTS)}, got {name!r}")
  # (fsdp alone keeps its old rule: a d_model fsdp does not divide stays whole, warned.)
  if name == "fsdp_expert" and d_model % n:
    raise ValueError(f"layout={name!r} splits the non-expert weights' d_model ({d_model}) over "
                     f"{' x '.join(axes)} = {n} devices, which does not divide it; choose mesh sizes "
                     f"whose product divides {d_model}, or layout='fsdp'")
  return name


_ACTIVE: list[tuple[Mesh, dict]] = []


def logical_to_spec(axes: Sequence[str | None], rules=DEFAULT_RULES) -> PartitionSpec:
  table = dict(rules)
  out = []
  for a in axes:
    if a is not None and a not in table:
      raise KeyError(f"logical axis {a!r} has no rule; known: {sorted(table)}")
    out.append(None if a is None else table[a])
  return PartitionSpec(*out)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules=DEFAULT_RULES):
  """Within this context `constrain` pins activations to `mesh` by `rules`."""
  _ACTIVE.append((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.pop()


def constrain(x, axes: Sequence[str | None]):
  if not _ACTIVE:
    return x
  mesh, rules = _ACTIVE[-1]
  # fit_spec: a dimension the mesh axes do not divide (say 2 kv heads over
  # tensor=4) stays whole, as for parameters.
  spec = fit_spec(logical_to_spec(axes, rules), x.shape, mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def active() -> tuple[Mesh, tuple] | None:
  """The (mesh, rules) that `use_rules` made current, or None outside it."""
  return _ACTIVE[-1] if _ACTIVE else None


def sequence_split() -> SequenceSplit | None:
  """How the active rules split the length of activations: a `SequenceSplit`
  (the mixer's shard_map'd convolution and SSD) when 'act_length' maps to one
  mesh axis of size > 1, else None (the mixer runs as on one device)."""
  if not _ACTIVE:
    return None
  mesh, rules = _ACTIVE[-1]
  axis = dict(rules).get("act_length")
  if isinstance(axis, tuple):
    if len(axis) != 1:
      raise ValueError(f"'act_length' must map to one mesh axis, got {axis}")
    axis = axis[0]
  if axis is None or mesh.shape[axis] == 1:
    return None
  return SequenceSplit(mesh, axis)


def expert_split() -> ExpertSplit | None:
  """How a mixture-of-experts layer runs under the active rules: an `ExpertSplit`
  (each device dispatches its own tokens; experts over the mesh axis 'experts'
  maps to, their hidden units over 'expert_mlp''s), or None outside `use_rules`
  (the layer runs as on one device)."""
  if not _ACTIVE:
    return None
  mesh, rules = _ACTIVE[-1]
  batch, length, expert, hidden = logical_to_spec(("batch", "act_length", "experts", "expert_mlp"), rules)
  if isinstance(expert, tuple):
    if len(expert) > 1:
      raise ValueError(f"'experts' must map to one mesh axis, got {expert}")
    expert = expert[0] if expert else None
  return ExpertSplit(mesh, batch, length, expert if axes_size(mesh, expert) > 1 else None,
                     hidden if axes_size(mesh, hidden) > 1 else None)


def embedding_split(table_shape: tuple[int, ...], ids_shape: tuple[int, ...]) -> EmbeddingSplit | None:
  """How the active rules look a table of `table_shape` (logical axes vocab, embed) up
  at token ids of `ids_shape` (batch, act_length; or batch alone): an `EmbeddingSplit`
  (parallel/embedding.py) where the table's columns are split and the tokens are not
  split over exactly the same devices; else None, and XLA's own lookup runs: outside
  `use_rules`, a table whole on each device, or tokens split over just the columns' axes
  (plain FSDP), which XLA partitions by the same exchange itself (fewer transposes:
  docs/bench/fused_layer.md, "The embedding's lookup by columns"). Where the tokens are
  split over more axes (data x fsdp), or fewer (a batch the devices do not divide), XLA
  gathers the whole table on every device instead."""
  if not _ACTIVE:
    return None
  mesh, rules = _ACTIVE[-1]
  vocab, columns = fit_spec(logical_to_spec(("vocab", "embed"), rules), table_shape, mesh)
  tokens = tuple(fit_spec(logical_to_spec(("batch", "act_length")[:len(ids_shape)], rules), ids_shape, mesh))
  splitting = lambda axes: {a for a in axes if mesh.shape[a] > 1}  # the axes that split
  token_axes = splitting(a for t in tokens for a in _axis_names(t))
  column_axes = splitting(_axis_names(columns))
  # The rows' parts are summed over the vocabulary's axes: they must hold the same tokens.
  if not column_axes or token_axes == column_axes or token_axes & splitting(_axis_names(vocab)):
    return None
  return EmbeddingSplit(mesh, vocab if axes_size(mesh, vocab) > 1 else None, columns, tokens)


def kv_head_map():
  """How a Pallas attention kernel (splash) runs under the active rules: a function
  (run, q, k, v, seg) -> run(q, k, v, seg) on each device's batch (data, fsdp) and
  key/value heads (tensor) in shard_map, as XLA cannot partition a Pallas call; None
  outside `use_rules`. q: (b, kv, r, l, e); k, v: (b, kv, l, e); seg: (b, l)."""
  if not _ACTIVE:
    return None
  mesh, rules = _ACTIVE[-1]

  def per_shard(run, q, k, v, seg):
    spec = lambda axes, x: fit_spec(logical_to_spec(axes, rules), x.shape, mesh)
    specs = (spec(("batch", "act_kv_heads", None, None, None), q), spec(("batch", "act_kv_heads", None, None), k),
             spec(("batch", "act_kv_heads", None, None), v), spec(("batch", None), seg))
    return jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(q, k, v, seg)

  return per_shard


def head_split() -> HeadSplit | None:
  """How the active rules split a Pallas kernel's batch and heads ('batch' and
  'act_inner'; parallel/heads.py): a `HeadSplit`, or None outside `use_rules`
  (the kernel runs as on one device)."""
  if not _ACTIVE:
    return None
  mesh, rules = _ACTIVE[-1]
  # The length is not among its axes: a split sequence is shard_map'd over its own
  # axis first (sequence_split), and the kernel's map runs inside it per slice.
  batch, heads = logical_to_spec(("batch", "act_inner"), rules)
  return HeadSplit(mesh, batch, heads, axes_size(mesh, heads))


def _axis_names(axes) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def axes_size(mesh: Mesh, axes) -> int:
  """Devices along `axes` of `mesh`, a PartitionSpec entry: None (1), one axis name,
  or a tuple of them (their product)."""
  return math.prod(mesh.shape[a] for a in _axis_names(axes))


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
  """Drop mesh axes from dimensions they do not divide (those stay replicated)."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    size = axes_size(mesh, axes)
    if size > 1 and dim % size:
      logging.warning("dimension %d does not divide over mesh axes %s (%d); replicating it",
                      dim, _axis_names(axes), size)
      axes = None
    out.append(axes)
  return PartitionSpec(*out)


def tree_shardings(shapes: Any, logical_axes: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
  """NamedShardings for a tree of arrays (or ShapeDtypeStructs) from a tree of their
  logical axes (tuples), by `rules`; axes a dimension does not divide are dropped."""
  return jax.tree.map(
      lambda s, a: NamedSharding(mesh, fit_spec(logical_to_spec(a, rules), s.shape, mesh)),
      shapes, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
  """(b, l) batches: split like the activations' batch and length axes (positions
  whole unless the sequence axis splits them)."""
  return NamedSharding(mesh, logical_to_spec(("batch", "act_length"), rules))


def data_group(mesh: Mesh, rules=DEFAULT_RULES) -> tuple[int, int]:
  """(index, count) of this process's data group: the processes whose devices hold
  the same rows of a batch (those the sequence or tensor axis spans), in row order.
  The loaders hand each group its rows, read alike by every process of the group,
  and `to_global` keeps each process's positions of them; so a sequence split over
  hosts (dcn_sequence) trains with batch 1. A layout where processes hold rows in no
  such blocks gives (process index, process count): each loads its own rows, and
  `to_global` moves them on the devices."""
  groups = _row_groups(batch_sharding(mesh, rules), mesh)
  if groups is None:
    return jax.process_index(), jax.process_count()
  return next(i for i, (_, procs) in enumerate(groups) if jax.process_index() in procs), len(groups)


@functools.lru_cache(maxsize=16)  # asked at every step; a pod's mesh has thousands of devices
def _row_groups(sh: NamedSharding, mesh: Mesh):
  """[((first row, end row), processes)] in row order over a batch of one row per
  row shard, when each process's devices hold one block of rows that is either the
  same as another process's or disjoint from it, the blocks equal in size; else None."""
  spec = tuple(sh.spec) + (None, None)
  rows, cols = (math.prod(mesh.shape[a] for a in _axis_names(axes)) for axes in spec[:2])
  held: dict[int, tuple[set, set]] = {}
  for d, (r, c) in sh.devices_indices_map((rows, cols)).items():
    mine = held.setdefault(d.process_index, (set(), set()))
    mine[0].add(r.indices(rows)[:2])
    mine[1].add(c.indices(cols)[:2])
  blocks = {}
  for p, (row_pieces, col_pieces) in held.items():
    if _block(col_pieces) is None:  # positions in pieces: `to_global` keeps one block
      return None
    span = _block(row_pieces)
    if span is None:
      return None
    blocks.setdefault(span, []).append(p)
  spans = sorted(blocks)
  if len({e - a for a, e in spans}) != 1 or any(a < prev for (a, _), (_, prev) in zip(spans[1:], spans)):
    return None
  return [(span, tuple(sorted(blocks[span]))) for span in spans]


def _block(pieces: set) -> tuple[int, int] | None:
  """(first, end) of distinct pieces (first, end) that tile one block; None if they leave holes."""
  first, end = min(a for a, _ in pieces), max(e for _, e in pieces)
  return (first, end) if sum(e - a for a, e in pieces) == end - first else None


def to_global(batch: Mapping[str, np.ndarray], mesh: Mesh, rules=DEFAULT_RULES) -> dict[str, jax.Array]:
  """This process's rows of a batch -> global arrays split by `batch_sharding`.

  The rows are those of the process's data group (`data_group`): group g holds
  global rows [g*b, (g+1)*b), as the loaders hand them out, so the global batch
  equals the one a single process would load. Each process keeps the positions its
  devices hold (all of them, unless the sequence axis spans processes). A layout
  with no such groups (a process's devices hold positions of rows other processes
  loaded) sends the rows up as loaded and moves them on the devices.
  """
  sh = batch_sharding(mesh, rules)
  arrays = {k: np.asarray(v) for k, v in batch.items()}
  if not arrays:
    return {}
  b, l = next(iter(arrays.values())).shape
  if _row_groups(sh, mesh) is not None or _holds_own_rows(sh, (b, l)):
    count = data_group(mesh, rules)[1]
    global_shape = (b * count, l)
    cols = _held_columns(sh, global_shape)
    return {k: jax.make_array_from_process_local_data(sh, v[:, cols], (b * count,) + v.shape[1:])
            for k, v in arrays.items()}
  loaded = _process_rows(mesh)
  # device_put between shardings of one device set in another order: XLA moves the data.
  return {k: jax.device_put(jax.make_array_from_process_local_data(loaded, v), sh)
          for k, v in arrays.items()}


def _held_columns(sh: NamedSharding, global_shape) -> slice:
  """The positions this process's devices hold (one block: `data_group` found groups)."""
  pieces = {c.indices(global_shape[1])[:2] for _, c in sh.addressable_devices_indices_map(global_shape).values()}
  return slice(min(a for a, _ in pieces), max(e for _, e in pieces))


def _holds_own_rows(sh: NamedSharding, local_shape) -> bool:
  """Whether this process's devices hold exactly its loaded rows, every position."""
  b, l = local_shape
  p, global_shape = jax.process_index(), (b * jax.process_count(), l)
  held = sh.addressable_devices_indices_map(global_shape).values()

  def covered(slices, size):  # (first, end, positions in the distinct pieces)
    pieces = {s.indices(size)[:2] for s in slices}
    return min(a for a, _ in pieces), max(e for _, e in pieces), sum(e - a for a, e in pieces)

  return (covered([r for r, _ in held], global_shape[0]) == (p * b, (p + 1) * b, b)
          and covered([c for _, c in held], l) == (0, l, l))


def _process_rows(mesh: Mesh) -> NamedSharding:
  """Rows split over processes in process order, whole on each of a process's devices."""
  devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
  grid = np.array(devices).reshape(jax.process_count(), -1)
  return NamedSharding(Mesh(grid, ("processes", "local")), PartitionSpec("processes"))


def from_host(value: np.ndarray, sh: NamedSharding) -> jax.Array:
  """A value every process holds whole -> the global array split by `sh`, each process
  placing the pieces its devices hold (`to_host`'s inverse). Not `to_global`, which
  takes each process's own rows: given the whole value as a process's rows, that builds
  an array `jax.process_count()` times as long."""
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sh, lambda index: value[index])


def to_host(x: jax.Array) -> np.ndarray:
  """The whole value of a (possibly multi-process) array, on every process.

  np.asarray reads only arrays this process holds whole (one process, or a full
  replica); a program's output over parameters sharded across processes may be
  split instead, and then every process must take part in the gather."""
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
