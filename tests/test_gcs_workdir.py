"""Workdirs on cloud storage: a gs:// workdir end to end, against a local Cloud
Storage (gcp-storage-emulator, made to honour generation preconditions as GCS does:
tests/gcs_emulator.py). Orbax writes through tensorstore's gcs driver and marks
finished steps with commit files; everything else goes through mamba_train.workdir.storage."""

import json
import os
import socket
import subprocess
import sys

import pytest

from helpers import ROOT, export_cli, free_port, record_scalars, tensorboard_scalars, train_command


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """The port of a local Cloud Storage holding the bucket `bkt`; stopped at the end."""
  port = free_port()
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
  from mamba_train.workdir import storage
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

  from mamba_train.workdir import storage
  from mamba_train.workdir.lock import WorkdirLock, WorkdirLockedError
  from mamba_train.workdir.record import MetricsWriter
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
  from mamba_train.interop.load import load_model
  from mamba_train.workdir import checkpoint, storage
  work = "gs://bkt/run"
  extra = ["--config.steps=6", "--config.checkpoint_keep=2"]
  cmd, env = train_command(work, extra, 1)
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
  aside = storage.path(f"{work}/metrics.jsonl.after-4").read_text().splitlines()
  assert [json.loads(l)["step"] for l in aside if '"loss"' in l] == [5, 6]
  # TensorBoard's events in the bucket: one file, rebuilt at the resume, each scalar of
  # the record once a step.
  events = [n for n in names if n.startswith("tensorboard/")]
  assert len(events) == 1 and events[0].startswith("tensorboard/events.out.tfevents."), events
  (tmp_path / "tb").mkdir()
  (tmp_path / "tb" / os.path.basename(events[0])).write_bytes(storage.path(f"{work}/{events[0]}").read_bytes())
  assert tensorboard_scalars(tmp_path / "tb") == record_scalars(rows)

  r = export_cli(work, tmp_path / "exp", env=gcs_env)
  assert r.returncode == 0, r.stderr[-3000:]
  exported = load_model(tmp_path / "exp")
  saved = checkpoint.restore_params(f"{work}/checkpoints/6")
  saved["embedding"] = saved["embedding"][:exported.config.vocab_size]  # exports drop the padding
  theirs = exported.params()
  theirs["embedding"] = theirs["embedding"][:exported.config.vocab_size]
  import jax
  import numpy as np
  assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), theirs, saved))
