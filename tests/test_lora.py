"""LoRA adapters: a zero B is the base exactly; a step trains the adapters alone; a killed
LoRA run resumes to the uninterrupted run's losses; merged weights equal base + adapters."""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import Mamba2ForCausalLM

from configs import tiny
from mamba_train import Mamba2Config, Mamba2LM, generate, load_model
from mamba_train.interop import export, peft as peft_export
from mamba_train.model import lora, matmul, moe as moe_lib
from mamba_train.model.params import weight_names
from mamba_train.model.runtime import Runtime
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train import run_config, session, state as state_lib, step as steps
from mamba_train.workdir import checkpoint

from helpers import ROOT, SMALL_MODEL, patched, random_model, rel, script_env, train_command

HYBRID = dict(SMALL_MODEL, n_layer=4, layer_pattern="M*-M", attn_num_heads=2, d_intermediate=32,
              mlp_act="swiglu", vocab_size=61)


def _spec(cfg, rank=4, targets="*", base_dtype=""):
  from mamba_train.model.params import weight_names
  return lora.make_spec(rank, 8.0, 0.0, targets, base_dtype, weight_names(cfg))


def _noisy(adapters, seed=1, scale=0.05):
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [a + scale * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


def _logits(model, ids):
  """The model's logits, jitted: eagerly each of its ops is a compile of its own."""
  from flax import nnx
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, ids))


@pytest.fixture(scope="module")
def hybrid():
  cfg = Mamba2Config(**HYBRID)
  model = random_model(cfg, np.random.RandomState(0))
  ids = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 37)))  # a ragged tail
  return cfg, model, ids


