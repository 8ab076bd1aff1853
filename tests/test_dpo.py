"""DPO: the loss and reward metrics against torch on the same log-probabilities; response
log-probabilities against a direct log-softmax; prompt tokens get no gradient; log 2 at
the first step (policy = reference, with LoRA too); the preparation of TRL's layouts; a
short run on a synthetic preference set learns to prefer the chosen responses."""

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
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train import dpo, run_config, step as steps
from mamba_train.train.loss import row_cross_entropy

from helpers import FAST_XLA, ROOT, SMALL_MODEL, random_model, rel, script_env

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
  root = tmp_path_factory.mktemp("dpo")
  _write_prefs(root / "prefs")
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


def test_with_lora_the_first_step_loss_is_log_2_for_every_pair(prefs):
  """The policy starts as the reference, the base with the adapters off (without LoRA, a
  frozen copy: the end-to-end run below checks its first step)."""
  plan = _plan(prefs, lora=dict(rank=4, targets="in_proj,out_proj"))
  mesh = make_mesh(plan.config.mesh, shape=plan.mesh_shape)
  built = steps.build(plan, mesh, params=random_model(plan.model, np.random.RandomState(2)).params())
  batch = _batch(prefs)
  state = built.state
  policy = steps.model_of(state.params, state.frozen, plan.model, plan.runtime, plan.lora)
  reference = steps.model_of(jax.tree.map(jnp.zeros_like, state.params), state.frozen, plan.model, plan.runtime,
                             plan.lora)
  terms = dpo.dpo_terms(dpo.pair_logps(policy, batch), dpo.pair_logps(reference, batch), plan.dpo)
  np.testing.assert_allclose(np.asarray(terms["loss"]), math.log(2), rtol=1e-6)
  _, metrics = built.train_step(state, steps.to_global({k: np.asarray(v) for k, v in batch.items()}, mesh))
  assert abs(float(metrics["loss"]) - math.log(2)) < 1e-6 and abs(float(metrics["rewards/margins"])) < 1e-5


def test_a_short_dpo_run_learns_to_prefer_the_chosen_responses(prefs, tmp_path):
  env = dict(script_env(), XLA_FLAGS=FAST_XLA, PYTHONUNBUFFERED="1")
  flags = [f"--config.model.{k}={v}" for k, v in {**SMALL_MODEL, "vocab_size": 257}.items()]
  r = subprocess.run(
      [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "dpo.py"),
       "--workdir", str(tmp_path / "dpo"), f"--config.data.dir={prefs / 'data' / 'prefs'}", *flags,
       f"--config.seq_len={SEQ_LEN}", "--config.batch_size=8", "--config.steps=8", "--config.log_every=1",
       "--config.eval_every=8", "--config.eval_batches=1", "--config.checkpoint_every=0",
       "--config.wandb.mode=disabled", "--config.runtime.compute_dtype=float32", "--config.optim.lr=3e-3",
       "--config.optim.schedule=constant", "--config.optim.warmup_frac=0.0"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(line) for line in open(tmp_path / "dpo" / "metrics.jsonl")]
  train = {row["step"]: row for row in rows if "loss" in row}
  assert abs(train[1]["loss"] - math.log(2)) < 1e-6  # policy = reference
  assert train[8]["rewards/accuracies"] == 1.0 and train[8]["rewards/margins"] > 1.0
  assert train[8]["loss"] < 0.5 * math.log(2)
  assert [row["eval_loss"] for row in rows if "eval_loss" in row][0] < 0.5 * math.log(2)
