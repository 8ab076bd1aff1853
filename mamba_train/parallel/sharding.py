"""Logical axis names, the one table that maps them to mesh axes, and the
shardings built from it.

Every parameter carries `logical_axes` metadata (see model/mamba2.py); activations
are constrained at block boundaries with `constrain`. The trainer activates a mesh
and rules with `use_rules`; outside that context `constrain` does nothing, so the
model runs unsharded on one device with no setup. Parameter, batch and cache
shardings come from the same table; the train state's are composed from them in
train/state.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axis (or axes, or None = replicated).
# Parameters: 'embed' is the model dimension FSDP shards; 'inner'/'heads'/'vocab'
# are split by tensor parallelism (whole heads, since d_inner = heads * headdim
# is laid out head-major). Activations use the act_* names so that the model
# dimension of activations stays whole while the batch is split.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_inner", "tensor"),
    ("act_vocab", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("layers", None),
    ("embed", "fsdp"),
    ("inner", "tensor"),
    ("heads", "tensor"),
    ("state", None),
    ("conv", None),
    ("vocab", "tensor"),
    # Hybrids: attention splits whole query and key/value heads, the MLP its
    # hidden units (Megatron's column-then-row split: one reduction per layer).
    ("attn_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
)

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


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
  """Drop mesh axes from dimensions they do not divide (those stay replicated)."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    size = math.prod(mesh.shape[a] for a in names)
    if size > 1 and dim % size:
      logging.warning("dimension %d does not divide over mesh axes %s (%d); replicating it",
                      dim, names, size)
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
  """(b, l) batches: sequences split like the activations' batch axis, positions whole."""
  return NamedSharding(mesh, logical_to_spec(("batch", None), rules))


def to_global(batch: Mapping[str, np.ndarray], mesh: Mesh, rules=DEFAULT_RULES) -> dict[str, jax.Array]:
  """This process's rows of a batch -> global arrays split by `batch_sharding`.

  Process p holds global rows [p*b, (p+1)*b), as the loaders hand them out, so
  the global batch equals the one a single process would load.
  """
  sh = batch_sharding(mesh, rules)
  return {k: jax.make_array_from_process_local_data(sh, np.asarray(v)) for k, v in batch.items()}