def test_zero_b_is_the_base_exactly(hybrid):
  cfg, model, ids = hybrid
  spec = _spec(cfg)
  assert set(spec.targets) == {"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                               "gate_proj", "down_proj", "lm_head"}
  adapters = lora.init_adapters(model.params(), spec, jax.random.PRNGKey(0))
  assert all(np.all(np.asarray(ab["b"]) == 0) for ab in jax.tree.leaves(
      adapters, is_leaf=lambda x: isinstance(x, dict) and "b" in x))
  adapted = Mamba2LM.from_params(cfg, model.params(), adapters=adapters, lora=spec)
  np.testing.assert_array_equal(_logits(adapted, ids), _logits(model, ids))


def test_merged_weights_give_the_adapted_logits(hybrid):
  """Against an independent merge: each weight + scale * A @ B written out here in numpy."""
  cfg, model, ids = hybrid
  spec = _spec(cfg)
  adapters = _noisy(lora.init_adapters(model.params(), spec, jax.random.PRNGKey(0)))
  adapted = Mamba2LM.from_params(cfg, model.params(), adapters=adapters, lora=spec)
  base = jax.tree.map(np.asarray, model.params())
  ad = jax.tree.map(lambda a: np.asarray(a, np.float64), adapters)
  ref = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
  for stack, per in ad.items():
    if stack == "lm_head":
      ref["lm_head"] = base["embedding"] + spec.scale * (per["a"] @ per["b"]).T
      continue
    for target, ab in per.items():
      names = lora.TARGETS[target][1]
      delta = spec.scale * np.einsum("lir,lro->lio", ab["a"], ab["b"])
      start = 0
      for n in names:
        w = base[stack][n]
        size = int(np.prod(w.shape[1 + lora.TARGETS[target][2]:]))
        ref[stack][n] = w + delta[:, :, start:start + size].reshape(w.shape)
        start += size
  ref = jax.tree.map(lambda a: np.asarray(a, np.float32), ref)
  merged = Mamba2LM.from_params(cfg.replace(tie_embeddings=False), ref)
  got, want = np.asarray(adapted(ids)), np.asarray(merged(ids))
  assert rel(got, np.asarray(model(ids))) > 1e-2  # the adapters do change the model
  assert rel(got, want) < 1e-6
  assert rel(np.asarray(adapted.merged()(ids)), want) < 1e-6


# An MoE + attention hybrid with an untied head: weights a bfloat16 run holds in bfloat16 (the
# experts, k_proj and v_proj, the head) and weights it does not (the adapted ones, the router).
MOE_HYBRID = dict(SMALL_MODEL, d_model=32, n_layer=2, layer_pattern="E*", attn_num_heads=2, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                  vocab_size=61, tie_embeddings=False)


def test_a_base_held_in_the_compute_dtype_gives_the_per_step_casts_loss_and_gradients():
  """A bfloat16 run holds the frozen matmul weights its matmuls read in bfloat16 (`frozen_base`)
  instead of casting the float32 base in every layer of every step: the same loss and adapter
  gradients, bit for bit, as the float32 base cast per step; the rest stays float32."""
  cfg = Mamba2Config(**MOE_HYBRID)
  spec = lora.make_spec(4, 8.0, 0.0, "q_proj,o_proj", "", weight_names(cfg))
  abstract = lambda spec: jax.eval_shape(lambda p: lora.frozen_base(p, spec), state_lib.param_shapes(cfg))
  held = abstract(spec.replace(frozen_dtype="bfloat16"))
  bf16 = lambda t: {n for n, w in t.items() if w.dtype == jnp.bfloat16}
  assert bf16(held["moe"]) == set(moe_lib.MATMUL_WEIGHTS) & set(held["moe"]) and "router" in held["moe"]
  assert bf16(held["attn"]) == {"k_proj", "v_proj"}  # q_proj and o_proj have adapters merged into them
  assert held["lm_head"].dtype == jnp.bfloat16 and held["embedding"].dtype == held["norm_f"].dtype == jnp.float32
  # Beside the base (the separate path, with dropout) the adapted weights are read by the base's
  # matmul alone: held in bfloat16 too.
  separate = abstract(spec.replace(dropout=0.1, frozen_dtype="bfloat16"))
  assert bf16(separate["attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
  # The numbers, on the MoE layer alone (the attention layer's compile would double the cost).
  cfg = cfg.replace(n_layer=1, layer_pattern="E")
  spec = lora.make_spec(4, 8.0, 0.0, "lm_head", "", weight_names(cfg))
  base = random_model(cfg, np.random.RandomState(5)).params()
  as_stored, held = lora.frozen_base(base, spec), lora.frozen_base(base, spec.replace(frozen_dtype="bfloat16"))
  assert all(w.dtype == jnp.float32 for w in jax.tree.leaves(as_stored)) and bf16(held["moe"])
  rng = np.random.RandomState(6)
  adapters = jax.tree.map(lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape), jnp.float32),
                          lora.adapter_shapes(base, spec))
  ids = rng.randint(0, cfg.vocab_size, (2, 21))
  batch = {"input_ids": jnp.asarray(ids), "targets": jnp.asarray(np.roll(ids, -1, 1)),
           "seq_idx": jnp.zeros(ids.shape, jnp.int32), "loss_mask": jnp.ones(ids.shape, jnp.float32)}
  rt = Runtime(compute_dtype="bfloat16", remat="none")
  loss = jax.value_and_grad(lambda a, frozen: steps.loss_sums(a, batch, cfg, rt, frozen=frozen, lora=spec)[0])
  (want, want_g), (got, got_g) = jax.jit(lambda a, f, g: (loss(a, f), loss(a, g)))(adapters, as_stored, held)
  assert float(got) == float(want)
  jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), got_g, want_g)
  # A run's plan holds the base so when its matmuls run in bfloat16; a float32 run's base as stored.
  assert _plan(rank=4).lora.frozen_dtype == ""
  c = tiny.get_config()
  c.data.source, c.runtime.compute_dtype = "synthetic", "bfloat16"
  c.lora.rank = 4
  assert run_config.validate(c, num_devices=1).lora.frozen_dtype == "bfloat16"


def test_adapter_dropout_against_numpy():
  """y = x W + scale * dropout(x) A B (peft's Linear), against numpy on the same mask;
  the mask is inverted dropout's, and its expectation is the adapter without dropout."""
  rng = np.random.RandomState(5)
  x, w = rng.randn(3, 7, 16).astype(np.float32), rng.randn(16, 12).astype(np.float32)
  a, b = rng.randn(16, 4).astype(np.float32), rng.randn(4, 12).astype(np.float32)
  key, rate, scale = jax.random.PRNGKey(7), 0.25, 2.0
  ad = matmul.Adapter(jnp.asarray(a), jnp.asarray(b), key, scale, rate)
  got = np.asarray(matmul.linear(jnp.asarray(x), jnp.asarray(w), "float32", adapter=ad))
  mask = np.asarray(matmul.dropout_mask(key, x.shape, rate), np.float64)
  assert set(np.unique(mask)) == {0.0, float(np.float32(1.0) / np.float32(1.0 - rate))}
  keep = np.mean(mask > 0)  # binomial over 336 inputs: within 5 sigma of 1 - rate
  assert abs(keep - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / mask.size)
  x64 = x.astype(np.float64)
  want = x64 @ w + scale * ((x64 * mask) @ a) @ b
  assert rel(got, want) < 1e-6
  # Without a key (evaluation) there is no dropout.
  plain = matmul.Adapter(jnp.asarray(a), jnp.asarray(b), None, scale, rate)
  got = matmul.linear(jnp.asarray(x), jnp.asarray(w), "float32", adapter=plain)
  assert rel(got, x64 @ w + scale * x64 @ a @ b) < 1e-6
  # The mean over 4000 masks is the adapter without dropout (E[mask] = 1), to within
  # 5 standard errors of the mean, per element.
  keys = jax.random.split(jax.random.PRNGKey(8), 4000)
  deltas = np.asarray(jax.vmap(lambda k: matmul.Adapter(jnp.asarray(a), jnp.asarray(b), k, scale, rate)
                               .delta(jnp.asarray(x), jnp.float32))(keys), np.float64)
  exact = scale * x64 @ a @ b
  sem = deltas.std(axis=0) / np.sqrt(len(keys))
  assert np.all(np.abs(deltas.mean(axis=0) - exact) <= 5 * sem + 1e-6)


