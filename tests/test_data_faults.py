"""Damaged data is found before compiling and named: shards, metadata, a validation
split read only at the first eval, and a source file prepare_data cannot parse."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_train, script_env


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
  env = script_env()
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
