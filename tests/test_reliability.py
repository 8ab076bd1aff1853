"""Issue 19: no run destroys another's work, every fault stops at once with one
clear line, and the record stays true. Each test first builds the failure the
issue describes and then checks the behaviour that replaces it."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_checkpoint import ROOT, _command, complete_steps

# ----------------------------------------------------------------------------
# 1. One run per workdir.


def _write_lock(workdir: Path, **info):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / ".lock").write_text(json.dumps(info))


def test_lock_refuses_a_live_holder_and_takes_over_stale_ones(tmp_path, caplog):
  from mamba_train.workdir import WorkdirLock, WorkdirLockedError
  work = tmp_path / "w"
  with WorkdirLock(work) as held:
    info = json.loads((work / ".lock").read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()} on {socket.gethostname()}"):
      WorkdirLock(work).acquire()
    assert held.held
  assert not (work / ".lock").exists()  # released at the end

  # A dead pid on this host: a child that has exited.
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  _write_lock(work, host=socket.gethostname(), pid=child.pid, started=0)
  with caplog.at_level("WARNING"):
    lock = WorkdirLock(work).acquire()
  assert "taking over the stale lock" in caplog.text and f"process {child.pid}" in caplog.text
  assert json.loads((work / ".lock").read_text())["pid"] == os.getpid()
  lock.release()

  # Another host: live until its lock goes unrefreshed for stale_s.
  _write_lock(work, host="elsewhere", pid=1, started=0)
  with pytest.raises(WorkdirLockedError, match="elsewhere"):
    WorkdirLock(work, stale_s=600).acquire()
  old = time.time() - 3600
  os.utime(work / ".lock", (old, old))
  lock = WorkdirLock(work, stale_s=600).acquire()
  assert json.loads((work / ".lock").read_text())["host"] == socket.gethostname()
  lock.release()


def test_lock_is_refreshed(tmp_path):
  from mamba_train.workdir import WorkdirLock
  work = tmp_path / "w"
  with WorkdirLock(work, refresh_s=0.05):
    first = json.loads((work / ".lock").read_text())["refreshed"]
    t0 = time.monotonic()
    while json.loads((work / ".lock").read_text())["refreshed"] == first:
      assert time.monotonic() - t0 < 30
      time.sleep(0.05)


def run_train(workdir, *extra, timeout=300):
  cmd, env = _command(workdir, extra, 1)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_second_run_on_a_workdir_is_refused(tmp_path):
  """A train.py on a workdir that a live run holds exits 2 naming the holder, and touches
  nothing. The holder is this test process (a live pid on this host, as a first
  train.py would be: the lock is all that stops the second one, and no run has to be
  caught mid-way)."""
  from mamba_train.workdir import WorkdirLock
  work = tmp_path / "run"
  with WorkdirLock(work):
    (work / "config.json").write_text('{"steps": 1000000}')  # the first run's
    before = _tree(work)
    r = run_train(work, "--config.steps=3")
    assert _tree(work) == before
  assert r.returncode == 2, r.stderr[-2000:]
  assert f"pid {os.getpid()}" in r.stderr and "in use by another run" in r.stderr
  assert "Traceback" not in r.stderr


# ----------------------------------------------------------------------------
# 2. Writers never delete what they read.


def _export_cli(ckpt, out, *extra, env=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **(env or {}))  # this checkout's library
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), "--checkpoint", str(ckpt),
                         "--out", str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)


def _tree(path: Path) -> dict:
  return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*")}


def test_export_never_replaces_its_source_or_a_non_export(tmp_path):
  from mamba_train.interop import export
  src = tmp_path / "run"
  (src / "checkpoints" / "2" / "state").mkdir(parents=True)  # a workdir's shape: never opened
  (src / "metrics.jsonl").write_text("{}\n")
  before = _tree(src)
  for out in (src, src / "exported", tmp_path):  # equal, inside, containing
    with pytest.raises(export.ExportPathError, match="checkpoint"):
      export.check_out(out, src / "checkpoints" / "2" if out == tmp_path else src)
  r = _export_cli(src, src, "--overwrite")  # the reported failure: it deleted the run
  assert r.returncode == 2 and "is the checkpoint" in r.stderr and "Traceback" not in r.stderr, r.stderr
  assert _tree(src) == before

  # --overwrite replaces a previous export only.
  from flax import nnx
  from mamba_train import Mamba2Config
  from mamba_train.model.mamba2 import Mamba2LM
  model = Mamba2LM(Mamba2Config(d_model=32, n_layer=1, vocab_size=64, headdim=8, d_state=8,
                                chunk_size=8), rngs=nnx.Rngs(0))
  unrelated = tmp_path / "notes"
  unrelated.mkdir()
  (unrelated / "keep.txt").write_text("mine")
  with pytest.raises(export.ExportPathError, match="not a previous export"):
    export.save_hf(model, unrelated, overwrite=True)
  assert (unrelated / "keep.txt").read_text() == "mine"
  out = export.save_hf(model, tmp_path / "exp")
  assert (out / export.MARKER).exists()
  (out / "stale.txt").write_text("from the first export")
  export.save_hf(model, out, overwrite=True)
  assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()


# ----------------------------------------------------------------------------
# 3. Settings that cannot train, and runs whose steps were skipped.


def test_validate_refuses_settings_that_cannot_train():
  from configs import base
  from mamba_train.train import run_config
  for key, value in (("lr", 0.0), ("lr", -1e-3), ("lr", float("nan")), ("b2", 1.0), ("eps", 0.0),
                     ("max_nonfinite_steps", -2)):
    c = base.get_config()
    c.optim[key] = value
    with pytest.raises(run_config.ConfigError, match=f"optim.{key} must be"):
      run_config.validate(c, num_devices=1)
  run_config.validate(base.get_config(), num_devices=1)  # the defaults pass


def test_nonfinite_guard_adapts_to_short_runs_and_counts_skips():
  from mamba_train.train import hooks
  assert hooks.nonfinite_limit(-1, 12) == 3 and hooks.nonfinite_limit(-1, 10_000) == 20
  assert hooks.nonfinite_limit(-1, 2) == 1 and hooks.nonfinite_limit(7, 12) == 7
  # 10 of 12 steps skipped, never 3 in a row: the streak never trips, the count does.
  guard = hooks.NonFiniteGuard(-1, 12)
  streaks = [0, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1]
  for step, streak in enumerate(streaks, 1):
    guard(step, None, {"nonfinite_streak": streak})
  with pytest.raises(hooks.NonFiniteLossError, match="7 of the 12 steps"):
    guard.finish()
  ok = hooks.NonFiniteGuard(-1, 12)
  for step in range(1, 13):
    ok(step, None, {"nonfinite_streak": int(step == 5)})
  ok.finish()
  assert ok.summary() == "1 of 12 steps skipped (non-finite loss or gradient)"


def test_diverging_short_run_fails_and_saves_no_nonfinite_state(tmp_path):
  """The reported run: lr 1e6 for 12 steps ended rc 0 with 10 losses null."""
  work = tmp_path / "run"
  r = run_train(work, "--config.steps=12", "--config.optim.lr=1e6", "--config.checkpoint_every=1")
  assert r.returncode == 1, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: the loss or gradient was non-finite for 3 steps in a row"), last
  rows = [json.loads(l) for l in open(work / "metrics.jsonl")]
  streak = {row["step"]: row["nonfinite_streak"] for row in rows if "loss" in row}
  assert streak and all(streak[s] == 0 for s in complete_steps(work))  # saved only finite states
  assert max(streak.values()) == 3
  r = run_train(work, "--config.steps=12", "--config.optim.lr=-1")
  assert r.returncode == 2, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == ("error: Invalid run config: optim.lr must be a finite "
                                               "number > 0 (a zero or negative rate never learns), got -1.0")


# ----------------------------------------------------------------------------
# 4. Damaged data found before compile and named.


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
  from mamba_train import data
  root = tmp_path_factory.mktemp("corpus")
  src = root / "docs.jsonl"
  src.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(40)))
  return Path(data.prepare_dataset(str(src), "docs", root=str(root), val_fraction=0.25))


def _copy_corpus(corpus, dst):
  import shutil
  shutil.copytree(corpus, dst)
  return dst


def test_damaged_shards_and_metadata_are_named(small_corpus, tmp_path):
  from mamba_train import data
  d = _copy_corpus(small_corpus, tmp_path / "trunc")
  with open(d / "train.npy", "r+b") as f:  # the reported failure: a bare mmap error
    f.truncate(f.seek(0, 2) - 100)
  with pytest.raises(data.DataError, match=r"train\.npy.*train split.*cannot be read.*prepare_data"):
    data.check_splits(str(d), ["train"], 16)
  d = _copy_corpus(small_corpus, tmp_path / "meta")
  (d / "metadata.json").write_text('{"format_version": ')  # a bare JSONDecodeError before
  with pytest.raises(data.DataError, match=r"metadata\.json.*is damaged.*prepare"):
    data.check_splits(str(d), ["train"], 16)
  data.check_splits(str(small_corpus), ["train", "validation"], 16)  # the intact copy passes


def test_damaged_validation_shard_stops_the_run_before_training(small_corpus, tmp_path):
  """The validation shard was opened at the first eval, after training, and that step's
  checkpoint was lost with it."""
  d = _copy_corpus(small_corpus, tmp_path / "data")
  (d / "validation.npy").write_bytes(b"\x93NUMPY garbage")
  work = tmp_path / "run"
  r = run_train(work, "--config.data.source=corpus", f"--config.data.dir={d}", "--config.eval_every=2")
  assert r.returncode == 2, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "validation.npy" in last and "prepare" in last, last
  assert "Traceback" not in r.stderr
  assert not (work / "metrics.jsonl").exists()  # nothing trained


def _prepare_cli(source, root):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), f"--source={source}",
                         f"--root={root}", "--name=x"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_prepare_data_names_file_and_line(tmp_path):
  from mamba_train import data
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")  # a bare StopIteration before
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n{"text": "fine"}\nthis is not json\n')  # DatasetGenerationError
  with pytest.raises(data.DataError, match=f"{bad}:3: not a JSON object"):
    data.prepare_dataset(str(bad), root=str(tmp_path / "out"))
  r = _prepare_cli(empty, tmp_path / "out")
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == (
      f"error: {empty} is empty: it holds no JSON lines. Remove it from --source or fill it.")


# ----------------------------------------------------------------------------
# 6 (issue numbering). The record: damaged steps and replayed rows.


def _tiny_state(value):
  import jax.numpy as jnp
  return {"params": {"embedding": jnp.full((4, 3), value, jnp.float32)}, "step": jnp.array(value, jnp.int32)}


def test_restore_checks_the_config_item_too(tmp_path, caplog):
  """Garbage in a step's config/metadata alone went unnoticed until an export failed."""
  import jax
  from mamba_train import checkpoint
  from mamba_train.data import SyntheticLoader
  loader = SyntheticLoader(vocab_size=17, seq_len=4, global_batch_size=1, seed=0)
  ck = checkpoint.Checkpointer(tmp_path, keep=0, async_save=False)
  for step in (1, 2):
    ck.save(step, _tiny_state(step), loader, {"step_saved": step})
  ck.close()
  (tmp_path / "checkpoints" / "2" / "config" / "metadata").write_text("{garbage")
  with pytest.raises(checkpoint.CheckpointDamagedError, match=r"checkpoints/2 is damaged.*earlier step"):
    checkpoint.saved_config(tmp_path / "checkpoints" / "2")
  ck = checkpoint.Checkpointer(tmp_path, keep=0)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tiny_state(0))
  with caplog.at_level("WARNING"):
    step, state = ck.restore(target, loader)
  ck.close()
  assert step == 1 and int(state["step"]) == 1
  assert "resuming from step 1 instead of the newest step 2" in caplog.text
  assert (tmp_path / "checkpoints" / "2.damaged").exists()


