"""TPU slices and NVIDIA GPU hosts by name, as devices this host can compile for.

With `libtpu` installed (from PyPI; no TPU needed), `jax.experimental.topologies`
describes any slice, and `jax.jit(...).lower(...).compile()` with its devices
compiles for it on a CPU host. Names: those `topologies` knows (v4:2x2x2, v5e:4x4,
v5p:4x4x4, v6e:2x2, tpu7x:2x2x1, ...) or Cloud TPU slice names (v5p-128, v5e-16, v6e-8,
v4-32, tpu7x-8; v4, v5p and tpu7x names count TensorCores, two per chip, v5e and v6e
names count chips). With the CUDA plugin, ptxas and XLA's GPU target descriptions (the
`gpu` extra), the same holds for NVIDIA GPUs named h100-N / h200-N / b200-N / gb200-N
(`gpu_devices`).
"""

from __future__ import annotations

import math
import os
import re

from mamba_train import platforms

# Slice names count TensorCores for these generations (two per chip). TPU7x
# (Ironwood): MaxText's tpu7x-8 is tpu7x:2x2x1, four chips whose eight TensorCores
# libtpu shows as eight devices; its slices are 3-D tori like v5p's.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1, "tpu7x": 2}
_GENERATIONS = "v4|v5e|v5p|v6e|tpu7x"


def _grid(chips: int, dims: int) -> tuple[int, ...]:
  """Near-cubic (or square) power-of-two grid of `chips` chips, smallest dims first."""
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f"{chips} chips is not a power of two")
  shape = [1] * dims
  i = 0
  while math.prod(shape) < chips:
    shape[i % dims] *= 2
    i += 1
  shape = sorted(shape)  # v5e:2x4, v5p:4x4x8; a 1 goes last (v4:2x2x1)
  return tuple([d for d in shape if d > 1] + [d for d in shape if d == 1])


def topology_name(name: str) -> tuple[str, str]:
  """('v5e', 'v5e:2x2') from 'v5e:2x2', 'v5litepod-4', 'v5e-4', 'v5p-128', ..."""
  name = name.strip().lower().replace("v5litepod", "v5e").replace("v6litepod", "v6e")
  m = re.fullmatch(rf"({_GENERATIONS}):(\d+(?:x\d+)*)", name)
  if m:
    return m.group(1), name
  m = re.fullmatch(rf"({_GENERATIONS})-(\d+)", name)
  if not m:
    raise ValueError(f"unknown TPU topology {name!r}: use e.g. v5e:2x2, v6e:4x4, v5p:4x4x4, "
                     f"v4:2x2x2, tpu7x:2x2x1, or a slice name such as v5p-128, v5e-16 or tpu7x-8")
  gen, n = m.group(1), int(m.group(2))
  cores = _CORES_PER_CHIP[gen]
  if n % cores:
    raise ValueError(f"{name}: {gen} slice names count TensorCores ({cores} per chip)")
  dims = 3 if gen in ("v4", "v5p", "tpu7x") else 2
  shape = _grid(n // cores, dims)
  return gen, f"{gen}:" + "x".join(map(str, shape))


def _accelerator_type(gen: str, topo: str) -> str:
  """Cloud TPU's name of a slice ('v5litepod-4', 'v5p-16'), as its VMs' TPU_ACCELERATOR_TYPE
  reads: v4 and v5p count TensorCores, v5e and v6e chips."""
  chips = math.prod(int(d) for d in topo.split(":")[1].split("x"))
  return f"{'v5litepod' if gen == 'v5e' else gen}-{chips * _CORES_PER_CHIP[gen]}"


def tpu_devices(name: str):
  """(generation, topology name, devices) for a TPU slice, via libtpu, on any host."""
  gen, topo = topology_name(name)
  # libtpu only compiles here: skip its cloud metadata queries, and let several
  # processes (parallel tests, benchmarks) load it at once. Set before libtpu loads.
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if "tpu" not in platforms.accelerators():
    # With no TPU here libtpu cannot find the slice's type and workers, and says so in five
    # lines of warnings and a source trace; naming them quiets it (the devices and the
    # compile come from the topology asked for either way). Not on a TPU VM, whose runtime
    # reads its own.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(gen, topo))
  try:
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - every supported jax has it
    raise RuntimeError("this jax has no jax.experimental.topologies") from e
  dims = [int(d) for d in topo.split(":")[1].split("x")]
  bounds = tuple(min(d, 2) for d in dims) + (1,) * (3 - len(dims))
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topo, chip_config_name="default",
                                        chips_per_host_bounds=bounds[:3], num_slices=1)
  except Exception as e:  # noqa: BLE001 - libtpu missing or the name unknown to it
    raise RuntimeError(f"could not describe TPU topology {topo!r}: {e}\nIs libtpu installed? "
                       f"pip install -e '.[tpu]' (or pip install libtpu)") from e
  return gen, topo, list(desc.devices)


