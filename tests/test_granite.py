"""IBM's Granite 4.0 hybrids: transformers' GraniteMoeHybridForCausalLM on random
weights imported (load_model) and compared: logits (float32, 1e-5) and greedy
tokens. Its softmax-after-top-k router, gated experts and shared MLP, multipliers
and attention with and without rotary, one small model each. (Import only: export
to GraniteMoeHybrid is not built, and the exporters refuse its functions.)"""

import json

import numpy as np
import pytest
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from mamba_train import load_model
from mamba_train.interop import granite
from mamba_train.interop.export import save_hf

import reference_checks

COMMON = dict(hidden_size=32, vocab_size=90, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
              mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8,
              num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, shared_intermediate_size=16,
              embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
              rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=0, eos_token_id=0)
CASES = {
    # MoE layers (8 experts, 3 a token), rotary attention, tied head.
    "moe_rope_tied": dict(num_local_experts=8, num_experts_per_tok=3, position_embedding_type="rope",
                          rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=True),
    # No experts (the shared MLP alone: our '-' layers), attention without positions, untied.
    "dense_nope_untied": dict(num_local_experts=0, position_embedding_type=None, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
  path = tmp_path_factory.mktemp("granite")
  torch.manual_seed(list(CASES).index(request.param))
  ref = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**COMMON, **CASES[request.param])).eval()
  with torch.no_grad():  # spread what transformers initialises to constants or near zero
    for layer in ref.model.layers:
      layer.input_layernorm.weight.normal_(1.0, 0.2)
      layer.post_attention_layernorm.weight.normal_(1.0, 0.2)
      if layer.mamba is not None:
        layer.mamba.A_log.uniform_(-1.0, 2.5)
        layer.mamba.dt_bias.uniform_(-3.0, 0.0)
        layer.mamba.D.normal_(1.0, 0.5)
        layer.mamba.norm.weight.normal_(1.0, 0.2)
      if layer.block_sparse_moe is not None:
        layer.block_sparse_moe.router.weight.normal_(0.0, 0.5)
        layer.block_sparse_moe.experts.gate_up_proj.normal_(0.0, 0.3)
        layer.block_sparse_moe.experts.down_proj.normal_(0.0, 0.3)
  ref.save_pretrained(path)
  return request.param, ref, path, load_model(path)


def test_config_read(pair):
  name, ref, _, ours = pair
  c, r = ours.config, ref.config
  ffn = "E" if r.num_local_experts else "-"
  assert c.pattern == f"M{ffn}*{ffn}M{ffn}"
  assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier, c.logits_scaling) == (
      3.0, 0.5, 0.2, 2.5)
  assert c.attn_rotary_emb_dim == (8 if name == "moe_rope_tied" else 0)
  assert c.tie_embeddings == r.tie_word_embeddings and c.mlp_act == "swiglu"
  if r.num_local_experts:
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.moe_shared_expert_intermediate_size, c.moe_router_score_function) == (8, 3, 24, 16, "softmax")


def test_logits_match_transformers(pair):
  _, ref, _, ours = pair
  reference_checks.assert_logits_match(ref, ours)


@pytest.mark.parametrize("pair", ["moe_rope_tied"], indirect=True)  # (decoding's MLP path: NemotronH's tests)
def test_greedy_matches_transformers(pair):
  _, ref, _, ours = pair
  reference_checks.assert_greedy_matches(ref, ours, 10)


def test_released_names_and_refusals(pair, tmp_path):
  """save_pretrained writes the released files' expert and router names
  (input_linear, router.layer); transformers' in-memory names read the same; what
  our model cannot hold, and exports of a Granite model, are refused by name."""
  name, _, path, ours = pair
  from safetensors.numpy import load_file, save_file
  sd = load_file(str(path / "model.safetensors"))
  new = granite.GRANITE_FILE_NAMES
  renamed = {next((k[: -len(o)] + n for o, n in new.items() if k.endswith(o)), k): v for k, v in sd.items()}
  assert (set(renamed) != set(sd)) == (name == "moe_rope_tied")
  (tmp_path / "new").mkdir()
  save_file(renamed, str(tmp_path / "new" / "model.safetensors"))
  (tmp_path / "new" / "config.json").write_text((path / "config.json").read_text())
  back = load_model(tmp_path / "new").params()
  for kind in ("moe", "mlp", "layers", "attn"):
    if kind in back:
      for k, v in back[kind].items():
        np.testing.assert_array_equal(v, ours.params()[kind][k])
  hf = json.loads((path / "config.json").read_text())
  for bad, match in ((dict(hidden_act="gelu"), "hidden_act"), (dict(attention_bias=True), "attention_bias"),
                     (dict(position_embedding_type="alibi"), "position_embedding_type")):
    with pytest.raises(ValueError, match=match):
      granite.granite_config_to_ours({**hf, **bad})
  with pytest.raises(ValueError, match="embedding_multiplier"):
    save_hf(ours, tmp_path / "export")
