"""GRPO on two processes (127.0.0.1, gloo, one simulated CPU device each, dcn_data=2) against
one process with two devices (data=2): the rollout's rows split over both processes' devices,
every process scores every completion and builds the same advantages, and the training batch
holds each completion once. Three tiny steps and an eval; the same metrics, written once."""

import json
import os
import subprocess
import sys
import time

import numpy as np

from helpers import FAST_XLA, ROOT, free_port, log_tail

# A reward with a spread in every group (the tiny random policy rarely earns `closeness`'s),
# so the advantages, the loss and the gradient are not zero.
REWARD = "test_grpo_multihost:first_byte"
# Numbers of the run that are not timings.
TIMING = ("goodput", "rollout/", "train/", "event")


def first_byte(prompts, completions, completion_ids, **_):
  return [ids[0] / 256 if ids else 0.0 for ids in completion_ids]


def _start(workdir, devices, log, *extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.path.dirname(os.path.abspath(__file__))]),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_XLA}")
  cmd = [sys.executable, str(ROOT / "train.py"), "--workdir", str(workdir), "--config",
         str(ROOT / "configs" / "grpo.py"), f"--config.grpo.prompts={workdir.parent / 'task.jsonl'}",
         f"--config.grpo.reward_funcs={REWARD}", "--config.wandb.mode=disabled", "--config.steps=3",
         "--config.grpo.prompts_per_step=2", "--config.grpo.num_generations=4", "--config.grpo.max_new_tokens=2",
         "--config.eval_every=3", "--config.checkpoint_every=0", "--config.model.n_layer=1", *extra]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)


def _rows(workdir):
  return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def test_two_process_grpo_equals_one_process(tmp_path):
  # 11 prompts: 10 to train, 1 held out (eval_fraction 0.05 rounds up): a short eval batch
  # that the two devices split only once padded.
  (tmp_path / "task.jsonl").write_text("".join(json.dumps({"prompt": f"{n}:", "answer": str(n % 10)}) + "\n"
                                               for n in range(1000, 1011)))
  port = free_port()
  join = [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
  procs = [_start(tmp_path / "two", 1, tmp_path / f"two{r}.log", "--config.mesh.dcn_data=2",
                  "--config.mesh.data=1", *join, f"--process_id={r}") for r in range(2)]
  procs.append(_start(tmp_path / "one", 2, tmp_path / "one.log", "--config.mesh.data=2"))
  deadline = time.monotonic() + 300
  try:
    codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("two0", "two1", "one")}
  assert codes == [0, 0, 0], "\n\n".join(f"== {k} ==\n{log_tail(v)}" for k, v in logs.items())

  two, one = _rows(tmp_path / "two"), _rows(tmp_path / "one")
  # Only process 0 writes: each step's row once, and process 1 reports nothing.
  train_steps = [r["step"] for r in two if "reward" in r]
  assert train_steps == [1, 2, 3] and [r["step"] for r in two if "eval_reward" in r] == [3]
  assert "loss=" not in logs["two1"] and "eval reward" not in logs["two1"]
  assert "process 0 of 2" in logs["two0"] and "'data': 2" in logs["two0"]
  same = lambda row: {k: v for k, v in row.items() if not k.startswith(TIMING)}
  assert len(two) == len(one)
  for a, b in zip(two, one):
    a, b = same(a), same(b)
    assert a.keys() == b.keys()
    numbers = sorted(k for k, v in a.items() if isinstance(v, float))
    assert {k: a[k] for k in a if k not in numbers} == {k: b[k] for k in b if k not in numbers}
    # float32; the runs differ only in the order of cross-device sums.
    np.testing.assert_allclose([a[k] for k in numbers], [b[k] for k in numbers], rtol=1e-5, atol=1e-7,
                               err_msg=str(numbers))
  # Each completion once in the batch (2 x 4 rows of 2 tokens at most), a real gradient.
  assert all(r["tokens"] <= 16 for r in two if "tokens" in r)
  assert all(r["grad_norm"] > 0 for r in two if "grad_norm" in r)
