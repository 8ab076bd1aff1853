"""The local tier of multi-tier checkpoints: frequent saves to each host's own disk
(`config.checkpoint.local_dir`, every `checkpoint.local_every` steps), beside the
persistent tier (`<workdir>/checkpoints`, a bucket on a pod, every `checkpoint_every`).

Layout: `<local_dir>/process_<i>/<step>/` holding `shards.npz` (the shards of the
state this process's devices hold, each distinct one once) and `manifest.json`
(every leaf's shape, dtype, the indices of its shards and a CRC-32 of each, the
data iterator's state and the run config). A step is written into
`.<step>.partial` and renamed when whole (the local disk renames atomically; a
bucket is refused as local_dir), so a save cut off by a crash never counts. A step
whose manifest or shards do not read back, or whose CRCs differ, is set aside as
`<step>.damaged`. The newest LOCAL_KEEP steps are kept, older ones deleted (the
tier's keep-last-k policy), as are partial steps of a crashed save.

Restore (`Checkpointer.restore`) takes the newest step that any tier can give every
process: the local tier when every process holds it; else a peer's replica, when a
process holding the step has the same shards as the one lacking it (data-parallel
replicas across hosts: `dcn_data`), broadcast to it over the collectives; else the
persistent tier. Saved shards fit only the mesh and process layout they were saved
with; any other layout restores from the persistent tier, which reshards.

Why not Orbax's emergency checkpointing (orbax-checkpoint 0.12.8,
`orbax.checkpoint.experimental.emergency`): its CheckpointManager saves only the
`state` item to the persistent tier, not the data iterator and run config that an
exact resume needs; it requires at least two data-parallel replicas along a mesh
axis (one process, or FSDP across all processes, is refused); it keeps none of our
set-aside of damaged steps; and it is marked "do not use without specific
approval". Its ReplicatorCheckpointManager leaves the copying between hosts to an
outside replicator service (GKE's multi-tier checkpointing driver), and the p2p
manager runs a network service of its own beside JAX's. Here the copy between hosts
is JAX's own broadcast (`multihost_utils.broadcast_one_to_all`), over the links
the job already uses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import threading
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

LOCAL_KEEP = 2  # the newest local steps kept: one to restore, one in case it is damaged
MANIFEST, SHARDS = "manifest.json", "shards.npz"
_GATHERED = 8  # the newest local steps each process reports to the others at a restore


class LocalStepDamaged(ValueError):
  pass


def _key(index, shape) -> tuple:
  """A shard's index (a tuple of slices) as ((start, stop), ...)."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _leaves(tree) -> tuple[list[tuple[str, Any]], Any]:
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(p), x) for p, x in flat], treedef


def _layouts(target) -> dict[int, list]:
  """{process: [(leaf, shape, dtype, sorted distinct shard indices its devices hold)]}
  (one pass over each leaf's devices: a pod has thousands)."""
  out: dict[int, list] = {}
  for name, t in _leaves(target)[0]:
    keys: dict[int, set] = {}
    for d, i in t.sharding.devices_indices_map(t.shape).items():
      keys.setdefault(d.process_index, set()).add(_key(i, t.shape))
    for p, k in keys.items():
      out.setdefault(p, []).append((name, tuple(t.shape), str(jnp.dtype(t.dtype)), sorted(k)))
  return out


def fingerprints(target) -> list[str]:
  """Per process, a name of the shards it holds of `target` (shapes and shardings):
  processes with equal names hold the same shards (replicas of each other)."""
  layouts = _layouts(target)
  return [hashlib.sha1(json.dumps(layouts[p]).encode()).hexdigest()[:16] for p in sorted(layouts)]


def _raw(a: np.ndarray) -> np.ndarray:
  # As unsigned integers of the same width: np.save keeps no ml_dtypes (bfloat16).
  # (ascontiguousarray makes a scalar 1-d: the shape is put back.)
  return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}").reshape(a.shape)