def test_dropout_runs_the_adapters_beside_the_base(hybrid):
  """A spec with dropout takes the separate path (x W + scale dropout(x) A B): without a
  key it is the merged model to float32 rounding, loss and adapter gradients alike;
  with a training step's key the masks are drawn, the same for the same key."""
  cfg, model, ids = hybrid
  merged_spec = _spec(cfg)
  spec = merged_spec.replace(dropout=0.1)
  assert spec.separate and not merged_spec.separate
  adapters = _noisy(lora.init_adapters(model.params(), spec, jax.random.PRNGKey(0)))
  batch = {"input_ids": ids, "targets": jnp.roll(ids, -1, 1), "seq_idx": jnp.zeros_like(ids),
           "loss_mask": jnp.ones(ids.shape, jnp.float32)}

  @functools.partial(jax.jit, static_argnums=(1,))
  def loss_and_grads(key, spec):
    f = lambda ad: steps.loss_sums(ad, batch, cfg, model.runtime, frozen=model.params(), lora=spec,
                                   dropout_key=key)[0]
    return jax.value_and_grad(f)(adapters)

  none = jnp.zeros((2,), jnp.uint32)  # a key that the merged spec ignores
  l0, g0 = loss_and_grads(none, merged_spec)
  ref = jax.jit(lambda: jax.value_and_grad(lambda ad: steps.loss_sums(
      ad, batch, cfg, model.runtime, frozen=model.params(), lora=spec)[0])(adapters))
  l1, g1 = ref()  # the separate path without a key: no dropout
  assert abs(float(l1) - float(l0)) <= 1e-6 * abs(float(l0))
  assert max(rel(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0))) < 1e-5
  la, _ = loss_and_grads(jax.random.PRNGKey(1), spec)
  lb, _ = loss_and_grads(jax.random.PRNGKey(1), spec)
  lc, _ = loss_and_grads(jax.random.PRNGKey(2), spec)
  assert float(la) == float(lb) and float(la) != float(lc) and float(la) != float(l1)


def test_bad_lora_settings_are_refused_before_any_work():
  c = tiny.get_config()
  c.lora.update(rank=4, targets="in_proj,qkv")
  with pytest.raises(run_config.ConfigError) as e:
    run_config.validate(c, num_devices=1)
  assert "lora.targets ['qkv'] match no LoRA target" in str(e.value)
  c.lora.update(targets="in_proj", dropout=1.0)
  with pytest.raises(run_config.ConfigError, match=r"lora.dropout must be in \[0, 1\)"):
    run_config.validate(c, num_devices=1)
  c.lora.update(dropout=0.0, base_dtype="int3")
  with pytest.raises(run_config.ConfigError, match="lora.base_dtype must be one of"):
    run_config.validate(c, num_devices=1)
  c.lora.update(rank=0, base_dtype="int8")
  with pytest.raises(run_config.ConfigError, match=r"\(QLoRA\) needs adapters: set lora.rank > 0"):
    run_config.validate(c, num_devices=1)


def _plan(**lora_cfg):
  c = tiny.get_config()
  c.model.update(SMALL_MODEL)
  c.update(seq_len=32, batch_size=4, steps=10)
  c.data.source = "synthetic"
  c.optim.update(schedule="constant", warmup_frac=0.0, lr=1e-2)
  c.lora.update(**lora_cfg)
  return run_config.validate(c, num_devices=1)


def _batch(plan, seed=0):
  rng = np.random.RandomState(seed)
  b, l = plan.config.batch_size, plan.config.seq_len
  ids = rng.randint(0, plan.model.vocab_size, (b, l + 1))
  return {"input_ids": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
          "seq_idx": np.zeros((b, l), np.int32), "loss_mask": np.ones((b, l), np.float32)}


