"""lm-evaluation-harness on our model, offline, with the tiny local tasks of
tests/data/harness: the same per-sample scores and generations as lm-eval's own `hf`
backend running the exported transformers weights, and the script's files and errors."""

import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "data", "harness")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A random byte-level model exported for transformers, and the local tasks with
  their data path made absolute."""
  from test_data import _random_model
  from mamba_train import config_for
  from mamba_train.data import tokenizer as tokenizer_lib
  from mamba_train.interop.export import save_hf
  tmp = tmp_path_factory.mktemp("harness")
  os.environ["HF_DATASETS_OFFLINE"] = "1"
  tasks = tmp / "tasks"
  tasks.mkdir()
  for f in glob.glob(os.path.join(TASKS, "*.yaml")):
    text = open(f).read().replace("tests/data/harness/tiny.jsonl", os.path.join(TASKS, "tiny.jsonl"))
    (tasks / os.path.basename(f)).write_text(text)
  model = _random_model(config_for("tiny", n_layer=2, vocab_size=257), np.random.default_rng(0))
  tokenizer_lib.byte_tokenizer().save(str(tmp / "tokenizer.json"))
  hf = save_hf(model, tmp / "hf", tokenizer_file=tmp / "tokenizer.json",
               eos_token=tokenizer_lib.EOS_TOKEN, eos_token_id=256)
  return model, str(hf), str(tasks), tmp


def _by_doc(samples):
  return {s["doc_id"]: s for s in samples}


def test_same_scores_and_generations_as_lm_evals_hf_backend(setup):
  import lm_eval
  from mamba_train import eval_harness
  from mamba_train.data.tokenizer import load_tokenizer
  model, hf, tasks, _ = setup
  names = ["tiny_mc", "tiny_ppl", "tiny_gen"]
  manager = eval_harness.task_manager(tasks, names)
  ours = eval_harness.run_tasks(
      # One batch holds all five prompts: one generate program to compile.
      eval_harness.HarnessLM(model, load_tokenizer(os.path.join(hf, "tokenizer.json")), batch_size=8),
      names, manager=manager, log_samples=True, bootstrap_iters=0)
  theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32",
                                   tasks=names, task_manager=manager, device="cpu", batch_size=4,
                                   log_samples=True, bootstrap_iters=0)
  for task in names:
    a, b = _by_doc(ours["samples"][task]), _by_doc(theirs["samples"][task])
    assert sorted(a) == sorted(b) == list(range(5))
    for doc in a:
      assert a[doc]["arguments"] == b[doc]["arguments"]
      ra, rb = a[doc]["filtered_resps"], b[doc]["filtered_resps"]
      if task == "tiny_gen":
        assert ra == rb
      elif task == "tiny_mc":  # [(loglikelihood, is_greedy)] per choice
        np.testing.assert_allclose([float(x[0]) for x in ra], [float(x[0]) for x in rb], rtol=1e-4)
        assert [x[1] for x in ra] == [x[1] for x in rb]
      else:
        np.testing.assert_allclose(float(ra[0]), float(rb[0]), rtol=1e-4)
  assert ours["results"]["tiny_mc"]["acc,none"] == theirs["results"]["tiny_mc"]["acc,none"]
  flat = eval_harness.flat_metrics(ours)
  assert flat["harness/tiny_mc/acc"] == ours["results"]["tiny_mc"]["acc,none"]


def test_eval_script_writes_lm_evals_files_and_unknown_tasks_are_refused(setup):
  _, hf, tasks, tmp = setup
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ROOT}
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "eval.py"), "--model", hf,
         "--include_path", tasks, "--limit", "3", "--batch_size", "4"]
  out = tmp / "out"
  proc = subprocess.run(cmd + ["--tasks", "tiny_mc", "--log_samples", "--output_path", str(out),
                               "--num_fewshot", "1"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
  samples = glob.glob(str(out / "**" / "samples_tiny_mc_*.jsonl"), recursive=True)
  assert len(results) == 1 and len(samples) == 1
  r = json.load(open(results[0]))
  assert r["n-shot"]["tiny_mc"] == 1 and 0 <= r["results"]["tiny_mc"]["acc,none"] <= 1
  assert len(open(samples[0]).readlines()) == 3  # --limit 3
  # Unknown names are refused before any weight loads, with what was found (the script
  # calls this; indexing lm-eval's own tasks too would take 20 s here).
  from mamba_train import eval_harness
  with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['tiny_mcq'\].*Found: tiny_gen, tiny_mc, tiny_ppl"):
    eval_harness.check_tasks(["tiny_mc", "tiny_mcq"], eval_harness.task_manager(tasks, ["tiny_mc"]))
  shutil.rmtree(out)


def test_training_hook_logs_task_scores(setup, tmp_path):
  """train.py's harness hook on the parity model: it logs what lm-eval's hf backend scores."""
  import lm_eval
  import train
  from configs import tiny
  from mamba_train import metrics as metrics_lib
  from mamba_train.train import hooks
  model, hf, tasks, _ = setup
  c = tiny.get_config()
  c.model.update(n_layer=2)
  c.harness.update(tasks="tiny_mc", every=1, include_path=tasks, limit=3, batch_size=4)
  shutil.copy(os.path.join(hf, "tokenizer.json"), tmp_path / "tokenizer.json")
  run = train.make_harness(c, model.config, str(tmp_path))
  writer = metrics_lib.MetricsWriter(str(tmp_path), wandb_cfg={"mode": "disabled"}, run_config={})
  run(5, model.params(), writer, hooks.Throughput())
  writer.close()
  row = json.loads(open(tmp_path / "metrics.jsonl").read())
  theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32",
                                   tasks=["tiny_mc"], task_manager=eval_harness_manager(tasks),
                                   device="cpu", batch_size=4, limit=3, bootstrap_iters=0)
  assert row["step"] == 5 and row["harness/tiny_mc/acc"] == theirs["results"]["tiny_mc"]["acc,none"]


def eval_harness_manager(tasks):
  from mamba_train import eval_harness
  return eval_harness.task_manager(tasks, ["tiny_mc"])
