"""Logical axis names and the one table that maps them to mesh axes.

Every parameter carries `logical_axes` metadata (see model.py); activations are
constrained at block boundaries with `constrain`. The trainer activates a mesh
and rules with `use_rules`; outside that context `constrain` does nothing, so the
model runs unsharded on one device with no setup.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
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
    ("layers", None),
    ("embed", "fsdp"),
    ("inner", "tensor"),
    ("heads", "tensor"),
    ("state", None),
    ("conv", None),
    ("vocab", "tensor"),
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
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules)))
