"""The model against transformers' PyTorch Mamba2ForCausalLM on identical random weights."""

import math
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Mamba2Config as HFConfig, Mamba2ForCausalLM

import mamba_train
from mamba_train import load_model

from helpers import rel

# The model is an argument, not a closure: closed-over weights become XLA constants.
forward = nnx.jit(lambda model, ids: model(ids))


def hf_model(tmp_path, seed=0, spread=True, **kw):
  torch.manual_seed(seed)
  cfg = HFConfig(**kw)
  model = Mamba2ForCausalLM(cfg).eval()
  # transformers initialises A_log as log(1..h) and dt_bias to small values; spread
  # them so every head decays differently and the dt path matters.
  with torch.no_grad():
    for layer in model.backbone.layers if spread else []:
      layer.mixer.A_log.uniform_(-1.0, 2.5)
      layer.mixer.dt_bias.normal_(-2.0, 1.0)
      layer.mixer.D.normal_(1.0, 0.5)
      layer.mixer.norm.weight.normal_(1.0, 0.2)
      layer.norm.weight.normal_(1.0, 0.2)
  model.save_pretrained(tmp_path)
  return model


SMALL = {
    "ngroups2_tied": dict(hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16,
                          chunk_size=16, vocab_size=100, num_hidden_layers=2,
                          tie_word_embeddings=True),
    "chunks_ragged_untied": dict(hidden_size=64, num_heads=8, head_dim=16, n_groups=1,
                                 state_size=16, chunk_size=8, vocab_size=100,
                                 num_hidden_layers=3, tie_word_embeddings=False),
    "ngroups4_vocab_unpadded": dict(hidden_size=96, num_heads=12, head_dim=16, n_groups=4,
                                    state_size=8, chunk_size=32, vocab_size=77,
                                    num_hidden_layers=2, conv_kernel=3),
}


# On CPU 'auto' is the scan form; one case also runs the accelerators' parallel form.
@pytest.mark.parametrize("name,form", [(n, "auto") for n in SMALL] + [("chunks_ragged_untied", "parallel")])
def test_logits_match_transformers_small(tmp_path, name, form):
  kw = SMALL[name]
  ref_model = hf_model(tmp_path, **kw)
  ours = load_model(tmp_path, ssd_form=form)
  assert ours.runtime.ssd_form == ("scan" if form == "auto" else form)
  assert ours.config.ngroups == kw["n_groups"]
  assert ours.config.tie_embeddings == ref_model.config.tie_word_embeddings
  ids = torch.randint(0, kw["vocab_size"], (2, 45), generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    ref = ref_model(ids).logits.numpy()
  got = np.asarray(forward(ours, jnp.asarray(ids.numpy())))
  assert got.shape == ref.shape and got.dtype == np.float32
  assert rel(got, ref) < 1e-5


def parity_130m(tmp_path) -> float:
  kw = dict(hidden_size=768, num_heads=24, head_dim=64, n_groups=1, state_size=128,
            chunk_size=256, vocab_size=50288, num_hidden_layers=24)
  ref_model = hf_model(tmp_path, spread=False, **kw)
  ours = load_model(tmp_path)
  assert (ours.config.d_model, ours.config.n_layer, ours.config.nheads) == (768, 24, 24)
  ids = torch.randint(0, 50288, (1, 300), generator=torch.Generator().manual_seed(2))
  with torch.no_grad():
    ref = ref_model(ids).logits.numpy()
  got = np.asarray(forward(ours, jnp.asarray(ids.numpy())))
  return rel(got, ref)


def test_logits_match_transformers_130m(tmp_path):
  """The released 130m shape with its chunk of 256: two chunks, the second ragged.

  Run in a subprocess with XLA's default flags: the suite's fast-compile flags
  (conftest.py) leave less accurate code (1.1e-4 here against 6e-5 for
  transformers' own float32 path, both measured against its float64 run)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  r = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  err = float(r.stdout.strip().splitlines()[-1])
  assert err < 1e-4


def test_time_step_limit_infinity_is_read(tmp_path):
  hf_model(tmp_path, **SMALL["ngroups2_tied"])
  text = (tmp_path / "config.json").read_text()
  assert "Infinity" in text  # transformers' non-standard form
  ours = load_model(tmp_path)
  assert ours.config.dt_limit == (0.0, math.inf)


def test_public_api():
  assert mamba_train.load_model is load_model
  cfg = mamba_train.Mamba2Config(d_model=64, n_layer=2, d_state=16, headdim=16, vocab_size=50)
  model = mamba_train.Mamba2LM(cfg, rngs=__import__("flax").nnx.Rngs(0))
  out = model(jnp.zeros((1, 7), jnp.int32))
  assert out.shape == (1, 7, 50) and out.dtype == jnp.float32


if __name__ == "__main__":
  from mamba_train.xla_flags import apply_cpu_defaults
  apply_cpu_defaults()  # as every entry point does, before JAX's first computation
  print(parity_130m(Path(sys.argv[1])))