def _one_step(plan, base):
  mesh = make_mesh(plan.config.mesh, shape=plan.mesh_shape)
  built = steps.build(plan, mesh, params=base)
  before = jax.tree.map(np.array, (built.state.params, built.state.frozen))
  state = built.state
  for _ in range(2):  # the first step's rate is 0 (one warmup step)
    state, metrics = built.train_step(state, steps.to_global(_batch(plan), mesh))
  return before, state, metrics


@pytest.fixture(scope="module")
def lora_step():
  """(plan, base, (adapters, frozen) before, the state and metrics after two LoRA steps)."""
  plan = _plan(rank=4, targets="in_proj,out_proj,lm_head")
  base = random_model(plan.model, np.random.RandomState(2)).params()
  return plan, base, *_one_step(plan, base)


def test_a_lora_step_changes_only_the_adapters(lora_step):
  plan, base, (adapters0, frozen0), state, metrics = lora_step
  # The base is kept as given (float32, not copied into the optimizer), bit for bit.
  for got, want, given in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(frozen0), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(want, np.asarray(given))
  # Only the adapters have optimizer state: Adam's moments mirror the adapter tree.
  adam = state.opt_state.inner_state[0 if plan.config.optim.clip_norm == 0 else 1]
  assert jax.tree.structure(adam.mu) == jax.tree.structure(state.params)
  # B moves off zero (A's gradient is zero while B is: it moves by weight decay only).
  for (path, new), old in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(adapters0)):
    assert np.any(np.asarray(new) != old), jax.tree_util.keystr(path)
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("base_dtype", ["int8", "int4"])
def test_qlora_step_trains_adapters_and_its_loss_is_within_the_quantization_error(lora_step, base_dtype):
  plan, base, _, _, metrics = lora_step
  (_, frozen_q), state_q, metrics_q = _one_step(_plan(rank=4, targets="in_proj,out_proj,lm_head",
                                                      base_dtype=base_dtype), base)
  quantized = [x for x in jax.tree.leaves(state_q.frozen, is_leaf=lora.is_quantized) if lora.is_quantized(x)]
  # in_proj x3 and out_proj; the tied head is also the embedding lookup, kept float32
  assert len(quantized) == 4 and all(q.qtype == getattr(jnp, base_dtype) for q in quantized)
  for got, want in zip(jax.tree.leaves(state_q.frozen), jax.tree.leaves(frozen_q)):
    np.testing.assert_array_equal(np.asarray(got), want)
  # The quantization error: the base's loss dequantized against float32, on the same batch.
  batch = _batch(plan)
  full = Mamba2LM.from_params(plan.model, base)
  deq = Mamba2LM.from_params(plan.model, jax.tree.map(lora.dense, frozen_q, is_leaf=lora.is_quantized))
  loss = lambda m: float(steps.loss_sums(m.params(), batch, plan.model, plan.runtime)[0] / batch["loss_mask"].sum())
  error = abs(loss(deq) - loss(full))
  assert 0 < error < (1e-2 if base_dtype == "int8" else 1e-1)
  assert abs(float(metrics_q["loss"]) - float(metrics["loss"])) <= 1.5 * error + 1e-6
  assert np.any(np.asarray(state_q.params["layers"]["in_proj"]["b"]) != 0)


# A LoRA run as a user runs one: from a transformers base, adapters on in_proj and the head
# (both of which peft loads), with dropout (so the resumed run must draw the masks the
# uninterrupted one drew), at a rate that moves them well off the base in 4 steps.
LORA_FLAGS = ["--config.lora.rank=4", "--config.lora.targets=in_proj,lm_head", "--config.lora.dropout=0.1",
              "--config.steps=4",
              "--config.checkpoint_every=2", "--config.optim.lr=0.05"]


def _run(cmd, env):
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _losses(workdir):
  return {row["step"]: row["loss"] for row in map(json.loads, open(workdir / "metrics.jsonl")) if "loss" in row}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  """(base dir, flags, the uninterrupted run's workdir)."""
  root = tmp_path_factory.mktemp("lora")
  base = random_model(_plan().model, np.random.RandomState(3))
  export.save_hf(base, root / "base")
  flags = [*LORA_FLAGS, f"--config.init_from={root / 'base'}"]
  r = _run(*train_command(root / "full", flags))
  assert r.returncode == 0, r.stderr[-3000:]
  return root / "base", flags, root / "full"


def _ids():
  return np.random.RandomState(4).randint(0, 257, (2, 37))


