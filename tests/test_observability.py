"""What a run shows: a clean start (no plugin noise on a machine without the plugin's
hardware, one line where the hardware is there and its plugin fails), TensorBoard's
events of the record, a profile of chosen steps, XLA's memory estimate, the scripts'
one-line answers to a bad argument, and scripts/plot.py's figure.

TensorBoard's events are read back by TensorBoard's own reader and held against the
run's metrics.jsonl; the resumed case is in test_checkpoint.py (a killed hybrid run)
and test_gcs_workdir.py (a bucket), on runs those files make anyway."""

import glob
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, record_scalars, tensorboard_scalars, train_command

# What jax's plugin discovery printed before on a CPU machine with the test extra (the
# CUDA plugin and libtpu): none of it may appear.
NOISE = ("Traceback", "Jax plugin", "cuDNN", "libtpu", "TPU", "Unable to initialize backend", "E0000",
         "InitGoogle", "worker hostname", "Source Location Trace")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """train.py as a user runs it (no JAX_PLATFORMS), 3 steps with evals at 2 and 3 and a
  profile of steps 2..3: (workdir, its output)."""
  work = tmp_path_factory.mktemp("obs") / "run"
  cmd, env = train_command(work, ["--config.steps=3", "--config.eval_every=2", "--config.profile.start_step=1",
                                  "--config.profile.num_steps=2"])
  env.pop("JAX_PLATFORMS")
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return work, r.stderr + r.stdout


def test_a_cpu_machine_starts_without_plugin_noise(run):
  _, out = run
  lines = out.splitlines()
  assert "mesh {" in lines[0], lines[:5]  # train.py's own first line
  assert not [l for l in lines if any(n in l for n in NOISE)], [l for l in lines if any(n in l for n in NOISE)]


_FAILING_PLUGIN = """
import jax_plugins.xla_cuda12 as cuda
from mamba_train import platforms
def broken(**_):
  raise RuntimeError("Unable to load cuDNN. Is it installed?")
cuda._check_cuda_versions = broken         # the plugin's own check fails, as with no cuDNN
platforms.accelerators = lambda: ["cuda"]  # on a machine that has an NVIDIA GPU
from mamba_train.xla_flags import apply_cpu_defaults
apply_cpu_defaults()
from jax._src import hardware_utils
hardware_utils.has_visible_nvidia_gpu = lambda: True  # jax's own look agrees
import jax
jax.devices()
"""


