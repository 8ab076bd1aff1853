"""Export to and import from transformers and mamba_ssm layouts."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from transformers import AutoTokenizer, Mamba2Config as HFConfig, Mamba2ForCausalLM

import mamba_train
from mamba_train import Mamba2Config, Mamba2LM, load_model
from mamba_train.data import byte_tokenizer
from mamba_train.interop import export

from helpers import ROOT, rel

CFG = Mamba2Config(d_model=64, n_layer=2, d_state=16, headdim=16, ngroups=2, chunk_size=16,
                   vocab_size=257)
forward = nnx.jit(lambda model, ids: model(ids))


@pytest.fixture(scope="module")
def model():
  m = Mamba2LM(CFG, rngs=nnx.Rngs(3))
  # Sharpen the random model so greedy choices are well separated.
  p = m.params()
  p["embedding"] = p["embedding"] * 20.0
  return Mamba2LM.from_params(CFG, p)


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
  out = tmp_path_factory.mktemp("hf") / "model"
  tok = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  byte_tokenizer().save(str(tok))
  export.save_hf(model, out, tokenizer_file=tok, eos_token="<|endoftext|>", eos_token_id=256)
  return out


def test_hf_export_loads_in_transformers(model, hf_dir):
  ref = Mamba2ForCausalLM.from_pretrained(hf_dir).eval()
  c = ref.config
  assert (c.hidden_size, c.num_heads, c.head_dim, c.n_groups, c.state_size, c.expand,
          c.conv_kernel, c.chunk_size, c.vocab_size, c.num_hidden_layers) == (
              64, 8, 16, 2, 16, 2, 4, 16, 257, 2)
  assert c.tie_word_embeddings and c.eos_token_id == 256
  assert c.time_step_limit[1] == float("inf")
  ids = np.random.RandomState(0).randint(0, 257, (2, 40))
  with torch.no_grad():
    theirs = ref(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(forward(model, jnp.asarray(ids)))
  assert rel(ours, theirs) < 1e-5
  # Greedy continuations of 32 tokens are identical.
  prompt = ids[:1, :10]
  with torch.no_grad():
    g_theirs = ref.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False,
                            eos_token_id=None, pad_token_id=0).numpy()
  g_ours = np.asarray(mamba_train.generate(model, prompt, 32))
  np.testing.assert_array_equal(g_ours, g_theirs)


def test_hf_export_ships_the_tokenizer(hf_dir):
  tok = AutoTokenizer.from_pretrained(hf_dir)
  assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 256
  assert tok.decode(tok.encode("héllo")) == "héllo"


def _random_hf(tmp_path, **kw):
  torch.manual_seed(0)
  hf = Mamba2ForCausalLM(HFConfig(**kw)).eval()
  hf.save_pretrained(tmp_path)
  return hf


def test_hf_round_trip_is_exact(tmp_path):
  src = tmp_path / "src"
  _random_hf(src, hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16,
             chunk_size=16, vocab_size=100, num_hidden_layers=2, tie_word_embeddings=False)
  out = tmp_path / "out"
  export.save_hf(load_model(src), out)
  a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  ca, cb = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
  for key in ("hidden_size", "num_heads", "head_dim", "n_groups", "state_size", "expand",
              "conv_kernel", "chunk_size", "vocab_size", "tie_word_embeddings", "time_step_limit",
              "layer_norm_epsilon", "num_hidden_layers", "residual_in_fp32"):
    assert ca[key] == cb[key], key


def mamba_ssm_state_dict(d_model=64, n_layer=2, vocab=50, d_state=16, headdim=16, seed=0):
  """A state dict in the released checkpoints' names and shapes (tiny sizes)."""
  rng = np.random.RandomState(seed)
  d_inner, nheads = 2 * d_model, 2 * d_model // headdim
  conv_dim = d_inner + 2 * d_state
  rows = -(-vocab // 16) * 16
  t = lambda *s, scale=0.1: torch.tensor(rng.randn(*s).astype(np.float32) * scale)
  sd = {"backbone.embedding.weight": t(rows, d_model, scale=1.0),
        "backbone.norm_f.weight": 1 + t(d_model)}
  for i in range(n_layer):
    p = f"backbone.layers.{i}."
    sd.update({
        p + "norm.weight": 1 + t(d_model),
        p + "mixer.in_proj.weight": t(2 * d_inner + 2 * d_state + nheads, d_model),
        p + "mixer.conv1d.weight": t(conv_dim, 1, 4, scale=0.5),
        p + "mixer.conv1d.bias": t(conv_dim),
        p + "mixer.dt_bias": t(nheads, scale=1.0) - 3,
        p + "mixer.A_log": torch.log(torch.tensor(rng.uniform(1, 16, nheads).astype(np.float32))),
        p + "mixer.D": 1 + t(nheads),
        p + "mixer.norm.weight": 1 + t(d_inner),
        p + "mixer.out_proj.weight": t(d_model, d_inner),
    })
  sd["lm_head.weight"] = sd["backbone.embedding.weight"]
  config = {"d_model": d_model, "d_intermediate": 0, "n_layer": n_layer, "vocab_size": vocab,
            "ssm_cfg": {"layer": "Mamba2", "d_state": d_state, "headdim": headdim},
            "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
            "fused_add_norm": True, "pad_vocab_size_multiple": 16, "tie_embeddings": True}
  return sd, config


def write_mamba_ssm(path, sd, config):
  path.mkdir(parents=True)
  torch.save(sd, path / "pytorch_model.bin")
  (path / "config.json").write_text(json.dumps(config))


def test_mamba_ssm_checkpoint_loads_runs_and_matches_transformers(tmp_path):
  sd, config = mamba_ssm_state_dict()
  write_mamba_ssm(tmp_path / "ssm", sd, config)
  ours = load_model(tmp_path / "ssm")
  assert ours.config.vocab_size == 50 and ours.config.padded_vocab_size == 64
  # The same weights in transformers (its one naming difference: "embeddings").
  hf = Mamba2ForCausalLM(HFConfig(hidden_size=64, num_heads=8, head_dim=16, n_groups=1,
                                  state_size=16, chunk_size=256, vocab_size=64,
                                  num_hidden_layers=2, tie_word_embeddings=True)).eval()
  hf_sd = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in sd.items()}
  hf.load_state_dict(hf_sd, strict=False)
  ids = np.random.RandomState(1).randint(0, 50, (2, 30))
  with torch.no_grad():
    ref = hf(torch.tensor(ids)).logits.numpy()[..., :50]
  got = np.asarray(forward(ours, jnp.asarray(ids)))
  assert got.shape == (2, 30, 50)
  assert rel(got, ref) < 1e-5


