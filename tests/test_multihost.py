"""Multi-host on one machine: two processes on 127.0.0.1 (CPU, gloo collectives, two
simulated devices each) joined by mamba_train.parallel.distributed, against one process with
four devices on the same mesh.

The two-process runs use the hybrid mesh (dcn_data=2 across the processes, fsdp=2
inside each), so they also check that layout end to end; a third job splits one
sequence a step (batch 1) across the two processes instead (dcn_sequence=2): both
read the same row and each keeps its half, against one process with the same mesh.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import FAST_XLA, ROOT, free_port, log_tail, model_flags, patched

STEPS = 4
SMALL = ["--config", os.path.join(ROOT, "configs", "tiny.py"), "--config.data.source=synthetic",
         *model_flags(n_layer=1, vocab_size=64), "--config.seq_len=32", "--config.batch_size=4",
         f"--config.steps={STEPS}",
         "--config.log_every=1", "--config.eval_every=0", "--config.wandb.mode=disabled"]
ONE_HOST_MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=2"]
TWO_HOST_MESH = ["--config.mesh.dcn_data=2", "--config.mesh.data=1", "--config.mesh.fsdp=2"]
# Batch 1, its 32 positions over 4 devices: two a process (dcn_sequence), or four in one.
SEQUENCE_MESH = ["--config.batch_size=1", "--config.mesh.dcn_sequence=2", "--config.mesh.data=1",
                 "--config.mesh.fsdp=1", "--config.mesh.sequence=2"]
ONE_HOST_SEQUENCE_MESH = ["--config.batch_size=1", "--config.mesh.data=1", "--config.mesh.sequence=4"]


def _env(devices: int) -> dict:
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_XLA}"}


def _start(args, devices, log_path):
  log = open(log_path, "w")
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(devices),
                          stdout=log, stderr=subprocess.STDOUT, text=True)


def _start_two(args, port, log_dir, tag):
  """Processes 0 and 1 of one job; their output goes to log_dir/<tag><rank>.log."""
  join = [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
  return [_start([*args, *join, f"--process_id={rank}"], 2, log_dir / f"{tag}{rank}.log")
          for rank in range(2)]


def _wait(procs, timeout):
  deadline = time.monotonic() + timeout
  try:
    return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def _rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f if "loss" in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The tiny model trained for STEPS steps by two processes (checkpoints every 2 steps)
  and by one, side by side."""
  tmp = tmp_path_factory.mktemp("multihost")
  train_py = os.path.join(ROOT, "train.py")
  two = _start_two([train_py, *SMALL, *TWO_HOST_MESH, "--config.checkpoint_every=2",
                    "--workdir", str(tmp / "two")], free_port(), tmp, "two")
  one = _start([train_py, *SMALL, *ONE_HOST_MESH, "--config.checkpoint_every=0",
                "--workdir", str(tmp / "one")], 4, tmp / "one.log")
  seq = _start_two([train_py, *SMALL, *SEQUENCE_MESH, "--config.checkpoint_every=0",
                    "--workdir", str(tmp / "seq")], free_port(), tmp, "seq")
  one_seq = _start([train_py, *SMALL, *ONE_HOST_SEQUENCE_MESH, "--config.checkpoint_every=0",
                    "--workdir", str(tmp / "one_seq")], 4, tmp / "one_seq.log")
  codes = _wait([*two, one, *seq, one_seq], timeout=500)
  logs = {name: (tmp / f"{name}.log").read_text()
          for name in ("two0", "two1", "one", "seq0", "seq1", "one_seq")}
  assert codes == [0] * 6, "\n\n".join(f"== {k} ==\n{log_tail(v)}" for k, v in logs.items())
  return tmp, logs


def test_two_processes_train_as_one(runs):
  tmp, _ = runs
  two, one = _rows(tmp / "two"), _rows(tmp / "one")
  assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, STEPS + 1))
  for key in ("loss", "grad_norm", "param_norm"):
    # float32; the two runs differ only in the order of cross-device sums
    np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one], rtol=2e-5, err_msg=key)
  assert two[-1]["loss"] < two[0]["loss"]


def test_sequence_split_across_processes_trains_as_one(runs):
  """dcn_sequence=2 with batch 1: the sequence's first half on process 0's devices, its
  second on process 1's. Both processes read the same row (one data group) and each
  keeps its half; the run equals one process's with the same mesh."""
  tmp, logs = runs
  assert "'sequence': 4" in logs["seq0"], logs["seq0"][-2000:]
  seq, one = _rows(tmp / "seq"), _rows(tmp / "one_seq")
  assert [r["step"] for r in seq] == list(range(1, STEPS + 1))
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose([r[key] for r in seq], [r[key] for r in one], rtol=2e-5, err_msg=key)