def test_resumed_metrics_hold_each_step_once(tmp_path):
  from mamba_train.metrics import MetricsWriter
  path = tmp_path / "metrics.jsonl"
  rows = [json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 9)]
  path.write_text("".join(rows) + '{"step": 9, "lo')  # steps 1..8, then a line cut by a kill
  w = MetricsWriter(str(tmp_path), wandb_cfg={"mode": "disabled"}, run_config={}, resumed_from=4)
  for s in (5, 6):
    w.write(s, {"loss": 0.5})
  w.close()
  got = [json.loads(l) for l in path.read_text().splitlines()]
  assert [r["step"] for r in got] == [1, 2, 3, 4, 4, 5, 6]
  assert got[4] == {"step": 4, "event": "resumed", "set_aside": "metrics.jsonl.after-4"}
  assert got[5]["loss"] == 0.5
  aside = (tmp_path / "metrics.jsonl.after-4").read_text()
  assert aside == "".join(rows[4:]) + '{"step": 9, "lo\n'  # nothing lost


# ----------------------------------------------------------------------------
# 5. A full disk, reported at once. Fault injection: the checkpoint writer (Orbax's
# JSON item writer, run in the background of every save) raises OSError(ENOSPC).

ENOSPC_PATCH = """
import errno, orbax.checkpoint as ocp
async def _full(self, item, directory):
  raise OSError(errno.ENOSPC, "No space left on device", str(directory))
ocp.JsonCheckpointHandler._save_fn = _full
"""