# ----------------------------------------------------------------------------
# NVIDIA GPUs: 'h100-8' is one host of 8 H100 SXM, 'h200-64' eight hosts of 8 H200,
# 'b200-8' one host of 8 B200 (sm_100a), 'gb200-8' two GB200 compute trays of 4.
# XLA compiles for a GPU with no device from a target description (a
# GpuTargetConfigProto in text form); gpu_targets/ holds XLA's own H100 SXM, H200,
# B200 and GB200 specs (xla/backends/gpu/target_config/specs/), less the
# `collective_memory_granularity` field that jaxlib 0.10.2 does not parse.
_GPU_TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "b200": "b200.txtpb", "gb200": "gb200.txtpb"}
_GPU_KINDS = "|".join(_GPU_TARGETS)
GPUS_PER_HOST = 8
_GPUS_PER_HOST = {"gb200": 4}  # a GB200 NVL72 compute tray: two Grace CPUs, four B200-class GPUs


def gpu_topology_name(name: str) -> tuple[str, int, int]:
  """('h100', hosts, GPUs per host) from 'h100-8', 'h200-64', 'b200-8', 'h100-1', ..."""
  m = re.fullmatch(rf"({_GPU_KINDS})-(\d+)", name.strip().lower())
  if not m or int(m.group(2)) < 1:
    raise ValueError(f"unknown GPU topology {name!r}: use h100-N, h200-N, b200-N or gb200-N for N GPUs "
                     f"({GPUS_PER_HOST} a host, gb200 4: h100-8 is one host, h100-64 eight)")
  kind, n = m.group(1), int(m.group(2))
  per = _GPUS_PER_HOST.get(kind, GPUS_PER_HOST)
  if n > per and n % per:
    raise ValueError(f"{name}: more than {per} GPUs come in whole hosts of {per}")
  hosts = max(1, n // per)
  return kind, hosts, n // hosts


def is_gpu_topology(name: str) -> bool:
  return re.match(rf"({_GPU_KINDS})-", name.strip().lower()) is not None


def _ptxas_on_path() -> None:
  # XLA and Triton run ptxas from PATH (then the system CUDA toolkit): put the
  # nvidia-cuda-nvcc wheel's first, as the jax CUDA wheels' own plugin does on a GPU.
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  if spec is None or not spec.submodule_search_locations:
    return
  bin_dir = os.path.join(list(spec.submodule_search_locations)[0], "bin")
  if os.path.isdir(bin_dir) and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def gpu_devices(name: str):
  """(kind, 'h100:1x8', devices) for GPU hosts by name, via the CUDA plugin, on any
  host with no GPU (`pip install -e '.[gpu]'`). `kind` keys `metrics.CHIPS`."""
  kind, hosts, per_host = gpu_topology_name(name)
  _ptxas_on_path()
  # With no CUDA driver here the plugin's library version check fails and the
  # plugin is not registered; compiling needs no driver. Read when JAX first loads
  # its plugins: entry points call this before anything initialises a backend.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  target = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets", _GPU_TARGETS[kind])
  with open(target) as f:
    config = f.read()
  try:
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    desc = topologies.get_topology_desc(platform="cuda", topology=f"1x{hosts}x{per_host}",
                                        target_config=config)
  except Exception as e:  # noqa: BLE001 - the CUDA plugin missing, or too old for the config
    raise RuntimeError(f"could not describe {name}: {e}\nAre the GPU compile wheels installed? "
                       f"pip install -e '.[gpu]'") from e
  return kind, f"{kind}:{hosts}x{per_host}", list(desc.devices)