def test_only_process_0_reports(runs):
  tmp, logs = runs
  assert "train step compiled" in logs["two0"] and "process 0 of 2" in logs["two0"]
  for quiet in ("train step compiled", "parameters,", "it/s", "mesh {"):
    assert quiet not in logs["two1"], quiet
  assert json.loads((tmp / "two" / "config.json").read_text())["mesh"]["dcn_data"] == 2


def test_two_process_checkpoint_resumes_in_one_process(runs):
  """The two-process run's step-2 checkpoint (its step-4 one removed, as if it had died
  at step 3) resumes in one process with four devices: steps 3 and 4 match the
  one-process run. (Same mesh as that run, so its compiled step is in the cache.)"""
  tmp, _ = runs
  work = tmp / "resumed"
  shutil.copytree(tmp / "two", work)
  assert (work / "checkpoints" / "2").is_dir()
  shutil.rmtree(work / "checkpoints" / str(STEPS))
  args = [os.path.join(ROOT, "train.py"), *SMALL, *ONE_HOST_MESH, "--config.checkpoint_every=0",
          "--workdir", str(work)]
  proc = _start(args, 4, tmp / "resumed.log")
  code = _wait([proc], timeout=300)[0]
  text = (tmp / "resumed.log").read_text()
  assert code == 0, text[-3000:]
  assert "at step 2" in text, text[-3000:]
  resumed = {r["step"]: r for r in _rows(work)}  # steps 3, 4 re-logged after the original rows
  one = {r["step"]: r for r in _rows(tmp / "one")}
  for step in (3, 4):
    np.testing.assert_allclose(resumed[step]["loss"], one[step]["loss"], rtol=2e-5)


# A worker that joins a two-process job and saves the batches train.py would feed it:
# its own rows (from the trainer's inputs.make_loaders) and the global batch assembled from both.
_DATA_WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {root!r})
    from mamba_train.parallel import distributed
    distributed.initialize("127.0.0.1:{port}", 2, int(sys.argv[1]), init_timeout=60)
    import jax
    from jax.experimental import multihost_utils
    from configs import tiny
    from mamba_train.parallel.mesh import make_mesh
    from mamba_train.train import inputs, run_config, step as trainer
    c = tiny.get_config()
    c.data.source, c.data.dir, c.seq_len, c.batch_size, c.seed = "corpus", {data_dir!r}, 16, 4, 7
    c.mesh.update(dcn_data=2, data=1, fsdp=2)
    plan = run_config.validate(c, num_devices=jax.device_count(), process_count=2)
    mesh = make_mesh(c.mesh, shape=plan.mesh_shape)
    loader, _ = inputs.make_loaders(plan, inputs.data_sources(plan))
    local, glob = [], []
    for _ in range(3):
      batch = next(loader)
      local.append(batch["input_ids"])
      glob.append(multihost_utils.process_allgather(trainer.to_global(batch, mesh)["input_ids"], tiled=True))
    np.savez(sys.argv[2], local=np.stack(local), glob=np.stack(glob))
""")


def test_each_process_reads_its_own_rows(tmp_path):
  import datasets

  from mamba_train import data
  rng = np.random.default_rng(1)
  docs = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 99)) for _ in range(10)]
  data_dir = data.prepare_dataset(datasets.Dataset.from_dict({"text": docs}), "w",
                                  root=str(tmp_path), val_fraction=0.1, num_proc=1)
  script = _DATA_WORKER.format(root=str(ROOT), port=free_port(), data_dir=data_dir)
  out = [tmp_path / f"p{rank}.npz" for rank in range(2)]
  procs = [_start(["-c", script, str(rank), str(out[rank])], 2, tmp_path / f"p{rank}.log")
           for rank in range(2)]
  codes = _wait(procs, timeout=120)
  assert codes == [0, 0], "\n".join((tmp_path / f"p{r}.log").read_text()[-2000:] for r in range(2))
  p0, p1 = (np.load(p) for p in out)
  single = data.make_train_loader(data_dir, seq_len=16, global_batch_size=4, seed=7)
  for step in range(3):
    a, b = p0["local"][step], p1["local"][step]
    assert a.shape == b.shape == (2, 16)
    assert not {r.tobytes() for r in a} & {r.tobytes() for r in b}  # disjoint rows
    expected = next(single)["input_ids"]
    np.testing.assert_array_equal(np.concatenate([a, b]), expected)  # the single-process batch
    np.testing.assert_array_equal(p0["glob"][step], expected)  # assembled on the hybrid mesh
    np.testing.assert_array_equal(p1["glob"][step], expected)


# The survivor stops in its hooks after step 2 (outside any collective) until the test has
# killed its peer: only the heartbeat can tell it the peer is gone.
SLEEP_PATCH = """
import os, sys, time
from mamba_train.train import hooks as _hooks
_run, _rank = _hooks.run_hooks, int(next(a for a in sys.argv if a.startswith("--process_id=")).split("=")[1])
def _sleepy(hooks, step, *args):
  _run(hooks, step, *args)
  if step == 2 and _rank == int(os.environ["SLEEP_RANK"]):
    open(os.environ["SLEEP_MARK"], "w").close()
    time.sleep(600)