def test_failed_async_save_is_raised_with_path_and_free_space(tmp_path, monkeypatch):
  import errno
  import orbax.checkpoint as ocp
  from mamba_train import checkpoint
  from mamba_train.data import SyntheticLoader
  loader = SyntheticLoader(vocab_size=17, seq_len=4, global_batch_size=1, seed=0)
  ck = checkpoint.Checkpointer(tmp_path, keep=0)
  ck.save(1, _tiny_state(1), loader, {})
  ck.manager.wait_until_finished()

  async def full(self, item, directory):
    raise OSError(errno.ENOSPC, "No space left on device", str(directory))

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full)
  ck.save(2, _tiny_state(2), loader, {})
  with pytest.raises(checkpoint.CheckpointWriteError) as e:
    ck.check()  # at a step after the failure: raises whether or not it has landed yet
    ck.save(3, _tiny_state(3), loader, {})  # the next save waits for it
  msg = str(e.value)
  assert "\n" not in msg and f"step 2 to {tmp_path / 'checkpoints'} failed: No space left on device" in msg
  assert "GiB free there" in msg and "the last complete checkpoint is step 1" in msg
  ck.close()  # reported once: closing does not raise it again
  assert ck.steps() == [1]


def test_preflight_warns_when_the_checkpoints_cannot_fit(tmp_path, caplog):
  import shutil
  from mamba_train import checkpoint
  ck = checkpoint.Checkpointer(tmp_path, keep=3)
  free = shutil.disk_usage(tmp_path).free
  with caplog.at_level("WARNING"):
    ck.preflight(free // 8)  # 4 copies fit
    assert "saves will fail" not in caplog.text
    ck.preflight(free // 3)  # 4 copies do not
  assert "saves will fail" in caplog.text and "3 kept" in caplog.text
  ck.close()


def test_full_disk_stops_train_py_with_one_line(tmp_path):
  work = tmp_path / "run"
  cmd, env = _command(work, ["--config.steps=8", "--config.checkpoint_every=2"], 1)
  cmd = [sys.executable, "-c", ENOSPC_PATCH + "import runpy, sys; sys.argv = sys.argv[1:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')", *cmd[1:]]
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: saving checkpoint step 2 to ") and "No space left on device" in last, last
  assert "GiB free there" in last and "Traceback" not in r.stderr, r.stderr[-3000:]
  steps = [json.loads(l)["step"] for l in open(work / "metrics.jsonl") if '"loss"' in l]
  # Stopped at the first step that saw the failure (before logging it), at the latest at
  # the next save (step 4, after logging it): never trained on past an unreported failure.
  assert 2 <= max(steps) <= 4
  assert complete_steps(work) == []


# ----------------------------------------------------------------------------
# 8 (issue numbering). Clean exits.


def test_misspelt_config_key_is_one_line_exit_2(tmp_path):
  r = run_train(tmp_path / "w", "--config.optim.lrr=1")  # a 50-line traceback before
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().splitlines() == [
      "error: bad flag or --config override: 'lrr' Did you mean \"lr\" instead of \"lrr\"? "
      "(flags: --help; config keys: configs/base.py)"]
  r = run_train(tmp_path / "w", "--config.optim.lrr=1", "--debug")
  assert r.returncode != 0 and "Traceback" in r.stderr


def test_reading_a_checkpoint_logs_no_library_warnings(tmp_path, caplog):
  """generate.py printed five Orbax read_only warnings before its answer."""
  import jax
  from mamba_train import checkpoint
  from mamba_train.data import SyntheticLoader
  loader = SyntheticLoader(vocab_size=17, seq_len=4, global_batch_size=1, seed=0)
  ck = checkpoint.Checkpointer(tmp_path, keep=0, async_save=False)
  ck.save(3, _tiny_state(3), loader, {"k": 1})
  ck.close()
  with caplog.at_level("DEBUG"):
    params = checkpoint.restore_params(tmp_path / "checkpoints" / "3")
    assert checkpoint.saved_config(tmp_path / "checkpoints" / "3") == {"k": 1}
  assert float(params["embedding"][0, 0]) == 3.0
  assert [r for r in caplog.records if "/orbax/" in r.pathname] == []


# ----------------------------------------------------------------------------
# 3 (the optional part). The loss-spike guard, against an injected spike: the batch of
# step POISON gets wrong targets (each shifted by half the vocabulary).

POISON = 14
POISON_PATCH = f"""
from mamba_train.train import step as _step
_real, _calls = _step.to_global, [0]
def _poisoned(batch, mesh):
  _calls[0] += 1
  if _calls[0] == {POISON}:  # call n carries the batch of step n (the first is fetched before the loop)
    batch = dict(batch, targets=(batch["targets"] + 32) % 64)
  return _real(batch, mesh)
_step.to_global = _poisoned
"""


def test_loss_spike_rolls_back_and_skips_the_batches(tmp_path):
  work = tmp_path / "run"
  cmd, env = _command(work, ["--config.steps=18", "--config.checkpoint_every=4", "--config.optim.lr=1e-2",
                             "--config.model.vocab_size=64", "--config.optim.spike_factor=1.5",
                             "--config.optim.spike_window=6"], 1)
  cmd = [sys.executable, "-c", POISON_PATCH + "import runpy, sys; sys.argv = sys.argv[1:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')", *cmd[1:]]
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"loss spike at step {POISON}" in r.stderr and "rolled back to step 12 and skipped batches 13..14" in r.stderr
  rows = [json.loads(l) for l in open(work / "metrics.jsonl")]
  marker = next(row for row in rows if row.get("event") == "rolled_back")
  assert marker["step"] == 12 and marker["spike_step"] == POISON
  trained = [row["step"] for row in rows if "loss" in row]
  assert trained == list(range(1, 19))  # each step once: the spiking steps 13, 14 set aside
  aside = [json.loads(l) for l in open(work / "metrics.jsonl.after-12")]
  spiked = next(row["loss"] for row in aside if row["step"] == POISON)
  assert spiked > 1.5 * max(row["loss"] for row in rows if "loss" in row and row["step"] > 8)
  assert complete_steps(work)[-1] == 18


def test_scripts_name_a_wrong_checkpoint_in_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  for script, args in (("generate.py", ["--model", str(tmp_path / "nope"), "--ids", "1,2"]),
                       ("export.py", ["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (script, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'nope'} does not exist", r.stderr


def test_lost_peer_in_a_collective_is_one_line(tmp_path):
  """When a collective (gloo on CPU) notices a dead peer before the heartbeat monitor
  aborts the process, train.py says so in one line and exits 1, lock released. Faked in
  one process: process_count 2, and the first collective (the lock's broadcast) fails."""
  fake = ("import jax\nfrom jax.experimental import multihost_utils\n"
          "from mamba_train.parallel import distributed\n"
          "distributed.initialize = lambda *a, **k: False\njax.process_count = lambda: 2\n"
          "def lost(x): raise RuntimeError('Gloo connectFullMesh failed: Connection refused')\n"
          "multihost_utils.broadcast_one_to_all = lost\n")
  work = tmp_path / "run"
  cmd, env = _command(work, [], 1)
  cmd = [sys.executable, "-c", fake + "import runpy, sys; sys.argv = sys.argv[1:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')", *cmd[1:]]
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == (
      "error: process 0 lost contact with another process of the job (Gloo connectFullMesh failed: "
      "Connection refused); the last complete checkpoint is none; restart every process to resume")
  assert "Traceback" not in r.stderr and not (work / ".lock").exists()


# ----------------------------------------------------------------------------
# 7. Workdirs on cloud storage: a gs:// workdir end to end, against a local Cloud
# Storage (gcp-storage-emulator, made to honour generation preconditions as GCS does:
# tests/gcs_emulator.py). Orbax writes through tensorstore's gcs driver and marks
# finished steps with commit files; everything else goes through mamba_train.storage.


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """The port of a local Cloud Storage holding the bucket `bkt`; stopped at the end."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  log = open(tmp_path_factory.mktemp("gcs") / "emulator.log", "w")  # clients that hang up early
  proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "gcs_emulator.py"), str(port), "bkt"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
  try:
    assert proc.stdout.readline().strip() == "ready"
    yield port
  finally:
    proc.stdin.close()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    log.close()


@pytest.fixture
def gcs_env(gcs, monkeypatch):
  from gcs_emulator import client_env
  for k, v in client_env(gcs).items():
    monkeypatch.setenv(k, v)
  return client_env(gcs)


def _objects(prefix: str) -> list[str]:
  from google.cloud import storage as gcs_client
  bucket, _, key = prefix[len("gs://"):].partition("/")
  return sorted(b.name[len(key):].lstrip("/") for b in gcs_client.Client().list_blobs(bucket, prefix=key))


def test_storage_refuses_what_it_cannot_write(monkeypatch):
  from mamba_train import storage
  with pytest.raises(storage.StorageError, match="only local paths and gs:// buckets"):
    storage.path("s3://bucket/run")
  storage._check_gcs_client.cache_clear()
  monkeypatch.setitem(sys.modules, "gcsfs", None)  # the gcs extra not installed
  try:
    with pytest.raises(storage.StorageError, match=r"needs the gcs extra \(gcsfs is missing\)"):
      storage.path("gs://bucket/run")
  finally:
    storage._check_gcs_client.cache_clear()


def test_gcs_lock_and_record_without_renames(gcs_env, caplog, monkeypatch):
  """The lock (create-if-absent, take-over-if-unchanged) and the record's set-aside on a
  bucket: whole-object writes and generation preconditions, no rename."""
  from google.cloud import storage as gcs_client
  from mamba_train import storage
  from mamba_train.metrics import MetricsWriter
  from mamba_train.workdir import WorkdirLock, WorkdirLockedError
  work = "gs://bkt/lockrun"
  with pytest.raises(storage.StorageError, match="gs://nobucket does not exist"):
    storage.check_workdir("gs://nobucket/run")  # a typo: refused, never created
  storage.check_workdir(work)
  with WorkdirLock(work) as held:
    info = json.loads(storage.path(f"{work}/.lock").read_text())
    assert info["pid"] == os.getpid() and held.held
    with pytest.raises(WorkdirLockedError, match=f"pid {os.getpid()} on {socket.gethostname()}"):
      WorkdirLock(work).acquire()
    # Two creators racing: the one that looked before the other wrote loses on the
    # generation precondition, not on its look.
    with monkeypatch.context() as m:
      m.setattr(gcs_client.Blob, "exists", lambda self, *a, **k: False)
      assert not storage.create_new(f"{work}/.lock", "{}")
  assert ".lock" not in _objects(work)  # released

  storage.write_text(f"{work}/.lock", json.dumps({"host": "elsewhere", "pid": 1, "started": 0}))
  with pytest.raises(WorkdirLockedError, match="elsewhere"):
    WorkdirLock(work, stale_s=600).acquire()  # refreshed just now: alive
  token = storage.version(f"{work}/.lock")[0]
  storage.write_text(f"{work}/.lock", json.dumps({"host": "elsewhere", "pid": 2, "started": 0}))
  assert not storage.remove_if_unchanged(f"{work}/.lock", token)  # rewritten since: not taken
  with caplog.at_level("WARNING"):
    lock = WorkdirLock(work, stale_s=0).acquire()  # unrefreshed for longer than stale_s
  assert "taking over the stale lock" in caplog.text
  assert json.loads(storage.path(f"{work}/.lock").read_text())["pid"] == os.getpid()
  lock.release()

  # The record: rows past the resumed step set aside (object writes, nothing lost).
  rows = [json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 9)]
  storage.write_text(f"{work}/metrics.jsonl", "".join(rows) + '{"step": 9, "lo')
  w = MetricsWriter(work, wandb_cfg={"mode": "disabled"}, run_config={}, resumed_from=4,
                    sync_every_s=1e9)
  for s in (5, 6):
    w.write(s, {"loss": 0.5})
  synced = storage.path(f"{work}/metrics.jsonl").read_text().splitlines()
  assert len(synced) == 5  # 1..4 and the marker: rows reach the bucket at sync(), not each write
  w.close()
  got = [json.loads(l) for l in storage.path(f"{work}/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in got] == [1, 2, 3, 4, 4, 5, 6]
  assert got[4] == {"step": 4, "event": "resumed", "set_aside": "metrics.jsonl.after-4"}
  assert storage.path(f"{work}/metrics.jsonl.after-4").read_text() == "".join(rows[4:]) + '{"step": 9, "lo\n'
  assert not [n for n in _objects(work) if n.endswith(".tmp")]


def test_gcs_workdir_trains_resumes_past_a_damaged_step_and_exports(gcs_env, tmp_path):
  """train.py on gs://: checkpoints with commit files and keep-last-k deletion; a resume
  whose newest step is damaged falls back a step, sets the damaged one aside
  (copy, marker, delete) and relogs the set-aside steps with the same losses as the run
  that logged them first; export reads the bucket."""
  from mamba_train import checkpoint, storage
  from mamba_train.interop.load import load_model
  work = "gs://bkt/run"
  extra = ["--config.steps=6", "--config.checkpoint_keep=2"]
  cmd, env = _command(work, extra, 1)
  env.update(gcs_env)
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  names = _objects(work)
  assert {"config.json", "metrics.jsonl", "checkpoints/4/commit_success.txt",
          "checkpoints/6/commit_success.txt"} <= set(names), names
  assert not [n for n in names if n.startswith("checkpoints/2/") or "tmp" in n or n == ".lock"], names
  first = {json.loads(l)["step"]: json.loads(l)["loss"]
           for l in storage.path(f"{work}/metrics.jsonl").read_text().splitlines() if '"loss"' in l}
  assert sorted(first) == [1, 2, 3, 4, 5, 6]

  storage.write_text(f"{work}/checkpoints/6/config/metadata", "{garbage")  # damaged newest step
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resuming from step 4 instead of the newest step 6" in r.stderr
  names = _objects(work)
  assert "checkpoints/6.damaged/.moved_from" in names and "checkpoints/6.damaged/config/metadata" in names
  assert "checkpoints/6/commit_success.txt" in names  # saved again by the resumed run
  rows = [json.loads(l) for l in storage.path(f"{work}/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
  assert {r["step"]: r["loss"] for r in rows if "loss" in r} == first  # bit-identical
  assert {"step": 4, "event": "resumed", "set_aside": "metrics.jsonl.after-4"} in rows
  assert [json.loads(l)["step"] for l in storage.path(f"{work}/metrics.jsonl.after-4").read_text().splitlines()] == [5, 6]

  r = _export_cli(work, tmp_path / "exp", env=gcs_env)
  assert r.returncode == 0, r.stderr[-3000:]
  exported = load_model(tmp_path / "exp")
  saved = checkpoint.restore_params(f"{work}/checkpoints/6")
  saved["embedding"] = saved["embedding"][:exported.config.vocab_size]  # exports drop the padding
  theirs = exported.params()
  theirs["embedding"] = theirs["embedding"][:exported.config.vocab_size]
  import jax
  import numpy as np
  assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), theirs, saved))
