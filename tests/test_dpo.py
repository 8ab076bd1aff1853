"""DPO: the loss and reward metrics against torch on the same log-probabilities; response
log-probabilities against a direct log-softmax; prompt tokens get no gradient; log 2 at
the first step (policy = reference, with LoRA too), which the recipe's adapter rate moves;
the preparation of TRL's layouts; a short run of the 130m recipe from a tiny base takes its
architecture and learns to prefer the chosen responses of a synthetic preference set, and a
model flag that contradicts the base is refused before anything is built."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from configs import dpo as dpo_config
from mamba_train import data
from mamba_train.data import preference
from mamba_train.interop import export
from mamba_train.interop.load import load_config
from mamba_train.model.config import Mamba2Config
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train import dpo, run_config, step as steps
from mamba_train.train.loss import row_cross_entropy

from helpers import FAST_XLA, ROOT, SMALL_MODEL, random_model, record_scalars, rel, script_env, tensorboard_scalars

SEQ_LEN = 96


def _write_prefs(directory, n=32):
  """A preference set in TRL's three layouts: the chosen answer is always 'yes yes yes'."""
  rng = np.random.RandomState(0)
  directory.mkdir(parents=True, exist_ok=True)
  with open(directory / "strings.jsonl", "w") as f:
    for _ in range(n // 2):
      f.write(json.dumps({"prompt": f"Is {rng.randint(99)} a number?", "chosen": "yes yes yes",
                          "rejected": "no no no"}) + "\n")
  with open(directory / "conversations.jsonl", "w") as f:
    for i in range(n // 2):
      q = [{"role": "user", "content": f"Is {rng.randint(99)} even?"}]
      side = lambda text: q + [{"role": "assistant", "content": text}]
      # UltraFeedback's binarized layout: a string prompt, and whole conversations.
      # and TRL's implicit prompt: no "prompt", the conversations whole.
      obj = ({"prompt": q[0]["content"], "chosen": side("yes yes yes"), "rejected": side("no no no"),
              "score_chosen": 8.0} if i % 3 == 1 else
             {"chosen": side("yes yes yes"), "rejected": side("no no no")} if i % 3 == 2 else
             {"prompt": q, "chosen": side("yes yes yes")[1:], "rejected": side("no no no")[1:]})
      f.write(json.dumps(obj) + "\n")


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
  """A root with the preference set prepared (data/prefs) and a tiny random base (base/, a
  transformers directory)."""
  root = tmp_path_factory.mktemp("dpo")
  _write_prefs(root / "prefs")
  export.save_hf(random_model(Mamba2Config(**SMALL_MODEL, vocab_size=257), np.random.RandomState(5)),
                 root / "base")
  r = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--preference",
                      f"--source={root / 'prefs'}/*.jsonl", "--name=prefs", f"--root={root / 'data'}",
                      f"--seq_len={SEQ_LEN}", "--val_fraction=0.1"], cwd=ROOT, env=script_env(),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return root


def test_preference_rows_hold_the_pair_with_the_responses_masked(prefs):
  d = prefs / "data" / "prefs"
  meta = data.read_metadata(str(d))
  assert meta["packed"]["preference"] and meta["splits"]["train"]["rows"] + meta["splits"]["validation"]["rows"] == 32
  tokens, mask, seq_idx = (np.load(d / f"train.{k}.npy").astype(np.int64) for k in ("tokens", "loss_mask", "seq_idx"))
  for r in range(len(tokens)):
    for j, answer in ((0, b"yes yes yes"), (1, b"no no no")):
      side = seq_idx[r] == j
      text = bytes(t for t in tokens[r][side & (mask[r] == 1)] if t < 256)
      assert text == answer, (r, j, text)  # the last assistant turn alone (then EOS)
      assert b"<|user|>" in bytes(t for t in tokens[r][side] if t < 256)  # the prompt is rendered
  # A line without a pair is refused with what it needs.
  bad = prefs / "bad.jsonl"
  bad.write_text(json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
  with pytest.raises(data.ChatFormatError, match="needs 'chosen' and 'rejected'"):
    preference.read_pairs(str(bad))


def test_dpo_loss_and_metrics_against_torch():
  rng = np.random.RandomState(0)
  policy, reference = (rng.normal(-40, 5, (16, 2)).astype(np.float32) for _ in range(2))
  spec = dpo.DpoSpec(beta=0.3, label_smoothing=0.1)
  got = jax.tree.map(np.asarray, dpo.dpo_terms(jnp.asarray(policy), jnp.asarray(reference), spec))
  p, r = torch.from_numpy(policy).double(), torch.from_numpy(reference).double()
  chosen, rejected = 0.3 * (p[:, 0] - r[:, 0]), 0.3 * (p[:, 1] - r[:, 1])
  z = chosen - rejected
  want = {"loss": -0.9 * F.logsigmoid(z) - 0.1 * F.logsigmoid(-z), "rewards/chosen": chosen,
          "rewards/rejected": rejected, "rewards/margins": z, "rewards/accuracies": (chosen > rejected).double(),
          "logps/chosen": p[:, 0], "logps/rejected": p[:, 1]}
  assert set(got) == set(want) == {"loss", *dpo.METRICS}
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v.numpy(), rtol=1e-6, atol=1e-6, err_msg=k)


def _plan(prefs, **over):
  c = dpo_config.get_config()
  c.model.update(SMALL_MODEL, vocab_size=257)
  c.runtime.compute_dtype = "float32"
  c.update(seq_len=SEQ_LEN, batch_size=8, steps=4)
  c.data.dir = str(prefs / "data" / "prefs")
  for k, v in over.items():
    c.lora.update(**v) if k == "lora" else c.optim.update(**v)
  return run_config.validate(c, num_devices=1)


def _batch(prefs):
  loader = data.make_train_loader(str(prefs / "data" / "prefs"), seq_len=SEQ_LEN, global_batch_size=8, seed=0)
  return {k: jnp.asarray(v) for k, v in next(loader).items() if k in steps.BATCH_KEYS}


def test_response_logps_against_a_log_softmax_and_prompt_tokens_get_no_gradient(prefs):
  plan = _plan(prefs)
  model = random_model(plan.model, np.random.RandomState(1))
  batch = _batch(prefs)
  logits = np.asarray(model(batch["input_ids"], seq_idx=batch["seq_idx"]), np.float64)
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  tok = np.take_along_axis(logp, np.asarray(batch["targets"])[..., None], -1)[..., 0]
  mask, seq_idx = np.asarray(batch["loss_mask"]), np.asarray(batch["seq_idx"])
  want = np.stack([(tok * mask * (seq_idx == j)).sum(1) for j in (0, 1)], 1)
  assert rel(np.asarray(dpo.pair_logps(model, batch)), want) < 1e-6
  # The loss's gradient at the head's input, position by position: zero wherever the mask is.
  h, _ = model.backbone(batch["input_ids"], seq_idx=batch["seq_idx"])
  hn = model.final_norm(h)
  reference = jnp.asarray(want - 1.0, jnp.float32)

  def loss(hn):
    policy = -row_cross_entropy(hn, model.head_weight(), batch["targets"], dpo.response_weights(batch),
                                plan.model.vocab_size)
    return jnp.sum(dpo.dpo_terms(policy, reference, plan.dpo)["loss"])

  g = np.abs(np.asarray(jax.grad(loss)(hn))).sum(-1)
  assert np.all(g[mask == 0] == 0.0) and np.all(g[mask == 1] > 0.0)


def test_with_lora_the_first_step_loss_is_log_2_for_every_pair_and_the_recipes_rate_moves_it(prefs):
  """The policy starts as the reference, the base with the adapters off (without LoRA, a
  frozen copy: the end-to-end run below checks its first step); the recipe's adapter rate
  (lora.lr, 5e-5) then moves the loss, where its full finetune's (5e-7) left it at log 2."""
  plan = _plan(prefs, lora=dict(rank=4, targets="in_proj,out_proj"), optim=dict(schedule="constant",
                                                                               warmup_frac=0.0))
  assert plan.lr == 5e-5
  mesh = make_mesh(plan.config.mesh, shape=plan.mesh_shape)
  built = steps.build(plan, mesh, params=random_model(plan.model, np.random.RandomState(2)).params())
  batch = _batch(prefs)
  state = built.state
  policy = steps.model_of(state.params, state.frozen, plan.model, plan.runtime, plan.lora)
  reference = steps.model_of(jax.tree.map(jnp.zeros_like, state.params), state.frozen, plan.model, plan.runtime,
                             plan.lora)
  terms = dpo.dpo_terms(dpo.pair_logps(policy, batch), dpo.pair_logps(reference, batch), plan.dpo)
  np.testing.assert_allclose(np.asarray(terms["loss"]), math.log(2), rtol=1e-6)
  batch = steps.to_global({k: np.asarray(v) for k, v in batch.items()}, mesh)
  state, metrics = built.train_step(state, batch)
  assert abs(float(metrics["loss"]) - math.log(2)) < 1e-6 and abs(float(metrics["rewards/margins"])) < 1e-5
  # The warmup's first rate is 0; then 5e-5 a step. On this random base the loss falls by
  # about 1.1e-5 a step (at 5e-7: 1e-7, within float32's rounding of log 2).
  losses = []
  for _ in range(5):
    state, metrics = built.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  assert all(b < a for a, b in zip(losses, losses[1:])) and math.log(2) - losses[-1] > 2e-5, losses


def _dpo_run(prefs, workdir, *flags):
  """train.py on configs/dpo.py (written for 130m) from the tiny base, output captured."""
  env = dict(script_env(), XLA_FLAGS=FAST_XLA, PYTHONUNBUFFERED="1")
  return subprocess.run(
      [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "dpo.py"),
       "--workdir", str(workdir), f"--config.data.dir={prefs / 'data' / 'prefs'}",
       f"--config.init_from={prefs / 'base'}", f"--config.seq_len={SEQ_LEN}", "--config.batch_size=8",
       "--config.steps=8", "--config.log_every=1", "--config.eval_every=8", "--config.eval_batches=1",
       "--config.checkpoint_every=0", "--config.wandb.mode=disabled", "--config.runtime.compute_dtype=float32",
       *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_short_dpo_run_from_a_tiny_base_learns_to_prefer_the_chosen_responses(prefs, tmp_path):
  """The recipe is written for 130m: the run takes the base's architecture, says so in one line.
  (A full finetune, at a rate that moves the random base's small norms in 8 steps.)"""
  r = _dpo_run(prefs, tmp_path / "dpo", "--config.optim.lr=1e-2", "--config.optim.schedule=constant",
               "--config.optim.warmup_frac=0.0")
  assert r.returncode == 0, r.stderr[-3000:]
  recorded = json.loads((tmp_path / "dpo" / "config.json").read_text())["model"]
  assert Mamba2Config.from_dict(recorded) == load_config(prefs / "base")
  line, = [line for line in r.stderr.splitlines() if "config.model from init_from" in line]
  assert "d_model=64 (recipe: 768)" in line and "n_layer=2 (recipe: 24)" in line
  rows = [json.loads(line) for line in open(tmp_path / "dpo" / "metrics.jsonl")]
  train = {row["step"]: row for row in rows if "loss" in row}
  assert abs(train[1]["loss"] - math.log(2)) < 1e-6  # policy = reference
  assert train[8]["rewards/accuracies"] == 1.0 and train[8]["rewards/margins"] > 1.0
  assert train[8]["loss"] < 0.5 * math.log(2)
  assert [row["eval_loss"] for row in rows if "eval_loss" in row][0] < 0.5 * math.log(2)
  # DPO's figures in TensorBoard too, each at its step once.
  scalars = tensorboard_scalars(tmp_path / "dpo" / "tensorboard")
  assert scalars == record_scalars(rows) and "rewards/margins" in scalars


def test_a_model_field_set_on_the_command_line_that_init_from_contradicts_is_one_line(prefs, tmp_path):
  """Before anything is built: no workdir, no compile. (Agreeing fields, and chunk_size, which
  is in no weight, pass.)"""
  r = _dpo_run(prefs, tmp_path / "dpo", "--config.model.d_model=128", "--config.model.n_layer=2",
               "--config.model.chunk_size=32")
  assert r.returncode == 2 and not (tmp_path / "dpo").exists() and "compiled" not in r.stderr
  assert r.stderr.strip().splitlines()[-1] == (
      f"error: Invalid run config: config.model.d_model=128 on the command line contradicts init_from "
      f"'{prefs / 'base'}', whose model has d_model=64: drop it (the run takes init_from's architecture) "
      "or start from other weights")
