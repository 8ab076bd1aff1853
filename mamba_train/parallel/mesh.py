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

`-1` on both data and fsdp splits the devices the other axes leave between them
(`split_data_fsdp`): fsdp as large as keeps each large weight's piece at a size XLA:TPU
gathers well (`TPU_MIN_GATHER_PIECE`), data the rest.
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

# The smallest bf16 piece of a large weight a device holds that `split_data_fsdp` keeps on
# TPU. XLA:TPU's all_gather_decomposer (libtpu 0.0.52) rewrites an all-gather whose piece
# on a device is at most 64 KiB into a broadcast of zeros, a dynamic-update-slice and an
# all-reduce, whichever axis is split and whatever the flags, and XLA's memory-space
# schedule around the decomposed form moves more besides. Pieces between 64 and 128 KiB
# gather whole, yet the step around them still counted more (2.7b's out_proj, 100 KiB at
# fsdp 256), so the floor is twice the rewrite's: docs/bench/fused_layer.md, the 1.3b and
# 2.7b steps on v6e-256 and the 1.3b on tpu7x-512 at each fsdp.
TPU_MIN_GATHER_PIECE = 128 * 1024
# The weights whose gathers the split keeps whole: the largest, until they hold this share
# of all the weights' bytes (1.3b: the embedding, z|x and out_proj; not B|C or dt).
GATHERED_SHARE = 0.9


def gathered_weights(shapes: Mapping[str, Sequence[int]], share: float = GATHERED_SHARE) -> list[int]:
  """The bf16 bytes of one gather of each weight that holds most of the model's bytes:
  largest first, until they hold `share` of all. `shapes`: {path: shape} of the
  parameters (`model.params.param_shapes`); a path under a stack ('layers/out_proj')
  has the layers on its leading axis and is gathered one layer at a time."""
  weights = []  # (bytes of one gather, gathers)
  for path, shape in shapes.items():
    stacked = "/" in path and len(shape) > 1
    one = shape[1:] if stacked else shape
    weights.append((2 * math.prod(one), shape[0] if stacked else 1))
  weights.sort(reverse=True)
  total, held, out = sum(b * n for b, n in weights), 0, []
  for b, n in weights:
    if held >= share * total:
      break
    out.append(b)
    held += b * n
  return out


def split_data_fsdp(devices: int, gathered: Sequence[int] = (), min_piece: int = 0,
                    other_split: int = 1) -> tuple[int, int]:
  """(data, fsdp) with data x fsdp = `devices`: fsdp the largest divisor of `devices`
  that keeps every weight of `gathered` (bytes, `gathered_weights`), split over fsdp
  x `other_split` (the tensor axis, and dcn_fsdp's granules), at `min_piece` bytes a
  device or more; data the rest. Without weights or with min_piece 0, fsdp takes them all."""
  for fsdp in sorted((f for f in range(1, devices + 1) if devices % f == 0), reverse=True):
    if all(b / (fsdp * other_split) >= min_piece for b in gathered) or fsdp == 1:
      return devices // fsdp, fsdp
  raise AssertionError("unreachable: fsdp 1 always returns")


def dcn_shape(mesh_cfg: Mapping[str, int]) -> dict[str, int]:
  """{'data': granules, 'fsdp': ..., 'sequence': ..., 'tensor': ...} from the dcn_* keys (default 1)."""
  shape = {a: int(mesh_cfg.get(k, 1)) for k, a in DCN_KEYS.items()}
  bad = {f"dcn_{a}": s for a, s in shape.items() if s < 1}
  if bad:
    raise ValueError(f"config.mesh dcn_* sizes must be positive, got {bad}")
  return shape


def resolve_mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int, *, gathered: Sequence[int] = (),
                       min_piece: int = 0) -> dict[str, int]:
  """{'data': d, 'fsdp': f, 'sequence': s, 'tensor': t} with any -1 filled; raises ValueError on a mismatch.
  With dcn_* keys each axis is dcn_<axis> x <axis>, the latter resolved within a granule.
  data and fsdp both -1: `split_data_fsdp` with `gathered` and `min_piece` (the run's
  weights and `TPU_MIN_GATHER_PIECE` on TPU; none elsewhere: fsdp takes all)."""
  unknown = sorted(set(mesh_cfg) - set(MESH_AXES) - set(DCN_KEYS))
  if unknown:
    raise ValueError(f"config.mesh has unknown axes {unknown}; the axes are "
                     f"{list(MESH_AXES)} and {list(DCN_KEYS)}")
  dcn = dcn_shape(mesh_cfg)
  granules = math.prod(dcn.values())
  split = dict(gathered=gathered, min_piece=min_piece, other_split=dcn["fsdp"] * dcn["tensor"])
  if granules == 1:
    return _resolve_ici(mesh_cfg, num_devices, **split)
  if num_devices % granules:
    raise ValueError(f"config.mesh dcn_* = {dcn} spans {granules} hosts or slices, which do not "
                     f"divide the {num_devices} devices")
  try:
    ici = _resolve_ici(mesh_cfg, num_devices // granules, **split)
  except ValueError as e:
    raise ValueError(f"{e} (per host or slice: {num_devices} devices / {granules} from dcn_*)") from None
  return {a: dcn[a] * ici[a] for a in MESH_AXES}


def _resolve_ici(mesh_cfg: Mapping[str, int], num_devices: int, *, gathered: Sequence[int],
                 min_piece: int, other_split: int) -> dict[str, int]:
  shape = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
  bad = {a: s for a, s in shape.items() if s == 0 or s < -1}
  if bad:
    raise ValueError(f"config.mesh sizes must be positive or -1, got {bad}")
  fill = [a for a, s in shape.items() if s == -1]
  if fill == ["data", "fsdp"]:
    rest = math.prod(s for a, s in shape.items() if a not in fill)
    if num_devices % rest:
      raise ValueError(f"config.mesh {dict(mesh_cfg)}: the fixed axes ({rest} devices) do not divide "
                       f"the {num_devices} devices, so data = fsdp = -1 cannot split the rest")
    shape["data"], shape["fsdp"] = split_data_fsdp(num_devices // rest, gathered, min_piece,
                                                   other_split * shape["tensor"])
    return shape
  if len(fill) > 1:
    raise ValueError(f"config.mesh: only one axis may be -1 (or data and fsdp both), got {fill}")
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