def test_mamba_ssm_round_trip_is_exact(tmp_path):
  sd, config = mamba_ssm_state_dict(seed=1)
  write_mamba_ssm(tmp_path / "src", sd, config)
  export.save_mamba_ssm(load_model(tmp_path / "src"), tmp_path / "out")
  back = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
  assert sorted(back) == sorted(sd)
  for k in sd:
    assert back[k].shape == sd[k].shape and back[k].dtype == sd[k].dtype, k
    assert torch.equal(back[k], sd[k]), k
  out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
  assert out_cfg == {**config, "ssm_cfg": out_cfg["ssm_cfg"]}
  assert out_cfg["ssm_cfg"] == config["ssm_cfg"]


def test_bfloat16_export_is_bfloat16_rounding(model, tmp_path):
  export.save_hf(model, tmp_path / "bf16", dtype="bfloat16")
  sd = load_file(tmp_path / "bf16" / "model.safetensors")
  assert all(v.dtype == ml_dtypes.bfloat16 for v in sd.values())
  emb = np.asarray(model.params()["embedding"])[:257]
  np.testing.assert_array_equal(sd["backbone.embeddings.weight"], emb.astype(ml_dtypes.bfloat16))
  ids = np.random.RandomState(2).randint(0, 257, (1, 33))
  f32 = np.asarray(forward(model, jnp.asarray(ids)))
  bf16 = np.asarray(forward(load_model(tmp_path / "bf16"), jnp.asarray(ids)))
  # bfloat16 keeps 8 bits of mantissa (2**-8 = 0.4% per weight); through two
  # layers and the head the logits stay within a few of those roundings.
  err = rel(bf16, f32)
  assert 0 < err < 2e-2


def test_bad_inputs(tmp_path, model):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_model(tmp_path / "nowhere")
  sd, config = mamba_ssm_state_dict()
  bad = dict(sd)
  del bad["backbone.layers.1.mixer.D"]
  bad["backbone.layers.1.mixer.E"] = bad["backbone.layers.0.mixer.D"]
  write_mamba_ssm(tmp_path / "names", bad, config)
  with pytest.raises(ValueError, match=r"missing \['backbone.layers.1.mixer.D'\]"
                                       r".*unknown \['backbone.layers.1.mixer.E'\]"):
    load_model(tmp_path / "names")
  bad = dict(sd, **{"backbone.layers.0.mixer.A_log": torch.zeros(3)})
  write_mamba_ssm(tmp_path / "shapes", bad, config)
  with pytest.raises(ValueError, match=r"backbone.layers.0.mixer.A_log: \(3,\) != expected \(8,\)"):
    load_model(tmp_path / "shapes")
  write_mamba_ssm(tmp_path / "layernorm", sd, dict(config, rms_norm=False))
  with pytest.raises(ValueError, match="rms_norm=false"):
    load_model(tmp_path / "layernorm")
  (tmp_path / "nobin").mkdir()
  (tmp_path / "nobin" / "config.json").write_text(json.dumps(config))
  with pytest.raises(FileNotFoundError, match="pytorch_model.bin is missing"):
    load_model(tmp_path / "nobin")
  export.save_hf(model, tmp_path / "taken")
  with pytest.raises(FileExistsError, match="not empty"):
    export.save_hf(model, tmp_path / "taken")


def test_export_cli(hf_dir, tmp_path):
  out = tmp_path / "cli"
  r = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), "--checkpoint", str(hf_dir),
                      "--out", str(out), "--format", "mamba_ssm"], capture_output=True, text=True,
                     env=dict(os.environ, PYTHONPATH=str(ROOT)))  # this checkout's library
  assert r.returncode == 0, r.stderr
  assert (out / "pytorch_model.bin").exists() and (out / "config.json").exists()
