"""Joining the processes of a multi-host job (JAX's multi-controller runtime).

Every process runs the same `train.py`; each drives its local devices and reads
its share of the data. `initialize` connects them before JAX touches a device:

  * explicitly, when a coordinator address, process count and process id are
    given (train.py's `--coordinator_address --num_processes --process_id`);
  * automatically on a Cloud TPU pod slice, under SLURM (`srun`) and under
    Open MPI (`mpirun`), through JAX's own cluster detection;
  * not at all for a plain single-process run.

If a process dies, the others must not wait on it forever: the coordination
service notices the missing heartbeats within `heartbeat_timeout` seconds and
stops every process ("Terminating process because the JAX distributed service
detected fatal errors ... another task died"), and a collective whose peer is
gone fails at once (gloo on CPU: "Connection closed by peer"). A process whose
peers never arrive is stopped the same way after `init_timeout` seconds
("DEADLINE_EXCEEDED ... RegisterTask"); the line logged just before joining says
what it was waiting for. JAX ends these processes from C++ (SIGABRT), so no
Python handler runs. Restart the job to resume from its last checkpoint.
"""

from __future__ import annotations

import logging
import os

import jax

from mamba_train.errors import RunFailure

log = logging.getLogger(__name__)


class DistributedInitError(RunFailure, RuntimeError):
  """The processes of a job could not be joined."""


def detect_cluster() -> tuple[str, int | None] | None:
  """(name, process count or None if unknown) of the cluster environment JAX
  would detect here, or None outside one. Uses JAX's own detectors."""
  try:  # private API: the detectors behind jax.distributed.initialize(), in JAX's order
    from jax._src import clusters
    detectors = list(clusters.ClusterEnv._cluster_types)  # noqa: SLF001
  except (ImportError, AttributeError):  # a JAX that moved them: explicit flags still work
    log.warning("this JAX has no cluster detectors where expected; pass --coordinator_address, "
                "--num_processes and --process_id for a multi-process run")
    return None
  for env in detectors:
    if getattr(env, "opt_in_only_method", False):  # mpi4py: only when asked for
      continue
    try:
      present = env.is_env_present()
    except Exception:  # noqa: BLE001 - a detector that cannot run here is absent
      present = False
    if not present:
      continue
    try:
      count = int(env.get_process_count())
    except Exception:  # noqa: BLE001 - e.g. a TPU metadata server that is slow to answer
      count = None
    return env.name or env.__name__, count
  return None


def _use_gloo_on_cpu() -> None:
  # Without it, cross-process collectives on the CPU backend fail ("no
  # collectives implementation"). It only concerns CPU devices.
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError) as e:  # a JAX without the option
    log.warning("could not select gloo CPU collectives: %s", e)


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1, *,
               init_timeout: int = 300, heartbeat_timeout: int = 100) -> bool:
  """Join the job's other processes, if it has any; return whether it did.

  Args:
    coordinator_address: "host:port" of process 0 ('' = JAX_COORDINATOR_ADDRESS
      or the cluster's own).
    num_processes: processes in the job (0 = from the cluster; 1 = no joining).
    process_id: this process's rank, 0 .. num_processes-1 (-1 = from the cluster).
    init_timeout: seconds to wait for every process to connect.
    heartbeat_timeout: seconds without a heartbeat after which a process is
      declared dead and the job is stopped.

  Must run before anything asks JAX for a device. On processes other than 0,
  Python logging is raised to WARNING so that the job logs once.
  """
  explicit = [bool(coordinator_address), num_processes > 0, process_id >= 0]
  if num_processes == 1:
    return False
  if not all(explicit):
    cluster = detect_cluster()
    if cluster is None and any(explicit):
      raise DistributedInitError(
          "a multi-process run outside SLURM, Open MPI or a TPU pod needs all of "
          "--coordinator_address, --num_processes and --process_id; got "
          f"coordinator_address={coordinator_address!r}, num_processes={num_processes}, "
          f"process_id={process_id}")
    if cluster is None or cluster[1] == 1:
      return False
    log.info("joining a %s job of %s processes", cluster[0], cluster[1] or "?")
  _use_gloo_on_cpu()
  kwargs = dict(initialization_timeout=int(init_timeout), heartbeat_timeout_seconds=int(heartbeat_timeout))
  if all(explicit):
    # All given: no cluster detection (which could otherwise pick, say, SLURM's
    # one-device-per-process default for local_device_ids).
    kwargs.update(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id, cluster_detection_method="deactivate")
  else:
    kwargs.update(coordinator_address=coordinator_address or None,
                  num_processes=num_processes or None,
                  process_id=None if process_id < 0 else process_id)
  where = kwargs.get("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS") or "auto"
  hint = ("Check that every process was started with the same coordinator address and process "
          "count, that process 0 is running, and that its port is reachable.")
  rank = "?" if kwargs.get("process_id") is None else kwargs["process_id"]
  # Logged before joining: a failed join aborts the process from C++ (DEADLINE_EXCEEDED).
  log.info("process %s: joining the job at coordinator %s; waiting up to %d s for all %s "
           "processes, after which a missing one ends the job. %s", rank, where, init_timeout,
           kwargs.get("num_processes") or "the cluster's", hint)
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # noqa: BLE001 - JAX raises plain errors for bad arguments
    raise DistributedInitError(
        f"process {rank} could not join the job at coordinator {where}: "
        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. {hint}") from e
  if jax.process_index() != 0:
    logging.getLogger().setLevel(logging.WARNING)
  log.info("process %d of %d: %d local / %d global devices; a dead process stops the job "
           "within %d s", jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count(), heartbeat_timeout)
  return True