def test_lora_run_killed_after_a_save_resumes_to_the_uninterrupted_losses(lora_run, tmp_path):
  base, flags, full = lora_run
  # The same run, SIGKILLed right after its step-2 checkpoint is on disk, then restarted.
  kill = ("import os, signal\nfrom mamba_train.workdir import checkpoint\n_save = checkpoint.Checkpointer.save\n"
          "def save(self, step, *a, **k):\n  out = _save(self, step, *a, **k)\n"
          "  if step == 2:\n    self.manager.wait_until_finished(); os.kill(os.getpid(), signal.SIGKILL)\n"
          "  return out\ncheckpoint.Checkpointer.save = save")
  cmd, env = train_command(tmp_path / "cut", flags)
  r = _run(patched(cmd, kill), env)
  assert r.returncode == -9, r.stderr[-3000:]
  r = _run(cmd, env)
  assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
  want = _losses(full)
  assert [_losses(tmp_path / "cut")[s] for s in (1, 2, 3, 4)] == [want[s] for s in (1, 2, 3, 4)]
  # The checkpoint holds the adapters alone and names its base.
  step = tmp_path / "cut" / "checkpoints" / "4"
  assert sum(p.stat().st_size for p in (step / "state").rglob("*") if p.is_file()) < 100_000
  saved = checkpoint.saved_config(step)["lora_base"]
  assert saved["init_from"] == str(base) and saved["fingerprint"] == lora.fingerprint(load_model(base).params())
  # Resuming it with other adapters (or none) is refused before anything is built.
  ckpt = checkpoint.Checkpointer(tmp_path / "cut")
  with pytest.raises(run_config.ConfigError, match=r"holds checkpoints of LoRA adapters \(rank 4"):
    session.check_resumable(ckpt, _plan(rank=8, targets="in_proj,lm_head"), force=False)
  ckpt.close()


def test_merged_export_gives_the_adapted_logits(lora_run, tmp_path):
  _, _, full = lora_run
  adapted = load_model(full)
  assert adapted.lora is not None and adapted.lora.targets == ("in_proj", "lm_head")
  ids = jnp.asarray(_ids())
  want = np.asarray(adapted(ids))
  assert rel(want, np.asarray(load_model(lora_run[0])(ids))) > 1e-3  # the adapters moved the model
  export.save_hf(adapted.merged(), tmp_path / "hf")
  export.save_mamba_ssm(adapted.merged(), tmp_path / "ssm")
  for out in ("hf", "ssm"):
    assert rel(np.asarray(load_model(tmp_path / out)(ids)), want) < 1e-6, out
  with torch.no_grad():
    ref = Mamba2ForCausalLM.from_pretrained(tmp_path / "hf").eval()(torch.from_numpy(_ids())).logits.numpy()
  assert rel(want, ref) < 1e-5


def test_peft_export_loads_in_transformers_and_peft(lora_run, tmp_path):
  base, _, full = lora_run
  r = _run([sys.executable, str(ROOT / "scripts" / "export.py"), "--model", str(full), "--out",
            str(tmp_path / "adapters"), "--peft"], script_env())
  assert r.returncode == 0, r.stderr[-3000:]
  config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
  assert config["base_model_name_or_path"] == str(base) and config["lora_dropout"] == 0.1
  ref = PeftModel.from_pretrained(Mamba2ForCausalLM.from_pretrained(base), tmp_path / "adapters").eval()
  with torch.no_grad():
    got = ref(torch.from_numpy(_ids())).logits.numpy()
  assert rel(got, np.asarray(load_model(full)(jnp.asarray(_ids())))) < 1e-5
  # Adapters peft will not load are refused with the way out, before anything is written.
  cfg = _plan().model
  spec = _spec(cfg, targets="in_proj,out_proj")
  model = Mamba2LM.from_params(cfg, load_model(base).params(), lora=spec,
                               adapters=lora.init_adapters(load_model(base).params(), spec, jax.random.PRNGKey(0)))
  with pytest.raises(peft_export.PeftExportError, match="export them merged"):
    peft_export.save_peft(model, tmp_path / "refused")
  assert not (tmp_path / "refused").exists()


def test_generate_takes_checkpoint_as_an_alias_of_model(lora_run):
  _, _, full = lora_run
  r = _run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--checkpoint", str(full), "--ids=1,2,3",
            "--max_new_tokens=4", "--ignore_eos"], script_env())
  assert r.returncode == 0, r.stderr[-3000:]
  want = generate(load_model(full), [1, 2, 3], 4)[3:]
  assert ",".join(str(int(t)) for t in want) in r.stdout.splitlines()
