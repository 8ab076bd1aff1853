"""End to end: `python train.py` on a small model runs, its loss falls, and
metrics.jsonl, config.json and the W&B offline run hold the logged values."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from helpers import FAST_XLA, ROOT, model_flags

STEPS, LOG_EVERY, EVAL_EVERY = 30, 5, 15
SMALL = [*model_flags(chunk_size=32, vocab_size=64), "--config.seq_len=64", "--config.batch_size=8",
         "--config.data.source=synthetic",
         "--config.optim.lr=1e-2", f"--config.steps={STEPS}", f"--config.log_every={LOG_EVERY}",
         f"--config.eval_every={EVAL_EVERY}", "--config.eval_batches=2", "--config.wandb.mode=offline"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_SILENT": "true",
         # Faster compiles of these small programs; the numbers do not depend on it.
         "XLA_FLAGS": FAST_XLA}
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--workdir", str(workdir), *SMALL],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(workdir / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  return workdir, rows, proc


def test_loss_falls_and_metrics_are_logged(run):
  _, rows, _ = run
  train = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
  assert [r["step"] for r in evals] == [EVAL_EVERY, STEPS]
  for r in train:
    assert {"loss", "ppl", "lr", "grad_norm", "param_norm", "tokens_per_sec", "step_time", "mfu"} <= set(r)
    assert r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1
  # From ln(64) = 4.16 towards the synthetic chain's entropy (about 1.1 nats).
  assert train[0]["loss"] > 3.0 and train[-1]["loss"] < train[0]["loss"] - 1.0, train
  assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]


def test_config_json_is_the_resolved_config(run):
  workdir, _, _ = run
  with open(workdir / "config.json") as f:
    c = json.load(f)
  assert c["steps"] == STEPS and c["model"]["d_model"] == 64 and c["optim"]["lr"] == 1e-2


def _wandb_history(run_file):
  """History rows of an offline W&B run file (a LevelDB-style log of protobuf records)."""
  from wandb.proto import wandb_internal_pb2 as pb
  raw = open(run_file, "rb").read()
  pos, block, buf, rows = 7, 32768, b"", []  # 7-byte file header, 32 KiB blocks
  while pos + 7 <= len(raw):
    left = block - pos % block
    _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])  # crc, length, FULL/FIRST/MIDDLE/LAST
    if left < 7 or (length == 0 and kind == 0):
      pos += left  # block trailer
      continue
    buf += raw[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = pb.Record()
      record.ParseFromString(buf)
      buf = b""
      if record.WhichOneof("record_type") == "history":
        rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item})
  return rows


def test_wandb_offline_run_holds_the_values(run):
  workdir, rows, _ = run
  files = glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb"))
  assert len(files) == 1, files
  history = {h["_step"]: h for h in _wandb_history(files[0])}
  for r in rows:
    for key in ("loss", "lr", "eval_loss"):
      if key in r:
        assert history[r["step"]][key] == pytest.approx(r[key], rel=1e-12)