_hooks.run_hooks = _sleepy
"""


# Both orders of detection; the heartbeat-first order with process 0 killed only, the one
# that also takes the coordination service's process with it (the suite's time).
@pytest.mark.parametrize("killed, first", [(1, "collective"), (0, "collective"), (0, "heartbeat")])
def test_killed_process_stops_the_job_with_one_line(tmp_path, killed, first):
  """One process dies once both have joined; the other stops within the heartbeat timeout
  with train.py's one line, whichever notices first: a collective (the survivor was in one,
  training) or the heartbeat (the survivor was outside any, in its hooks). It was the
  runtime's C++ abort when the coordination service noticed first."""
  heartbeat = 8  # short, and still long past a loaded machine's pauses (a false alarm fails the test)
  args = [os.path.join(ROOT, "train.py"), *SMALL, *TWO_HOST_MESH, "--config.steps=100000",
          "--workdir", str(tmp_path / "run"), f"--heartbeat_timeout={heartbeat}", "--init_timeout=60"]
  mark = tmp_path / "sleeping"
  if first == "heartbeat":
    args = patched([sys.executable, *args], SLEEP_PATCH)[1:]
  join = [f"--coordinator_address=127.0.0.1:{free_port()}", "--num_processes=2"]
  env = {**_env(2), "SLEEP_RANK": str(1 - killed), "SLEEP_MARK": str(mark)}
  procs = [subprocess.Popen([sys.executable, *args, *join, f"--process_id={rank}"], cwd=ROOT, env=env,
                            stdout=open(tmp_path / f"p{rank}.log", "w"), stderr=subprocess.STDOUT, text=True)
           for rank in range(2)]
  victim, survivor = procs[killed], procs[1 - killed]
  log0 = tmp_path / "p0.log"
  ready = (lambda: mark.exists()) if first == "heartbeat" else (lambda: "process 0 of 2" in log0.read_text())
  try:
    deadline = time.monotonic() + 120
    while not ready():  # both have joined (and, for the heartbeat, the survivor sleeps)
      assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, log0.read_text()[-3000:]
      time.sleep(0.2)
    victim.kill()
    victim.wait()
    killed_at = time.monotonic()
    code = survivor.wait(timeout=heartbeat + 30)
  finally:
    _wait(procs, timeout=1)
  assert code == 1
  assert time.monotonic() - killed_at < heartbeat + 30
  text = (tmp_path / f"p{1 - killed}.log").read_text()
  lines = [line for line in text.splitlines() if "lost contact" in line or "Terminating process" in line]
  assert len(lines) == 1 and lines[0].startswith(f"error: process {1 - killed} lost contact with another "
                                                 "process of the job ("), text[-3000:]
  assert "the last complete checkpoint is" in lines[0] and "Traceback" not in text, text[-3000:]
  if first == "heartbeat":
    assert f"process {killed} sent no heartbeat for {heartbeat} s" in lines[0], lines[0]


def test_missing_peer_times_out_with_a_message(tmp_path):
  """Process 0 of 2 alone gives up after init_timeout, having said what it waited for."""
  script = textwrap.dedent(f"""
      import logging, sys
      sys.path.insert(0, {str(ROOT)!r})
      logging.basicConfig(level=logging.INFO)
      from mamba_train.parallel import distributed
      distributed.initialize("127.0.0.1:{free_port()}", 2, 0, init_timeout=2)
  """)
  proc = _start(["-c", script], 2, tmp_path / "p0.log")
  code = _wait([proc], timeout=90)[0]
  text = (tmp_path / "p0.log").read_text()
  assert code != 0, text[-2000:]
  assert "joining the job at coordinator 127.0.0.1:" in text and "waiting up to 2 s" in text, text[-2000:]
  assert "DEADLINE_EXCEEDED" in text, text[-2000:]


