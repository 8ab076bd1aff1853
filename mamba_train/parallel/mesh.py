"""The device mesh of a run, from `config.mesh` (axes data, fsdp, expert, sequence, tensor).

`-1` on one axis means "all the devices the other axes leave". The shape is
checked against the device count here, before anything is traced or compiled.

Over several hosts or slices (MaxText's ici / dcn split): `dcn_data` and
`dcn_fsdp` (also `dcn_sequence`, `dcn_tensor`) say how many granules (TPU slices;
hosts elsewhere) an axis spans over the slow data-center network, and data / fsdp
/ sequence / tensor then describe one granule, over its fast links. The mesh axis is the product: `dcn_data=4,
data=1, fsdp=8` is a data axis of 4 across hosts and fsdp 8 inside each, so the
gradient all-reduce is the only traffic between hosts. With every dcn_* at 1
(the default) data / fsdp / tensor span all devices, as before.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from mamba_train.parallel.sharding import MESH_AXES

DCN_KEYS = {f"dcn_{a}": a for a in MESH_AXES}  # config key -> mesh axis


def dcn_shape(mesh_cfg: Mapping[str, int]) -> dict[str, int]:
  """{'data': granules, 'fsdp': ..., 'sequence': ..., 'tensor': ...} from the dcn_* keys (default 1)."""
  shape = {a: int(mesh_cfg.get(k, 1)) for k, a in DCN_KEYS.items()}
  bad = {f"dcn_{a}": s for a, s in shape.items() if s < 1}
  if bad:
    raise ValueError(f"config.mesh dcn_* sizes must be positive, got {bad}")
  return shape


def resolve_mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """{'data': d, 'fsdp': f, 'sequence': s, 'tensor': t} with any -1 filled; raises ValueError on a mismatch.
  With dcn_* keys each axis is dcn_<axis> x <axis>, the latter resolved within a granule."""
  unknown = sorted(set(mesh_cfg) - set(MESH_AXES) - set(DCN_KEYS))
  if unknown:
    raise ValueError(f"config.mesh has unknown axes {unknown}; the axes are "
                     f"{list(MESH_AXES)} and {list(DCN_KEYS)}")
  dcn = dcn_shape(mesh_cfg)
  granules = math.prod(dcn.values())
  if granules == 1:
    return _resolve_ici(mesh_cfg, num_devices)
  if num_devices % granules:
    raise ValueError(f"config.mesh dcn_* = {dcn} spans {granules} hosts or slices, which do not "
                     f"divide the {num_devices} devices")
  try:
    ici = _resolve_ici(mesh_cfg, num_devices // granules)
  except ValueError as e:
    raise ValueError(f"{e} (per host or slice: {num_devices} devices / {granules} from dcn_*)") from None
  return {a: dcn[a] * ici[a] for a in MESH_AXES}


def _resolve_ici(mesh_cfg: Mapping[str, int], num_devices: int) -> dict[str, int]:
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
    raise ValueError(f"config.mesh {shape} spans data*fsdp*expert*sequence*tensor = {fixed} devices, but "
                     f"{num_devices} devices are present; make the product {num_devices} "
                     f"or set one axis to -1")
  return shape


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None, *,
              shape: Mapping[str, int] | None = None) -> Mesh:
  """A Mesh over `devices` (default: all) with axes MESH_AXES ('data', 'fsdp', 'expert', 'sequence', 'tensor').
  `shape`: `mesh_cfg` already resolved for as many devices (`resolve_mesh_shape`)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_cfg, len(devices)) if shape is None else shape
  if math.prod(dcn_shape(mesh_cfg).values()) > 1:
    return make_hybrid_mesh(mesh_cfg, devices, shape=shape)
  dims = [shape[a] for a in MESH_AXES]
  try:  # topology-aware placement on TPU/GPU; plain order elsewhere
    grid = mesh_utils.create_device_mesh(dims, devices)
  except Exception:  # noqa: BLE001 - any topology mismatch falls back to plain order
    grid = np.asarray(devices).reshape(dims)
  return Mesh(grid, MESH_AXES)


def device_granules(devices: Sequence[jax.Device]) -> tuple[str, list[list[jax.Device]]]:
  """('slice' | 'process', devices grouped by TPU slice, else by process), in index order."""
  key = "slice_index" if len({getattr(d, "slice_index", None) for d in devices}) > 1 else "process_index"
  groups: dict[int, list[jax.Device]] = {}
  for d in devices:
    groups.setdefault(getattr(d, key), []).append(d)
  return key.split("_")[0], [sorted(groups[k], key=lambda d: d.id) for k in sorted(groups)]


def make_hybrid_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device], *,
                     shape: Mapping[str, int] | None = None) -> Mesh:
  """The mesh of a config with dcn_* keys: each axis is dcn_<axis> granules (slices or
  hosts) times <axis> devices inside one, granule-major, so an axis's granule index
  changes slowest along it (as `mesh_utils.create_hybrid_device_mesh` lays it out)."""
  return Mesh(hybrid_device_grid(mesh_cfg, devices, shape=shape), MESH_AXES)


def hybrid_device_grid(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device], *,
                       shape: Mapping[str, int] | None = None) -> np.ndarray:
  """The device array of `make_hybrid_mesh` (`shape` as `make_mesh` takes it)."""
  dcn = dcn_shape(mesh_cfg)
  shape = resolve_mesh_shape(mesh_cfg, len(devices)) if shape is None else shape
  dcn_dims = [dcn[a] for a in MESH_AXES]
  ici_dims = [shape[a] // dcn[a] for a in MESH_AXES]
  kind, granules = device_granules(devices)
  if len(granules) != math.prod(dcn_dims):
    plural = {"process": "processes", "slice": "slices"}[kind]
    raise ValueError(
        f"config.mesh dcn_* = {dcn} asks for {math.prod(dcn_dims)} hosts or slices, but the "
        f"{len(devices)} devices are on {len(granules)} {plural}; make the product of dcn_* "
        f"{len(granules)}")
  sizes = {len(g) for g in granules}
  if sizes != {math.prod(ici_dims)}:
    raise ValueError(f"config.mesh: each {kind} must hold data*fsdp*expert*sequence*tensor = {math.prod(ici_dims)} "
                     f"devices, but they hold {sorted(sizes)}")
  grid = None
  if devices[0].platform != "cpu":  # topology-aware inside each granule on TPU/GPU
    try:
      grid = mesh_utils.create_hybrid_device_mesh(
          ici_dims, dcn_dims, devices, process_is_granule=kind == "process",
          allow_split_physical_axes=True)
    except Exception:  # noqa: BLE001 - an unknown topology falls back to plain order
      grid = None
  if grid is None:
    # Plain order: granule g's devices reshaped to ici_dims, placed at block g of
    # the dcn grid; interleaving (dcn_0, ici_0, dcn_1, ici_1, ...) gives the blocks.
    blocks = np.asarray([np.asarray(g, dtype=object).reshape(ici_dims) for g in granules], dtype=object)
    blocks = blocks.reshape(dcn_dims + ici_dims)
    n = len(MESH_AXES)
    order = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
    grid = blocks.transpose(order).reshape([shape[a] for a in MESH_AXES])
  return grid