class LocalTier:
  """This process's local checkpoints: `save` copies the state to host memory and
  writes it on a thread; `restore` (with every process) as the module says."""

  def __init__(self, local_dir: str):
    self.directory = os.path.join(os.path.abspath(local_dir), f"process_{jax.process_index()}")
    os.makedirs(self.directory, exist_ok=True)
    for name in os.listdir(self.directory):  # a crashed save's leftovers: never committed
      if name.endswith(".partial"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    self._thread: threading.Thread | None = None
    self.last_saved: int | None = None

  # -- saving --

  def save(self, step: int, state, data_state: str, config: dict) -> None:
    """Copy `state`'s shards to host memory now, write them in the background."""
    self.wait()
    leaves = []
    for name, x in _leaves(state)[0]:
      shards = {}
      for s in x.addressable_shards:
        shards.setdefault(_key(s.index, x.shape), s.data)
      for data in shards.values():
        data.copy_to_host_async()
      leaves.append((name, tuple(x.shape), str(jnp.dtype(x.dtype)),
                     [(k, np.asarray(v)) for k, v in sorted(shards.items())]))
    manifest = {"step": step, "data": data_state, "config": config}
    self._thread = threading.Thread(target=self._write, args=(step, leaves, manifest), daemon=True,
                                    name=f"local-checkpoint-{step}")
    self._thread.start()

  def _write(self, step: int, leaves: list, manifest: dict) -> None:
    tmp, final = os.path.join(self.directory, f".{step}.partial"), os.path.join(self.directory, str(step))
    try:
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
      arrays, entries = {}, []
      for i, (name, shape, dtype, shards) in enumerate(leaves):
        for j, (_, data) in enumerate(shards):
          arrays[f"{i}_{j}"] = _raw(data)
        entries.append({"name": name, "shape": shape, "dtype": dtype, "shards": [k for k, _ in shards],
                        "crc32": [zlib.crc32(_raw(d)) for _, d in shards]})
      np.savez(os.path.join(tmp, SHARDS), **arrays)
      _write_synced(os.path.join(tmp, MANIFEST), json.dumps({**manifest, "leaves": entries}))
      if os.path.exists(final):  # a step saved again (after a roll-back): the old copy goes
        shutil.rmtree(final)
      os.rename(tmp, final)  # the commit
      self.last_saved = step
      self._prune()
    except Exception as e:  # noqa: BLE001 - the persistent tier still holds the run
      log.warning("local checkpoint step %d in %s failed (%s: %s); the persistent tier is unaffected",
                  step, self.directory, type(e).__name__, str(e).splitlines()[0][:200])

  def wait(self) -> None:
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def _prune(self) -> None:
    for s in self.steps()[:-LOCAL_KEEP]:
      shutil.rmtree(os.path.join(self.directory, str(s)), ignore_errors=True)

  # -- reading --

  def steps(self) -> list[int]:
    """Committed steps, oldest first."""
    return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())

  def _manifest(self, step: int) -> dict:
    try:
      with open(os.path.join(self.directory, str(step), MANIFEST)) as f:
        return json.load(f)
    except (OSError, ValueError) as e:
      raise LocalStepDamaged(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None

  def usable(self, target) -> list[int]:
    """The committed steps saved with this process's layout of `target`, newest first.
    One whose manifest cannot be read is set aside."""
    want = _layouts(target)[jax.process_index()]
    out = []
    for s in self.steps()[::-1]:
      try:
        m = self._manifest(s)
      except LocalStepDamaged as e:
        self.set_aside(s, str(e))
        continue
      have = [(e["name"], tuple(e["shape"]), e["dtype"], sorted(tuple(map(tuple, k)) for k in e["shards"]))
              for e in m["leaves"]]
      if have == want:
        out.append(s)
      else:
        log.info("local checkpoint step %d in %s was saved with another mesh or model; not used",
                 s, self.directory)
    return out

  def load(self, step: int) -> tuple[list[dict], str]:
    """([{shard index: raw array} per leaf], data iterator state), CRCs checked."""
    m = self._manifest(step)
    try:
      with np.load(os.path.join(self.directory, str(step), SHARDS)) as z:
        leaves = []
        for i, e in enumerate(m["leaves"]):
          got = {}
          for j, (k, crc) in enumerate(zip(e["shards"], e["crc32"])):
            a = z[f"{i}_{j}"]
            if zlib.crc32(a) != crc:
              raise LocalStepDamaged(f"shard {j} of {e['name']} fails its CRC-32")
            got[tuple(map(tuple, k))] = a
          leaves.append(got)
    except LocalStepDamaged:
      raise
    except Exception as e:  # noqa: BLE001 - a truncated or unreadable file
      raise LocalStepDamaged(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    return leaves, m["data"]

  def set_aside(self, step: int, why: str) -> None:
    src = os.path.join(self.directory, str(step))
    dst, n = f"{src}.damaged", 1
    while os.path.exists(dst):
      dst, n = f"{src}.damaged{n}", n + 1
    os.rename(src, dst)
    log.warning("local checkpoint step %d in %s cannot be read (%s); moved to %s (kept for "
                "inspection, not deleted)", step, self.directory, why, dst)


def _write_synced(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


# ----------------------------------------------------------------------------
# Restoring, with every process: which tier gives which step, and the copy between peers.


def gather_steps(mine: list[int]) -> list[set[int]]:
  """Every process's usable local steps (the newest _GATHERED of each)."""
  row = np.full(_GATHERED, -1, np.int32)
  row[:len(mine[:_GATHERED])] = mine[:_GATHERED]
  if jax.process_count() == 1:
    return [{int(s) for s in row if s >= 0}]
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  rows = np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), _GATHERED)
  return [{int(s) for s in r if s >= 0} for r in rows]


def choose(local: list[set[int]], persistent: set[int], prints: list[str]):
  """(step, 'local' | 'peer' | 'persistent', {process lacking it: its source}) for the
  newest step some tier gives every process (at one step: all local, then peers, then
  the persistent tier, the fastest first); None when there is none."""
  n = len(local)
  for s in sorted(persistent.union(*local), reverse=True):
    holders = [p for p in range(n) if s in local[p]]
    if len(holders) == n:
      return s, "local", {}
    sources = {p: next((q for q in holders if prints[q] == prints[p]), None)
               for p in range(n) if p not in holders}
    if holders and None not in sources.values():
      return s, "peer", sources
    if s in persistent:
      return s, "persistent", {}
  return None


def restore(tier: LocalTier, step: int, sources: dict[int, int], target, holders: set[int]):
  """The state of local `step` in `target`'s shardings and the data iterator state, on
  every process; None (on every process) if a holder finds its copy damaged, which
  it then sets aside."""
  me = jax.process_index()
  loaded, problem = None, None
  if me in holders:
    try:
      loaded = tier.load(step)
    except LocalStepDamaged as e:
      problem = str(e)
  if _any_process(problem is not None):
    if problem is not None:
      tier.set_aside(step, problem)
    return None
  for src in sorted(set(sources.values())):  # one broadcast per source
    got = _broadcast(loaded if me == src else None, target, src)
    if sources.get(me) == src:
      loaded = got
      log.warning("restoring step %d from process %d's local replica (this process's local "
                  "tier lacks it)", step, src)
  shards, data_state = loaded
  out = []
  flat, treedef = _leaves(target)
  for (_, t), got in zip(flat, shards):
    arrays = [jax.device_put(got[_key(i, t.shape)].view(t.dtype), d)
              for d, i in t.sharding.addressable_devices_indices_map(t.shape).items()]
    out.append(jax.make_array_from_single_device_arrays(t.shape, t.sharding, arrays))
  return jax.tree_util.tree_unflatten(treedef, out), data_state


def _any_process(flag: bool) -> bool:
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


def _broadcast(loaded, target, src: int):
  """`src`'s loaded step on every process, as one buffer of bytes (the others pass
  zeros of its size; whole bytes, so no dtype is lost to the collectives' types)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  is_source = jax.process_index() == src
  layout = [(jnp.dtype(dtype).itemsize, keys) for _, _, dtype, keys in _layouts(target)[src]]
  text = loaded[1].encode() if is_source else b""
  n_text = int(multihost_utils.broadcast_one_to_all(np.int32(len(text)), is_source=is_source))
  if is_source:
    buf = np.concatenate([np.frombuffer(got[k].tobytes(), np.uint8)
                          for got, (_, keys) in zip(loaded[0], layout) for k in keys]
                         + [np.frombuffer(text, np.uint8)])
  else:
    size = sum(width * math.prod(b - a for a, b in k) for width, keys in layout for k in keys)
    buf = np.zeros(size + n_text, np.uint8)
  buf = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=is_source), np.uint8)
  shards, at = [], 0
  for width, keys in layout:
    got = {}
    for k in keys:
      shape = tuple(b - a for a, b in k)
      n = width * math.prod(shape)
      got[k] = np.frombuffer(buf[at:at + n].tobytes(), f"u{width}").reshape(shape)
      at += n
    shards.append(got)
  return shards, buf[at:].tobytes().decode()
