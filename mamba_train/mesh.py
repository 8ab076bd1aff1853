"""The device mesh of a run, from `config.mesh` (axes data, fsdp, tensor).

`-1` on one axis means "all the devices the other axes leave". The shape is
checked against the device count here, before anything is traced or compiled.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from mamba_train.sharding import MESH_AXES


def resolve_mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """{'data': d, 'fsdp': f, 'tensor': t} with any -1 filled; raises ValueError on a mismatch."""
  unknown = sorted(set(mesh_cfg) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"config.mesh has unknown axes {unknown}; the axes are {list(MESH_AXES)}")
  shape = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
  bad = {a: s for a, s in shape.items() if s == 0 or s < -1}
  if bad:
    raise ValueError(f"config.mesh sizes must be positive or -1, got {bad}")
  fill = [a for a, s in shape.items() if s == -1]
  if len(fill) > 1:
    raise ValueError(f"config.mesh: only one axis may be -1, got {fill}")
  fixed = math.prod(s for s in shape.values() if s != -1)
  if fill:
    if num_devices % fixed:
      raise ValueError(f"config.mesh {dict(mesh_cfg)}: the fixed axes ({fixed} devices) do not divide "
                       f"the {num_devices} devices, so '{fill[0]}' = -1 cannot fill the rest")
    shape[fill[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f"config.mesh {shape} spans data*fsdp*tensor = {fixed} devices, but "
                     f"{num_devices} devices are present; make the product {num_devices} "
                     f"or set one axis to -1")
  return shape


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh over `devices` (default: all) with axes ('data', 'fsdp', 'tensor')."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_cfg, len(devices))
  dims = [shape[a] for a in MESH_AXES]
  try:  # topology-aware placement on TPU/GPU; plain order elsewhere
    grid = mesh_utils.create_device_mesh(dims, devices)
  except Exception:  # noqa: BLE001 - any topology mismatch falls back to plain order
    grid = np.asarray(devices).reshape(dims)
  return Mesh(grid, MESH_AXES)


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways the batch is split: data x fsdp."""
  return mesh.shape["data"] * mesh.shape["fsdp"]
