"""Joining the processes of a multi-host job (JAX's multi-controller runtime).

Every process runs the same `train.py`; each drives its local devices and reads
its share of the data. `initialize` connects them before JAX touches a device:

  * explicitly, when a coordinator address, process count and process id are
    given (train.py's `--coordinator_address --num_processes --process_id`);
  * automatically on a Cloud TPU pod slice, under SLURM (`srun`) and under
    Open MPI (`mpirun`), through JAX's own cluster detection;
  * not at all for a plain single-process run.

A dead process must stop the others, each with one line, not leave them waiting. JAX's
coordination service notices missing heartbeats within `heartbeat_timeout` seconds and,
by default, ends every other process from C++ (a LOG(FATAL): "Terminating process because
the JAX distributed service detected fatal errors ... another task died"), with no Python
handler run. The runtime's hook for that (`missed_heartbeat_callback`) cannot be used in
jaxlib 0.10.2: calling it fails to convert its absl::Status argument (std::bad_cast, then
std::terminate). So, where this JAX allows it (`PeerWatch.supported`):

  * the service runs in a small process of its own beside process 0 (`_ServiceProcess`),
    so that process 0's death does not take the service, and every survivor with it,
    down at once;
  * every process writes a heartbeat of its own into the service's key-value store and
    watches its peers' (`PeerWatch`); a peer silent for `heartbeat_timeout` seconds, or
    the service unreachable as long, calls `on_peer_lost` (train.py: one line naming
    the last complete checkpoint, exit 1). JAX's own heartbeat timeout is set to twice
    that, plus `_GRACE_S`, so that ours always notices first. (JAX's "recoverable" service,
    which would not broadcast a death at all, also drops the shutdown barrier a normal
    end needs, so it is not used.)

A collective whose peer is gone usually fails first (gloo on CPU: "Connection closed by
peer"), which the entry point reports in the same one line. A process whose peers never
arrive is stopped after `init_timeout` seconds ("DEADLINE_EXCEEDED ... RegisterTask");
the line logged just before joining says what it was waiting for. If the machine of
process 0 dies with its service, the survivors still end by the runtime's abort.
Restart the job to resume from its last checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Callable

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
               init_timeout: int = 300, heartbeat_timeout: int = 100,
               on_peer_lost: Callable[[str], None] | None = None) -> bool:
  """Join the job's other processes, if it has any; return whether it did.

  Args:
    coordinator_address: "host:port" of process 0 ('' = JAX_COORDINATOR_ADDRESS
      or the cluster's own).
    num_processes: processes in the job (0 = from the cluster; 1 = no joining).
    process_id: this process's rank, 0 .. num_processes-1 (-1 = from the cluster).
    init_timeout: seconds to wait for every process to connect.
    heartbeat_timeout: seconds without a heartbeat after which a process is
      declared dead and the job is stopped.
    on_peer_lost: called with the reason (from a watcher thread) when a peer or the
      service is lost; it must end the process. Default: log it and exit 1.

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
  watched = PeerWatch.supported()
  if watched:  # the peer watch reports a silent peer first; JAX's abort is the backstop
    kwargs["heartbeat_timeout_seconds"] = 2 * int(heartbeat_timeout) + _GRACE_S
  try:
    with _service_in_own_process() if watched else contextlib.nullcontext():
      jax.distributed.initialize(**kwargs)
  except Exception as e:  # noqa: BLE001 - JAX raises plain errors for bad arguments
    raise DistributedInitError(
        f"process {rank} could not join the job at coordinator {where}: "
        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. {hint}") from e
  if watched:
    PeerWatch(heartbeat_timeout, on_peer_lost or _exit_on_peer_lost).start()
  else:
    log.warning("this JAX lacks what the peer watch needs (see mamba_train/parallel/distributed.py): "
                "a dead process ends the others by the runtime's abort")
  if jax.process_index() != 0:
    logging.getLogger().setLevel(logging.WARNING)
  log.info("process %d of %d: %d local / %d global devices; a dead process stops the job "
           "within %d s", jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count(), heartbeat_timeout)
  return True


# ----------------------------------------------------------------------------
# A dead peer: the service in a process of its own, and a heartbeat of our own.
# (Private JAX API throughout, each piece checked by PeerWatch.supported(): JAX has no
# public one to run its service elsewhere, make it recoverable, or reach its client.)


# The coordination service, run by _ServiceProcess: it ignores SIGTERM and SIGINT (a
# preempted job's processes must still reach it to save), stops when told ("stop" on
# stdin, at the job's end), and when its parent dies lives on long enough for the
# survivors' watch to find the parent silent and stop with their line (JAX's own detection
# in the service comes later: its heartbeat timeout is twice ours).
_SERVICE = """
import os, signal, sys, time
from jax._src.lib import _jax
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
address = sys.argv[1]
n, heartbeat, shutdown, linger = map(int, sys.argv[2:6])
service = _jax.get_distributed_runtime_service(address, n, heartbeat_timeout=heartbeat,
                                               shutdown_timeout=shutdown)
print("ready", flush=True)
if sys.stdin.readline().strip() != "stop":
  time.sleep(linger)
else:
  # The job ended (every process passed JAX's shutdown barrier). The service's own
  # shutdown ends the clients' error polls in order; a bare exit closed their sockets
  # while a slower process still polled, and its client aborted (a CI run lost a job so).
  service.shutdown()
os._exit(0)
"""
_GRACE_S = 10  # beyond heartbeat_timeout: the survivors' watch reports within it


class _ServiceProcess:
  """What JAX keeps as its service object (it calls `shutdown()`), for the service run in
  a child process."""

  def __init__(self, address: str, num_nodes: int, heartbeat_timeout=None, shutdown_timeout=None):
    heartbeat = int(heartbeat_timeout or 100)
    linger = heartbeat // 2 + _GRACE_S  # past the watch's timeout (JAX's is twice it, plus _GRACE_S)
    self.proc = subprocess.Popen(
        [sys.executable, "-c", _SERVICE, address, str(num_nodes), str(heartbeat),
         str(int(shutdown_timeout or 300)), str(linger)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    if self.proc.stdout.readline().strip() != "ready":
      raise RuntimeError(
          f"the coordination service could not start on {address} (exit {self.proc.wait()}); if a job "
          f"on this port crashed less than {linger} s ago its service may still be "
          "ending: wait, or use another port")

  def shutdown(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
      except OSError:
        pass
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:  # a shutdown that hangs must not hold the job's exit
        self.proc.kill()
        self.proc.wait()


class _service_in_own_process:
  """Within: JAX's `get_distributed_runtime_service` starts the service in a child process
  (`_ServiceProcess`) when it is called with the arguments this module knows, else as JAX
  would."""

  def __enter__(self):
    from jax._src.lib import _jax
    self._jax, real = _jax, _jax.get_distributed_runtime_service

    def start(address, num_nodes, heartbeat_timeout=None, shutdown_timeout=None, **others):
      if set(others) - {"recoverable", "cluster_register_timeout"} or others.get("recoverable"):
        log.warning("the coordination service takes arguments this module does not know (%s): it "
                    "runs in process 0, and a dead process 0 ends the others by the runtime's abort",
                    sorted(others))
        return real(address, num_nodes, heartbeat_timeout=heartbeat_timeout,
                    shutdown_timeout=shutdown_timeout, **others)
      return _ServiceProcess(address, num_nodes, heartbeat_timeout, shutdown_timeout)

    self._real = real
    _jax.get_distributed_runtime_service = start
    return self

  def __exit__(self, *exc):
    self._jax.get_distributed_runtime_service = self._real
    return False


def _exit_on_peer_lost(reason: str) -> None:
  log.error("process %d lost contact with another process of the job (%s); restart every process "
            "to resume from the last checkpoint", jax.process_index(), reason)
  logging.shutdown()
  os._exit(1)


class PeerWatch:
  """A heartbeat of our own: a thread that writes this process's counter into the
  coordination service's key-value store every `period` seconds and reads its peers';
  a peer whose counter has not moved for `timeout` seconds (on this process's own clock:
  no clocks compared), or a service unreachable as long, calls `on_lost(reason)`. A process that
  ends normally writes "done" first (atexit, before JAX's own shutdown), so that the
  others do not mistake the end of a run for a death."""

  PREFIX = "mamba_train/heartbeat/"

  def __init__(self, timeout: float, on_lost: Callable[[str], None]):
    from jax._src import distributed as jax_distributed
    self.client = jax_distributed.global_state.client
    self.rank, self.n = jax.process_index(), jax.process_count()
    self.timeout, self.on_lost = float(timeout), on_lost
    self.period = min(max(self.timeout / 6, 0.2), 5.0)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="mamba_train-peer-watch", daemon=True)

  @staticmethod
  def supported() -> bool:
    """Whether this JAX has what the watch needs (each a private API)."""
    try:
      from jax._src import distributed as jax_distributed
      from jax._src.lib import _jax
    except ImportError:
      return False
    client = getattr(_jax, "DistributedRuntimeClient", None)
    return (hasattr(jax_distributed, "global_state") and hasattr(_jax, "get_distributed_runtime_service")
            and all(hasattr(client, m) for m in ("key_value_set", "key_value_try_get")))

  def start(self) -> None:
    self._beat(0)
    self._thread.start()
    atexit.register(self.stop)  # after JAX's atexit shutdown was registered: runs before it

  def stop(self) -> None:
    self._stop.set()
    try:
      self._beat("done")
    except Exception:  # noqa: BLE001 - the service is gone already: nothing to tell
      pass

  def _beat(self, value) -> None:
    self.client.key_value_set(f"{self.PREFIX}{self.rank}", str(value), allow_overwrite=True)

  def _run(self) -> None:
    now = time.monotonic()
    seen = {p: (None, now) for p in range(self.n) if p != self.rank}  # peer -> (value, when it moved)
    reached, count = now, 0
    while not self._stop.wait(self.period):
      count += 1
      now = time.monotonic()
      try:
        self._beat(count)
        for p, (value, moved) in list(seen.items()):
          try:
            new = self.client.key_value_try_get(f"{self.PREFIX}{p}")
          except Exception:  # noqa: BLE001 - not written yet (NOT_FOUND)
            new = None
          if new == "done":
            del seen[p]  # ended normally
          elif new != value:
            seen[p] = (new, now)
          elif now - moved > self.timeout:
            return self._lost(f"process {p} sent no heartbeat for {self.timeout:g} s")
        reached = now
      except Exception as e:  # noqa: BLE001 - the service unreachable
        if now - reached > self.timeout:
          return self._lost(f"the job's coordination service is unreachable: {str(e).splitlines()[0][:120]}")

  def _lost(self, reason: str) -> None:
    if not self._stop.is_set():
      self.on_lost(reason)
