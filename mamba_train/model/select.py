"""The implementations this model's layers run with: the selection table
(`ops/table.py`) built from the config, a resolved runtime and the active mesh
(`parallel.sharding`), once per traced program. The layers call what it returns and
read no implementation name themselves."""

from __future__ import annotations

from mamba_train.model.config import Mamba2Config
from mamba_train.model.runtime import Runtime
from mamba_train.ops import table
from mamba_train.parallel import sharding


def ops_for(cfg: Mamba2Config, rt: Runtime) -> table.Ops:
  """The operations of `cfg`'s layers as `rt` asks, under the active mesh (if any)."""
  mesh = table.Mesh(heads=sharding.head_split(), sequence=sharding.sequence_split(),
                    kv_heads=sharding.kv_head_map(), active=sharding.active() is not None)
  return table.build(rt, cfg, mesh)