def test_a_plugin_that_fails_where_its_hardware_is_says_so_in_one_line():
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  r = subprocess.run([sys.executable, "-c", _FAILING_PLUGIN], env=dict(env, PYTHONPATH=str(ROOT)),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 1
  assert r.stderr.splitlines() == [
      "error: this machine has an NVIDIA GPU but JAX could not start it: RuntimeError: Unable to load cuDNN. "
      "Is it installed? (pip install -U 'jax[cuda12]'; or JAX_PLATFORMS=cpu runs on the CPU)"], r.stderr


def test_platforms_keep_a_choice_made_and_otherwise_take_the_hardware(monkeypatch):
  from mamba_train import platforms
  assert platforms.choose({"JAX_PLATFORMS": ""}) is None  # the user's, even empty: kept
  monkeypatch.setattr(platforms, "accelerators", lambda: [])
  env = {}
  assert platforms.choose(env) == "cpu" and env == {"JAX_PLATFORMS": "cpu"}
  monkeypatch.setattr(platforms, "accelerators", lambda: ["tpu"])
  assert platforms.choose({}) == "tpu,cpu"


def test_tensorboard_holds_every_scalar_of_the_record_at_its_step(run):
  from tensorboard.backend.event_processing import event_accumulator
  work, _ = run
  rows = [json.loads(l) for l in open(work / "metrics.jsonl")]
  want = record_scalars(rows)
  assert tensorboard_scalars(work / "tensorboard") == want
  assert [s for s, _ in want["loss"]] == [1, 2, 3] and [s for s, _ in want["eval_loss"]] == [2, 3]  # and at the end
  assert {"lr", "grad_norm", "param_norm", "tokens_per_sec", "mfu", "goodput", "goodput/compile_s"} <= set(want)
  # The config in the text panel, and as hparams.
  acc = event_accumulator.EventAccumulator(str(work / "tensorboard"), size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  text = acc.Tensors("config")[0].tensor_proto.string_val[0].decode()
  assert json.loads(text) == json.loads((work / "config.json").read_text())
  from tensorboard.plugins.hparams import plugin_data_pb2
  start = plugin_data_pb2.HParamsPluginData.FromString(
      acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info.hparams
  config = json.loads((work / "config.json").read_text())
  assert start["optim.lr"].number_value == config["optim"]["lr"] and start["steps"].number_value == 3
  assert start["data.source"].string_value == "synthetic"


def test_the_profile_holds_the_steps_asked_for(run):
  work, out = run
  runs = glob.glob(str(work / "profile" / "plugins" / "profile" / "*"))
  assert len(runs) == 1 and glob.glob(f"{runs[0]}/*.xplane.pb"), runs  # TensorBoard's / XProf's file
  with gzip.open(glob.glob(f"{runs[0]}/*.trace.json.gz")[0]) as f:  # Perfetto's
    events = json.load(f)["traceEvents"]
  assert sorted(e["args"]["step_num"] for e in events if e.get("name") == "train") == ["2", "3"]
  assert f"profile of steps 2..3 in {work}/profile/plugins/profile" in out


def test_xla_memory_estimate_at_start_and_none_per_row_on_cpu(run):
  from mamba_train import metrics
  work, out = run
  assert "XLA's memory estimate of the train step: " in out
  rows = [json.loads(l) for l in open(work / "metrics.jsonl")]
  assert not [r for r in rows if "memory_gib" in r]  # the CPU reports no memory in use

  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      return self.stats
  assert metrics.memory_stats(Device({"bytes_in_use": 3 << 30, "peak_bytes_in_use": 5 << 29})) == {
      "memory_gib": 3.0, "peak_memory_gib": 2.5}
  assert metrics.memory_stats(Device(None)) == {}


# Each case: a script, its arguments, and the one line it must print (exit 2). All run in
# one child (each script fresh: absl's flags cleared between them), not one process each.
CASES = [
    ("generate.py", ["--model", "/nonexistent/dir", "--prompt", "hi"],
     "error: --model /nonexistent/dir does not exist (flags: --help)"),
    ("generate.py", ["--model", ".", "--prompt", "hi", "--temperature", "-1"],
     "error: flag --temperature=-1: -1.0 is not a non-negative number (flags: --help)"),
    ("generate.py", ["--model", ".", "--prompt", "hi", "--top_p", "0"],
     "error: flag --top_p=0.0: --top_p must be in (0, 1] (flags: --help)"),
    ("generate.py", ["--prompt", "hi"], "error: --model is required (flags: --help)"),
    ("generate.py", ["--checkpoint", "/nonexistent/dir", "--ids", "1,2"],  # the alias and token ids
     "error: --model /nonexistent/dir does not exist (flags: --help)"),
    ("export.py", ["--checkpoint", "/nonexistent/dir", "--out", "/nonexistent/out"],
     "error: /nonexistent/dir does not exist"),
    ("eval.py", ["--model", "/nonexistent/dir", "--tasks", "arc_easy"],
     "error: --model /nonexistent/dir does not exist (flags: --help)"),
    ("export.py", ["--model", "/nonexistent/dir", "--out", "/nonexistent/out", "--no_such_flag"],
     "error: Unknown command line flag 'no_such_flag' (flags: --help)"),
    ("window_search.py", ["--model", "/nonexistent/dir", "--data", "."],
     "error: --model /nonexistent/dir does not exist (flags: --help)"),
    ("prepare_data.py", [], "error: Pass --source=... (or --default_corpus). (flags: --help)"),
    ("aot_compile.py", ["--config", "configs/tiny.py", "--config.no_such_key=1"],
     "error: the config has no key 'no_such_key' (its keys: configs/base.py) (flags: --help)"),
    ("grpo_task.py", ["--n", "0"], "error: flag --n=0: 0 is not a positive integer (flags: --help)"),
    ("gen_config_reference.py", ["--chek"],
     "error: Unknown command line flag 'chek'. Did you mean: check ? (flags: --help)"),
    ("plot.py", ["/nonexistent/run", "--out", "x.png"],
     "error: /nonexistent/run holds no metrics.jsonl: pass a run's workdir (flags: --help)"),
]

_RUN_SCRIPTS = """
import contextlib, io, json, runpy, sys
from absl import app, flags, logging
absl_own = set(flags.FLAGS)
got = []
for script, args in json.loads(sys.argv[1]):
  for name in set(flags.FLAGS) - absl_own:  # each script defines its flags afresh
    delattr(flags.FLAGS, name)
  sys.argv = [script, *args]
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      runpy.run_path(script, run_name="__main__")
      code = 0
    except SystemExit as e:
      code = e.code
  got.append([code, err.getvalue()])
print(json.dumps(got))
"""


def test_every_script_answers_a_bad_argument_in_one_line():
  scripts = [[f"scripts/{s}", a] for s, a, _ in CASES]
  r = subprocess.run([sys.executable, "-c", _RUN_SCRIPTS, json.dumps(scripts)], cwd=ROOT, capture_output=True,
                     text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.splitlines()[-1])
  for (script, args, line), (code, err) in zip(CASES, got):
    assert (code, err.splitlines()) == (2, [line]), (script, args, err[-2000:])
  assert {s for s, _, _ in CASES} == {os.path.basename(p) for p in glob.glob(str(ROOT / "scripts" / "*.py"))}


def _synthetic_run(path, steps, lr, tokens_per_step=None, resumed_at=None):
  """A workdir with a metrics.jsonl as a run writes it (marker rows, an eval every 4
  steps) and, `tokens_per_step`, its config.json."""
  os.makedirs(path)
  rows = [{"step": 0, "event": "restarted", "set_aside": None}]
  for s in range(1, steps + 1):
    rows.append({"step": s, "loss": 5.0 / s**0.3 + lr, "lr": lr * min(1.0, s / 3), "grad_norm": 1.0 / s,
                 "tokens_per_sec": 1000.0 + s, "mfu": 0.01 * s, "goodput": 0.5, "peak_memory_gib": 1.5})
    if s % 4 == 0:
      rows.append({"step": s, "eval_loss": 5.0 / s**0.3})
    if s == resumed_at:
      rows.append({"step": s, "event": "resumed", "set_aside": "metrics.jsonl.after-4"})
  with open(path / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  if tokens_per_step:
    with open(path / "config.json", "w") as f:
      json.dump({"batch_size": 2, "seq_len": tokens_per_step // 2, "name": "x"}, f)
  return rows


def test_plot_draws_each_runs_record(tmp_path):
  from mamba_train.tools import plot
  _synthetic_run(tmp_path / "a", 12, 1e-3, tokens_per_step=64, resumed_at=4)
  _synthetic_run(tmp_path / "b", 8, 3e-3)  # no config.json: no tokens axis
  runs = [plot.read_run(str(tmp_path / "a")), plot.read_run(str(tmp_path / "b") + "/metrics.jsonl")]
  fig = plot.figure(runs, smooth=0.0)
  axes = {ax.get_title(): ax for ax in fig.axes}
  loss = axes["loss (eval dashed)"].get_lines()  # a: train, eval; b: train, eval
  assert [list(l.get_xdata()) for l in loss] == [list(range(1, 13)), [4, 8, 12], list(range(1, 9)), [4, 8]]
  np.testing.assert_allclose(loss[0].get_ydata(), [5.0 / s**0.3 + 1e-3 for s in range(1, 13)], rtol=1e-12)
  by_tokens = axes["loss against tokens (eval dashed)"].get_lines()
  assert [list(l.get_xdata()) for l in by_tokens] == [[64 * s for s in range(1, 13)], [256, 512, 768]]
  np.testing.assert_allclose(axes["MFU (%)"].get_lines()[1].get_ydata(), [s for s in range(1, 9)], rtol=1e-12)
  for title in ("learning rate", "gradient norm", "tokens/s", "goodput (%)", "device memory at peak (GiB)"):
    assert len(axes[title].get_lines()) == 2, title
  smooth = plot.figure(runs, smooth=0.6).axes[0].get_lines()[1].get_ydata()  # TensorBoard's debiased EMA
  ys, want, last = [5.0 / s**0.3 + 1e-3 for s in range(1, 13)], [], 0.0
  for n, y in enumerate(ys, 1):
    last = 0.6 * last + 0.4 * y
    want.append(last / (1 - 0.6**n))
  np.testing.assert_allclose(smooth, want, rtol=1e-12)
  out = tmp_path / "plot.png"
  plot.save(runs, str(out))
  from matplotlib import image
  assert image.imread(str(out)).shape[:2] == (680, 1600)
