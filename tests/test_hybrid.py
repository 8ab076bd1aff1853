"""Hybrid models (`layer_pattern`): against transformers' NemotronHForCausalLM on
identical random weights (logits, greedy tokens, export and from_pretrained),
cached decoding against the full forward, packed documents against each
document alone, the attention forms against the reference, and how patterns
are planned into scans."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import NemotronHConfig, NemotronHForCausalLM

import mamba_train
from mamba_train import Mamba2Config, Mamba2LM, load_model
from mamba_train.generation import prefill
from mamba_train.interop import convert, files, mamba_ssm as mamba_ssm_layout, nemotron_h
from mamba_train.interop.export import save_mamba_ssm
from mamba_train.model import attention as attn_lib, pattern as pattern_lib
from mamba_train.model.cache import CACHE_AXES, Mamba2Cache
from mamba_train.ops import attention as attention_ops, attention_tpu
from mamba_train.parallel import sharding

import reference_checks
from helpers import rel, skip_on_known_transformers_bug, step_through

forward = nnx.jit(lambda model, ids, seq_idx=None: model(ids, seq_idx=seq_idx))


# Three small NemotronH configs: different patterns (attention first, MLP first,
# an irregular one), grouped-query and multi-head attention, Mamba groups 1 and 2.
# transformers never ties NemotronH's head, so every one has its own.
COMMON = dict(hidden_size=32, vocab_size=90, ssm_state_size=8, mamba_head_dim=16,
              mamba_num_heads=4, chunk_size=8, head_dim=8, intermediate_size=48,
              pad_token_id=0, bos_token_id=0, eos_token_id=0)
SMALL = {
    "gqa_M*M-": dict(layers_block_type=["mamba", "attention", "mamba", "mlp"], n_groups=2,
                     num_attention_heads=4, num_key_value_heads=2),
    "mha_-M*M*": dict(layers_block_type=["mlp", "mamba", "attention", "mamba", "attention"],
                      n_groups=1, num_attention_heads=4, num_key_value_heads=4),
    "mqa_*MM-M": dict(layers_block_type=["attention", "mamba", "mamba", "mlp", "mamba"],
                      n_groups=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16),
}


def hf_model(path, seed, **kw):
  torch.manual_seed(seed)
  model = NemotronHForCausalLM(NemotronHConfig(**{**COMMON, **kw})).eval()
  # Spread what transformers initialises to constants, so every head and norm
  # differs. dt stays above time_step_min (0.001): transformers clamps it there
  # in the chunked forward but not when it decodes one token.
  with torch.no_grad():
    for layer in model.model.layers:
      layer.norm.weight.normal_(1.0, 0.2)
      if layer.block_type == "linear_attention":
        layer.mixer.A_log.uniform_(-1.0, 2.5)
        layer.mixer.dt_bias.uniform_(-3.0, 0.0)
        layer.mixer.D.normal_(1.0, 0.5)
        layer.mixer.norm.weight.normal_(1.0, 0.2)
  model.save_pretrained(path)
  return model


@pytest.fixture(scope="module", params=list(SMALL))
def pair(request, tmp_path_factory):
  path = tmp_path_factory.mktemp("nemotron_h")
  ref = hf_model(path, seed=list(SMALL).index(request.param), **SMALL[request.param])
  return request.param, ref, load_model(path)


def test_config_read(pair):
  name, ref, ours = pair
  c = ours.config
  assert c.pattern == "".join({"mamba": "M", "attention": "*", "mlp": "-"}[k]
                              for k in SMALL[name]["layers_block_type"])
  assert (c.attn_num_heads, c.n_kv_heads, c.ngroups) == (
      ref.config.num_attention_heads, ref.config.num_key_value_heads, ref.config.n_groups)
  assert c.dt_limit == (0.001, np.inf) and not c.tie_embeddings


def test_logits_match_transformers(pair):
  _, ref, ours = pair
  skip_on_known_transformers_bug(ref.config)
  reference_checks.assert_logits_match(ref, ours)


def test_greedy_matches_transformers(pair):
  _, ref, ours = pair
  skip_on_known_transformers_bug(ref.config)
  reference_checks.assert_greedy_matches(ref, ours, 12)


def test_export_then_from_pretrained(tmp_path):
  """A hybrid built here (tied head, its own init) -> transformers -> the same
  logits; and back through load_model, bit-exact."""
  cfg = Mamba2Config(d_model=32, n_layer=4, d_state=8, headdim=16, ngroups=2, chunk_size=8,
                     vocab_size=90, layer_pattern="M*-M", attn_num_heads=4, attn_num_heads_kv=2,
                     attn_head_dim=8, d_intermediate=48)
  ours = Mamba2LM(cfg, rngs=nnx.Rngs(3))
  ref = reference_checks.export_to_transformers(ours, tmp_path / "out")
  back = reference_checks.assert_export_round_trip(ref, ours, tmp_path / "out")
  assert back.config.pattern == cfg.pattern and not back.config.tie_embeddings
  # What serving engines read: the pattern as either key gives transformers the same
  # layers (hybrid_override_pattern alone, as older readers take it), and the SSM
  # state's dtype.
  written = files.read_json(tmp_path / "out" / files.CONFIG_FILE)
  assert written["hybrid_override_pattern"] == "M*-M" and ref.config.mamba_ssm_cache_dtype == "float32"
  (tmp_path / "older").mkdir()
  (tmp_path / "older" / files.CONFIG_FILE).write_text(
      json.dumps({k: v for k, v in written.items() if k != "layers_block_type"}))
  older = NemotronHConfig.from_pretrained(tmp_path / "older")
  assert older.layers_block_type == ref.config.layers_block_type == [
      "linear_attention", "full_attention", "mlp", "linear_attention"]
  for k, v in ours.params().items():
    if k != "embedding":
      jax.tree.map(np.testing.assert_array_equal, back.params()[k], v)
  # The export holds the true vocabulary; padding rows read back as zeros.
  np.testing.assert_array_equal(back.params()["lm_head"][:90], ours.params()["embedding"][:90])
  with pytest.raises(ValueError, match="every block"):  # 'M*-M': a mixer without an MLP
    save_mamba_ssm(ours, tmp_path / "ssm")


def test_nemotron_h_refusals():
  base = nemotron_h.ours_to_nemotron_h_config(HYB)
  with pytest.raises(ValueError, match="kinds"):
    nemotron_h.nemotron_h_config_to_ours({**base, "layers_block_type": ["mamba", "dense", "attention"]})
  with pytest.raises(ValueError, match="mlp_hidden_act"):
    nemotron_h.nemotron_h_config_to_ours({**base, "mlp_hidden_act": "gelu"})
  with pytest.raises(ValueError, match="rotary"):
    nemotron_h.ours_to_nemotron_h_config(HYB.replace(attn_rotary_emb_dim=4))
  with pytest.raises(ValueError, match="squared ReLU"):
    nemotron_h.ours_to_nemotron_h_config(HYB.replace(mlp_act="swiglu"))


# ----------------------------------------------------------------------------
# The model's own paths, on one hybrid with every kind, rotary and GQA.

HYB = Mamba2Config(d_model=32, n_layer=6, d_state=8, headdim=16, ngroups=2, chunk_size=8,
                   vocab_size=64, layer_pattern="M*-M*-", attn_num_heads=4, attn_num_heads_kv=2,
                   attn_head_dim=8, d_intermediate=48)


@pytest.fixture(scope="module")
def hyb():
  return Mamba2LM(HYB.replace(attn_rotary_emb_dim=4), rngs=nnx.Rngs(0))


def test_cached_decoding_equals_full_forward(hyb):
  ids = jax.random.randint(jax.random.key(1), (2, 19), 0, 64)
  full = forward(hyb, ids)
  run = jax.jit(lambda p, ids: prefill(nnx.merge(gd, p), ids, capacity=19))
  gd, params = nnx.split(hyb)
  logits, cache = run(params, ids[:, :11])
  # A fixed-size buffer: capacity positions, the prompt's valid, the rest not yet.
  assert cache.k.shape == (2, 2, 19, 2, 8) and cache.kv_valid[:, :, :11].all()
  assert not cache.kv_valid[:, :, 11:].any() and (np.asarray(cache.kv_pos) == 11).all()
  assert cache.nbytes == Mamba2Cache.bytes_for(hyb.config, 2, 19)
  assert Mamba2Cache.bytes_per_position(hyb.config, 2) == 2 * 2 * (2 * 2 * 8 * 4 + 1)
  got = step_through(gd, params, cache, ids, 11, 18)
  assert rel(jnp.concatenate([logits[:, None], got], 1), full[:, 10:18]) < 1e-5
  # (generate's on-device loop, with left padding, is held against transformers above.)


def test_packed_row_equals_each_document_alone(hyb):
  """Documents packed in one row with seq_idx give each document's own logits
  through every layer kind (a leak in any one layer would show in the logits)."""
  model = hyb
  rng = np.random.default_rng(0)
  lens = (7, 13, 4)
  docs = [rng.integers(0, 64, n) for n in lens]
  row = jnp.asarray(np.concatenate(docs))[None]
  seq_idx = jnp.asarray(np.repeat(np.arange(3), lens))[None]
  packed = np.asarray(forward(model, row, seq_idx))[0]
  # Each document alone in its own row, right-padded: causal, so the padding after
  # a document cannot touch its logits.
  alone = np.zeros((3, 13), np.int32)
  for i, d in enumerate(docs):
    alone[i, :len(d)] = d
  alone = np.asarray(forward(model, jnp.asarray(alone), jnp.zeros((3, 13), jnp.int32)))
  start = 0
  for i, n in enumerate(lens):
    assert rel(packed[start:start + n], alone[i, :n]) < 1e-5
    start += n
  # As one document, the later ones do see the earlier ones.
  one_doc = np.asarray(forward(model, row, jnp.zeros_like(seq_idx)))[0]
  assert rel(one_doc[7:20], packed[7:20]) > 1e-3


def test_attention_forms_agree():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, 9, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, 9, 2, 8)), jnp.float32) for _ in range(2))
  seq_idx = jnp.asarray([[0] * 4 + [1] * 5, [0] * 9])
  mask = jnp.asarray([[True] * 9, [False] * 3 + [True] * 6])
  ok = attention_ops.allowed(9, 9, seq_idx=seq_idx, key_mask=mask)
  attend = jax.jit(attention_ops.attend, static_argnums=(4, 5))
  ref = attend(q, k, v, ok, "xla", jnp.float32)
  got = attend(q, k, v, ok, "dot_product", jnp.float32)
  assert rel(got, ref) < 1e-6
  causal = attention_ops.allowed(9, 9)
  assert rel(attend(q, k, v, None, "dot_product", jnp.float32),
             attend(q, k, v, causal, "xla", jnp.float32)) < 1e-6
  np.testing.assert_array_equal(attend(q, k, v, None, "xla", jnp.float32),
                                attend(q, k, v, causal, "xla", jnp.float32))
  # Independent: loops over heads with a numpy softmax.
  qn, kn, vn, okn = (np.asarray(a, np.float64) for a in (q, k, v, ok))
  for b in range(2):
    for h in range(4):
      s = qn[b, :, h] @ kn[b, :, h // 2].T / np.sqrt(8)
      s = np.where(okn[b], s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      np.testing.assert_allclose(ref[b, :, h], (p / p.sum(-1, keepdims=True)) @ vn[b, :, h // 2],
                                 rtol=1e-5, atol=1e-6)


def test_splash_kernel_agrees_in_interpret_mode():
  """The TPU Pallas splash kernel (run by the Pallas interpreter on this CPU)
  against the reference: documents, left padding, GQA, and its gradient."""
  rng = np.random.default_rng(1)
  l = 128  # the kernel's smallest block
  # One row (the interpreter is slow): left padding, then two documents; two
  # query heads on one kv head.
  q = jnp.asarray(rng.normal(size=(1, l, 2, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, l, 1, 16)), jnp.float32) for _ in range(2))
  seq_idx = jnp.asarray([[0] * 60 + [1] * 68])
  mask = jnp.asarray([[False] * 9 + [True] * (l - 9)])
  ref = lambda q: attention_ops.attend(q, k, v, attention_ops.allowed(l, l, seq_idx=seq_idx, key_mask=mask),
                                  "xla", jnp.float32)
  # Jitted: the interpreter runs op by op otherwise, five times slower.
  got = jax.jit(lambda q: attention_tpu.splash(q, k, v, seq_idx, mask, jnp.float32, interpret=True))
  real = np.asarray(mask)[:, :, None, None]  # padding queries' outputs are never used
  assert rel(np.where(real, got(q), 0), np.where(real, ref(q), 0)) < 1e-5
  loss = lambda f: lambda q: jnp.sum(jnp.where(real, f(q), 0.0) ** 2)
  assert rel(jax.jit(jax.grad(loss(got)))(q), jax.grad(loss(ref))(q)) < 1e-5


def test_tokamax_attention_path_agrees(monkeypatch):
  """`attention_gpu.flash` (attention='tokamax') against the reference: documents, left
  padding, GQA, forward and the gradients to q, k and v, through a shard function as
  the mesh runs it; and plain causal attention without one. tokamax's Triton kernels have
  no interpreter on CPU, so tokamax's
  XLA implementation stands in for them: what is checked is our segments, mask, scale,
  head grouping and layouts around tokamax's API; the kernels' sm_90a compile and their
  count are in `test_moe.py::test_tokamax_experts_compile_for_h100`."""
  from mamba_train.ops import attention_gpu
  try:
    attention_gpu.import_tokamax()
  except ImportError as err:
    pytest.skip(f"tokamax (the gpu extra) absent: {err}")
  monkeypatch.setattr(attention_gpu, "IMPLEMENTATION", "xla")
  rng = np.random.default_rng(2)
  l = 24
  q = jnp.asarray(rng.normal(size=(2, l, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, l, 2, 8)), jnp.float32) for _ in range(2))
  seq_idx = jnp.asarray([[0] * 10 + [1] * 14, [0] * l])
  mask = jnp.asarray([[True] * l, [False] * 5 + [True] * (l - 5)])
  real = np.asarray(mask)[:, :, None, None]  # padding queries' outputs are never used
  ok = attention_ops.allowed(l, l, seq_idx=seq_idx, key_mask=mask)
  def both(f):  # the outputs of real queries and the gradients of a loss of them
    def loss(q, k, v):
      out = jnp.where(real, f(q, k, v), 0.0)
      return jnp.sum(jnp.sin(out)), out
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

  (_, want), g_want = both(lambda q, k, v: attention_ops.attend(q, k, v, ok, "xla", jnp.float32, 0.3))
  shard = lambda run, *xs: run(*xs)  # the mesh's layout around the call, on one device
  (_, got), g_got = both(lambda q, k, v: attention_gpu.flash(q, k, v, seq_idx, mask, jnp.float32, 0.3, shard=shard))
  assert rel(got, want) < 1e-5
  for a, b in zip(g_got, g_want):
    assert rel(a, b) < 1e-5
  # Without documents or padding: tokamax's causal path alone, no shard function.
  causal = attention_ops.attend(q, k, v, None, "xla", jnp.float32)
  assert rel(jax.jit(attention_gpu.flash, static_argnums=(5,))(q, k, v, None, None, jnp.float32), causal) < 1e-5


def test_patterns_plan_into_scans():
  p = pattern_lib.plan("MMMM*MMM" * 6)
  assert (p.period, p.repeats) == ("MMMM*MMM", 6)
  assert [(r.kind, r.start, r.length) for r in p.runs] == [("M", 0, 4), ("*", 0, 1), ("M", 4, 3)]
  p = pattern_lib.plan("MM*M-")  # irregular: once, a scan per run
  assert (p.repeats, len(p.runs)) == (1, 4)
  assert pattern_lib.plan("M" * 24).period == "M"

  # Compile size is flat in depth: the program for 2 periods equals that for 12,
  # but for the scan lengths.
  def program(repeats):
    cfg = HYB.replace(n_layer=6 * repeats, layer_pattern=HYB.layer_pattern * repeats)
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    gd, st = nnx.split(model)
    text = str(jax.make_jaxpr(lambda s, ids: nnx.merge(gd, s)(ids))(st, jnp.zeros((1, 8), jnp.int32)))
    return text.count(" = "), text.count("dot_general")  # equations (lines wrap with shapes)
  assert program(2) == program(3) == program(12)


def test_pure_model_unchanged():
  cfg = Mamba2Config(d_model=32, n_layer=3, d_state=8, headdim=16, vocab_size=64)
  model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
  assert set(model.params()) == {"embedding", "norm_f", "layers"}
  explicit = Mamba2LM(cfg.replace(layer_pattern="MMM"), rngs=nnx.Rngs(0))
  jax.tree.map(np.testing.assert_array_equal, model.params(), explicit.params())
  assert Mamba2Cache.bytes_for(cfg, 1, 1000) == Mamba2Cache.bytes_for(cfg, 1)


def test_param_and_cache_axes_have_rules(hyb):
  from mamba_train.train.state import param_logical_axes
  axes = param_logical_axes(hyb.config)
  assert axes["attn"]["q_proj"] == ("layers", "embed", "attn_heads", None)
  assert axes["mlp"]["up_proj"] == ("layers", "embed", "mlp")
  for leaf in jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)):
    spec = sharding.logical_to_spec(leaf)
    assert "tensor" not in str(spec) or any(a in leaf for a in (
        "inner", "inner_fsdp", "heads", "vocab", "attn_heads", "kv_heads", "mlp")), leaf
  assert sharding.logical_to_spec(axes["attn"]["o_proj"]) == jax.sharding.PartitionSpec(
      None, "tensor", None, "fsdp")
  for name in ("k", "v", "kv_valid", "kv_pos"):
    assert sharding.logical_to_spec(CACHE_AXES[name])


@pytest.mark.parametrize("kw, match", [
    (dict(layer_pattern="M*E"), "n_routed_experts"),
    (dict(layer_pattern="M*x"), "must be one of"),
    (dict(layer_pattern="M*"), "n_layer"),
    (dict(layer_pattern="M*-", attn_num_heads=0), "attn_num_heads"),
    (dict(layer_pattern="M*-", attn_num_heads=3), "multiple of attn_num_heads_kv"),
    (dict(layer_pattern="M*-", d_intermediate=0), "d_intermediate"),
    (dict(layer_pattern="M*-", mlp_act="gelu"), "mlp_act"),
    (dict(layer_pattern="M*-", attn_rotary_emb_dim=3), "attn_rotary_emb_dim"),
])
def test_bad_pattern_config(kw, match):
  base = dict(d_model=32, n_layer=3, headdim=16, attn_num_heads=4, attn_num_heads_kv=2,
              attn_head_dim=8, d_intermediate=48)
  with pytest.raises(ValueError, match=match):
    Mamba2Config(**{**base, **kw})


def test_public_sizes():
  for name in ("1.3b-hybrid", "2.7b-hybrid"):
    cfg = mamba_train.config_for(name)
    assert cfg.count("*") * 8 == cfg.n_layer and "**" not in cfg.pattern
    assert cfg.attn_num_heads * cfg.attn_head_dim == cfg.d_model


# ----------------------------------------------------------------------------
# mamba_ssm's hybrid layout (attn_layer_idx, attn_cfg, d_intermediate).


def test_mamba_ssm_hybrid_import_matches_transformers(tmp_path):
  """mamba_ssm's MHA holds what NemotronH's attention does (no biases, no rotary),
  in one in_proj: the same random weights written both ways give the same logits."""
  kw = dict(layers_block_type=["mamba", "attention", "mamba"], n_groups=2,
            num_attention_heads=4, num_key_value_heads=2)
  ref = hf_model(tmp_path / "hf", seed=7, **kw)
  sd = {k: v.clone() for k, v in ref.state_dict().items()}
  ssm = {"backbone.embedding.weight": sd.pop("model.embeddings.weight"),
         "backbone.norm_f.weight": sd.pop("model.norm_f.weight"), "lm_head.weight": sd.pop("lm_head.weight")}
  a = "model.layers.1.mixer."
  ssm["backbone.layers.1.mixer.in_proj.weight"] = torch.cat(
      [sd.pop(a + "q_proj.weight"), sd.pop(a + "k_proj.weight"), sd.pop(a + "v_proj.weight")])
  ssm["backbone.layers.1.mixer.out_proj.weight"] = sd.pop(a + "o_proj.weight")
  ssm.update({"backbone." + k[len("model."):]: v for k, v in sd.items()})
  config = {"d_model": 32, "n_layer": 3, "vocab_size": 90, "d_intermediate": 0,
            "ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2,
                        "chunk_size": 8, "dt_limit": [0.001, float("inf")]},
            "attn_layer_idx": [1], "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "head_dim": 8,
                                                "qkv_proj_bias": False, "out_proj_bias": False,
                                                "causal": True},
            "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
            "pad_vocab_size_multiple": 16, "tie_embeddings": False}
  out = tmp_path / "ssm"
  out.mkdir()
  torch.save(ssm, out / "pytorch_model.bin")
  (out / "config.json").write_text(__import__("json").dumps(config))
  ours = load_model(out)
  assert ours.config.pattern == "M*M" and ours.config.n_kv_heads == 2
  reference_checks.assert_logits_match(ref, ours, length=13, seed=2)
  # mamba_ssm's MHA defaults to biases, which these layers do not have: refused by name.
  bad = dict(config, attn_cfg={"num_heads": 4})
  with pytest.raises(ValueError, match="qkv_proj_bias"):
    mamba_ssm_layout.mamba_ssm_config_to_ours(bad)


def test_mamba_ssm_hybrid_with_gated_mlp_round_trips(tmp_path):
  cfg = HYB.replace(n_layer=4, layer_pattern="M-*-", mlp_act="swiglu", d_intermediate=128,
                    attn_rotary_emb_dim=4)
  ours = Mamba2LM(cfg, rngs=nnx.Rngs(4))
  save_mamba_ssm(ours, tmp_path / "ssm")
  mc = files.read_json(tmp_path / "ssm" / "config.json")
  assert (mc["n_layer"], mc["attn_layer_idx"], mc["d_intermediate"]) == (2, [1], 128)
  back = load_model(tmp_path / "ssm")
  assert back.config == cfg
  jax.tree.map(np.testing.assert_array_equal, back.params(), ours.params())
  # GatedMLP: y, gate = fc1(x).chunk(2); fc2(y * silu(gate)), against our MLP on the
  # arrays the codec made.
  sd = convert.params_to_state_dict(ours.params(), cfg, "mamba_ssm")
  fc1, fc2 = sd["backbone.layers.0.mlp.fc1.weight"], sd["backbone.layers.0.mlp.fc2.weight"]
  x = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32)
  y, gate = np.split(x @ fc1.T, 2, axis=-1)
  want = (y * gate / (1 + np.exp(-gate))) @ fc2.T
  p = jax.tree.map(lambda a: a[0], ours.layer_params("-"))
  got = attn_lib.mlp(p, jnp.asarray(x), cfg, ours.runtime)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="GatedMLP"):
    mamba_ssm_layout.ours_to_mamba_ssm_config(cfg.replace(mlp_act="relu2"))
  with pytest.raises(ValueError, match="every block"):
    mamba_ssm_layout.ours_to_mamba_ssm_config(HYB)  # 'M*-M*-': a mixer without its MLP