# ---------------------------------------------------------------------------
# In-process pieces: mesh layout and argument checks.


class _FakeDevice:
  def __init__(self, id, process_index):
    self.id, self.process_index, self.platform, self.device_kind = id, process_index, "cpu", "cpu"

  def __repr__(self):
    return f"D{self.id}"


def test_hybrid_grid_matches_create_hybrid_device_mesh():
  from jax.experimental import mesh_utils

  from mamba_train.parallel.mesh import MESH_AXES, hybrid_device_grid
  devices = [_FakeDevice(i, i // 4) for i in range(8)]  # two hosts of four
  ids = np.vectorize(lambda d: d.id)
  for cfg in ({"dcn_data": 2, "data": 1, "fsdp": 2, "tensor": 2},
              {"dcn_fsdp": 2, "data": 2, "fsdp": -1, "tensor": 1},
              {"dcn_data": 2, "data": -1, "fsdp": 1, "tensor": 1},
              {"dcn_sequence": 2, "data": 1, "sequence": 2, "tensor": 2}):
    grid = hybrid_device_grid(cfg, devices)
    dcn = [cfg.get(f"dcn_{a}", 1) for a in MESH_AXES]
    ici = [s // d for s, d in zip(grid.shape, dcn)]
    ref = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    np.testing.assert_array_equal(ids(grid), ids(ref))
  grid = hybrid_device_grid({"dcn_data": 2, "data": 1, "fsdp": 4, "tensor": 1}, devices)
  assert [{d.process_index for d in row.ravel()} for row in grid] == [{0}, {1}]  # a host per data row


def test_mesh_config_errors():
  from mamba_train.parallel.mesh import hybrid_device_grid, resolve_mesh_shape
  assert resolve_mesh_shape({"dcn_data": 2, "data": 1, "fsdp": -1, "tensor": 1}, 8) == \
      {"data": 2, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 1}
  # data = fsdp = -1 inside each granule: a 1 MiB weight over dcn_fsdp 2 x fsdp f keeps
  # 256 KiB a device at f 2, not at 4; data takes the other 2 of the granule's 4.
  assert resolve_mesh_shape({"dcn_fsdp": 2, "data": -1, "fsdp": -1}, 8, gathered=[2**20], min_piece=2**18) == \
      {"data": 2, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 1}
  assert resolve_mesh_shape({"dcn_sequence": 2, "data": 1, "sequence": -1}, 8) == \
      {"data": 1, "fsdp": 1, "expert": 1, "sequence": 8, "tensor": 1}
  with pytest.raises(ValueError, match="spans 3 hosts or slices, which do not divide the 8"):
    resolve_mesh_shape({"dcn_data": 3, "data": -1}, 8)
  with pytest.raises(ValueError, match="per host or slice"):
    resolve_mesh_shape({"dcn_data": 2, "data": 3, "fsdp": 1, "tensor": 1}, 8)
  with pytest.raises(ValueError, match="asks for 4 hosts or slices, but the 8 devices are on 2 processes"):
    hybrid_device_grid({"dcn_data": 4, "data": -1}, [_FakeDevice(i, i // 4) for i in range(8)])


def test_initialize_single_process_and_partial_flags(monkeypatch):
  from mamba_train.parallel import distributed
  monkeypatch.setattr(distributed, "detect_cluster", lambda: None)
  assert distributed.initialize() is False  # a plain run joins nothing
  assert distributed.initialize(num_processes=1) is False
  with pytest.raises(distributed.DistributedInitError, match="needs all of"):
    distributed.initialize(num_processes=2)


def test_cluster_detection_reads_slurm(monkeypatch):
  """JAX's SLURM detector, through ours: a 4-task step is a job to join, a 1-task one is not."""
  from mamba_train.parallel import distributed
  for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_"))]:
    monkeypatch.delenv(key)
  assert distributed.detect_cluster() is None
  slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[001-004]", "SLURM_NTASKS": "4",
           "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
  for key, value in slurm.items():
    monkeypatch.setenv(key, value)
  assert distributed.detect_cluster() == ("slurm", 4)
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert distributed.initialize() is False  # one task: nothing to join, JAX untouched
