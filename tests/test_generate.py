"""Cached decoding and generation against independent slow paths.

* prefill + step-by-step decode against one full forward pass (float32);
* greedy generate against transformers' Mamba2ForCausalLM.generate on the same
  random weights;
* a left-padded mixed-length batch against each prompt alone;
* sampling: seeded reproducibility, top_k=1 = greedy;
* the cache's size against the prompt length; bad input.

Compiling is most of the cost on CPU, so the jitted functions live at module
scope and every generate call here shares a few (batch, length, buffer) shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mamba_train
from mamba_train.generation import generate, generate_with_stats, prefill, step
from mamba_train.model.cache import CACHE_AXES, Mamba2Cache
from mamba_train.model.config import Mamba2Config
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.params import MATMUL_WEIGHTS
from mamba_train.model.runtime import Runtime
from mamba_train.parallel import sharding

from helpers import scaled_random_model

# Chunk 8 so prompts of 5 and 21 tokens fall shorter and longer than a chunk,
# the latter with a ragged tail; two groups so B/C sharing is exercised.
CFG = Mamba2Config(d_model=64, n_layer=2, d_state=16, headdim=16, ngroups=2, chunk_size=8,
                   vocab_size=100)
TOTAL = 30  # tokens per test sequence


@functools.lru_cache(maxsize=None)
def small_model() -> Mamba2LM:
  """Random weights scaled like a trained model's (helpers.scaled_random_model)."""
  return scaled_random_model(CFG)


@functools.partial(jax.jit, static_argnames="graphdef")
def _full_and_cached(graphdef, params, full_ids, prompt_ids, mask, rest_ids):
  """Logits of one full forward pass over full_ids (b, TOTAL); of prefill over
  the left-padded prompts (b, l); and of stepping rest_ids (b, t) one by one."""
  model = nnx.merge(graphdef, params)
  full = model(full_ids)
  first, cache = prefill(model, prompt_ids, mask)

  def body(cache, tok):
    logits, cache = step(model, tok, cache)
    return cache, logits

  _, stepped = jax.lax.scan(body, cache, rest_ids.T)
  return full, first, jnp.moveaxis(stepped, 0, 1)


@pytest.mark.parametrize("decode_impl", ["xla", "interpret"])
def test_prefill_then_steps_match_full_forward(decode_impl):
  """Row 0: prompt of 5 (< chunk), left-padded; row 1: prompt of 21 (> 2 chunks,
  ragged), unpadded. Every later position is then decoded one token at a time, by
  the plain step or the fused TPU kernel (`decode_tpu`) in Pallas' interpreter."""
  model = small_model()
  if decode_impl != "xla":
    model = Mamba2LM.from_params(CFG, model.params(), runtime=Runtime(decode_impl=decode_impl))
  lens = (5, 21)
  ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, TOTAL)).astype(np.int32)
  l, t = max(lens), TOTAL - min(lens)
  prompt = np.zeros((2, l), np.int32)
  mask = np.zeros((2, l), bool)
  rest = np.zeros((2, t), np.int32)
  for r, s in enumerate(lens):
    prompt[r, l - s:], mask[r, l - s:] = ids[r, :s], True
    rest[r, :TOTAL - s] = ids[r, s:]
  graphdef, params = nnx.split(model)
  full, first, stepped = _full_and_cached(graphdef, params, ids, prompt, mask, rest)
  full, first, stepped = np.asarray(full), np.asarray(first), np.asarray(stepped)
  scale = np.abs(full).max()
  for r, s in enumerate(lens):
    cached = np.concatenate([first[r, None], stepped[r, :TOTAL - s]])  # positions s-1 .. TOTAL-1
    err = np.abs(cached - full[r, s - 1:]).max(axis=-1) / scale
    assert err.max() < 1e-5, (s, err)


def test_cache_size_independent_of_prompt_length():
  model = small_model()
  shapes = [jax.eval_shape(lambda ids: prefill(model, ids)[1], jax.ShapeDtypeStruct((2, l), jnp.int32))
            for l in (4, 64, 1000)]
  assert shapes[0] == shapes[1] == shapes[2]
  cache = Mamba2Cache.init(CFG, 2)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), cache) == \
      jax.tree.map(lambda a: (a.shape, a.dtype), shapes[0])
  assert cache.nbytes == Mamba2Cache.bytes_for(CFG, 2)
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(cache))
  # Every cache axis has a sharding rule: batch split like activations, heads over tensor.
  for name, a in cache.states().items():  # a pure model's: no attention buffers
    spec = sharding.logical_to_spec(CACHE_AXES[name])
    assert len(spec) == a.ndim
    assert spec[1] == sharding.logical_to_spec(("batch",))[0]


@functools.partial(jax.jit, static_argnames="graphdef")
def _decode_four_ways(graphdef, params, prompt, rest_ids):
  """Logits (way, b, t, v) of stepping rest_ids (b, t) after prefill of prompt: the
  model's `step` (scanned layers, float32 weights cast inside every step), and the
  decode loop's forms over weights cast once (`decode_layers`, `head_for_logits`):
  unrolled and scanned; and unrolled with the weights cast inside every step."""
  model = nnx.merge(graphdef, params)
  _, cache = prefill(model, prompt)
  head = model.head_for_logits()

  def step_logits(out, head=None):
    h, states = out
    return model.logits(h, head), states

  ways = {
      "step": (cache.states(), lambda tok, st: step_logits(model.step(tok, st))),
      "unrolled, cast once": (model.unstack_states(cache.states()), lambda tok, st: step_logits(
          model.step_unrolled(tok, model.decode_layers(True), st), head)),
      "scan, cast once": (cache.states(), lambda tok, st: step_logits(
          model.step(tok, st, model.decode_layers(False)), head)),
      "unrolled, cast every step": (model.unstack_states(cache.states()), lambda tok, st: step_logits(
          model.step_unrolled(tok, model.unstacked_layers(), st))),
  }
  out = {}
  for name, (states, fn) in ways.items():
    _, out[name] = jax.lax.scan(lambda st, tok, fn=fn: fn(tok, st)[::-1], states, rest_ids.T)
  return {k: jnp.moveaxis(v, 0, 1) for k, v in out.items()}


def test_decode_weights_cast_once_equal_cast_every_step():
  """bfloat16 matmuls: the decode loop's weights converted once before the loop
  (matmul weights and LM head; norms, conv, dt, A, D stay float32) give exactly
  the logits of converting them inside every step, unrolled or scanned, and the
  greedy tokens of `generate` do not depend on `decode_layers`."""
  base = small_model()
  model = Mamba2LM.from_params(CFG, base.params(), runtime=Runtime(compute_dtype="bfloat16"))
  weights = model.decode_layers(True)[0]
  assert {n for n, a in weights.items() if a.dtype == jnp.bfloat16} == set(weights) & MATMUL_WEIGHTS
  assert model.decode_layers(False)["M"]["in_proj_zx"].dtype == jnp.bfloat16
  ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 16)).astype(np.int32)
  graphdef, params = nnx.split(model)
  got = {k: np.asarray(v) for k, v in _decode_four_ways(graphdef, params, ids[:, :9], ids[:, 9:]).items()}
  np.testing.assert_array_equal(got["unrolled, cast once"], got["unrolled, cast every step"])
  np.testing.assert_array_equal(got["scan, cast once"], got["step"])
  scale = np.abs(got["step"]).max()
  assert np.abs(got["unrolled, cast once"] - got["step"]).max() / scale < 1e-5
  toks = [generate(Mamba2LM.from_params(CFG, base.params(), runtime=Runtime(
      compute_dtype="bfloat16", decode_layers=how)), ids[:, :9], 6) for how in ("unrolled", "scan")]
  np.testing.assert_array_equal(toks[0], toks[1])


def test_inference_weights_give_the_same_logits_and_tokens():
  """`for_inference` with bfloat16 matmuls: the matmul weights held in bfloat16 (z|x
  joined as (L, d, 2i)), everything else float32, `params()` in the schema's shapes
  and equal to the cast weights, the model it came from unchanged; the full
  forward's logits and generate's tokens (prefill and the decode loop) equal the
  float32-held model's bit for bit. An untied head is cast too; int8 matmuls keep
  float32 weights (quantizing a cast weight gives other values)."""
  base = small_model()
  model = Mamba2LM.from_params(CFG, base.params(), runtime=Runtime(compute_dtype="bfloat16"))
  held = model.for_inference()
  d, i = CFG.d_model, CFG.d_inner
  assert held.layers["in_proj_zx"].get_value().shape == (CFG.n_layer, d, 2 * i)
  assert model.layers["in_proj_zx"].get_value().shape == (CFG.n_layer, d, 2, i)
  want, got = model.params(), held.params()
  assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want)
  for name, a in got["layers"].items():
    assert a.dtype == (jnp.bfloat16 if name in MATMUL_WEIGHTS else jnp.float32), name
    np.testing.assert_array_equal(np.asarray(a), np.asarray(want["layers"][name].astype(a.dtype)))
    assert want["layers"][name].dtype == jnp.float32
  assert got["embedding"].dtype == jnp.float32
  ids = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 12)).astype(np.int32)
  forward = lambda m: np.asarray(jax.jit(lambda p, x, g=nnx.graphdef(m): nnx.merge(g, p)(x))(nnx.state(m), ids))
  np.testing.assert_array_equal(forward(held), forward(model))
  np.testing.assert_array_equal(generate(held, ids[:, :9], 5), generate(model, ids[:, :9], 5))
  untied = scaled_random_model(CFG.replace(tie_embeddings=False))
  untied = Mamba2LM.from_params(untied.config, untied.params(), runtime=Runtime(compute_dtype="bfloat16"))
  assert untied.for_inference().lm_head.get_value().dtype == jnp.bfloat16
  int8 = Mamba2LM.from_params(CFG, base.params(), runtime=Runtime(compute_dtype="bfloat16", matmul_precision="int8"))
  assert all(a.dtype == jnp.float32 for a in int8.for_inference().params()["layers"].values())


def test_generate_with_fused_decode_step_is_greedy():
  """Greedy generate with the fused decoding step (interpreted), a left-padded batch
  of two prompts: every new token is the argmax of one full forward pass over the
  sequence before it (what the plain step's generate gives: it is held to the same
  full forward above and to transformers below; a second generate program would
  double this test's compile time)."""
  base = small_model()
  model = Mamba2LM.from_params(CFG, base.params(), runtime=Runtime(decode_impl="interpret"))
  prompts = [[5, 17, 3, 88, 41], [9, 2, 60, 33, 71, 12, 4, 90, 27, 51, 8]]
  new = 8
  out = generate(model, prompts, new)
  graphdef, params = nnx.split(base)
  forward = jax.jit(lambda p, ids: jnp.argmax(nnx.merge(graphdef, p)(ids), -1))
  for prompt, row in zip(prompts, out):
    assert len(row) == len(prompt) + new
    greedy = np.asarray(forward(params, row[None, :-1]))[0, len(prompt) - 1:]
    np.testing.assert_array_equal(row[len(prompt):], greedy)


# ----------------------------------------------------------------------------
# Against transformers, and the generate API (all on one loaded model).

HF_NEW = 64


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf_cfg = transformers.Mamba2Config(
      hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=16,
      vocab_size=100, num_hidden_layers=2, expand=2, conv_kernel=4, pad_token_id=0,
      bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
  hf = transformers.Mamba2ForCausalLM(hf_cfg).eval()
  # As initialised, the top two logits of these 64 steps differ by at least
  # 5e-3 (the logits span about +-3): a thousand times the float32 error, so
  # no argmax can flip. Scaling the weights up makes the output repeat one token.
  path = tmp_path_factory.mktemp("hf_mamba2")
  hf.save_pretrained(path)
  return hf, mamba_train.load_model(path)


def _hf_greedy(hf, prompt, n):
  import torch
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
  return out[0].numpy()


PROMPTS = ([7, 3, 9], [5, 17, 2, 44, 8, 91, 23, 60, 12, 33, 71],
           [int(t) for t in np.random.default_rng(1).integers(1, 100, 20)])


def test_greedy_matches_transformers(hf_pair):
  hf, ours = hf_pair
  prompt = PROMPTS[1]
  want = _hf_greedy(hf, prompt, HF_NEW)
  got = generate(ours, prompt, HF_NEW)
  assert got.shape == (len(prompt) + HF_NEW,)
  np.testing.assert_array_equal(got, want)


def test_mixed_length_batch_equals_each_alone(hf_pair):
  _, ours = hf_pair
  hf, ours = hf_pair
  batch = generate(ours, list(PROMPTS), HF_NEW)  # padded to 32: 29, 21 and 12 pads
  assert [len(r) for r in batch] == [len(p) + HF_NEW for p in PROMPTS]
  for p, row in zip(PROMPTS[:2], batch):
    alone = generate(ours, np.asarray([p]), HF_NEW)  # padded to 16 only
    assert alone.shape == (1, len(p) + HF_NEW)
    np.testing.assert_array_equal(row, alone[0])
  # The longest, against transformers with no padding at all.
  np.testing.assert_array_equal(batch[2], _hf_greedy(hf, PROMPTS[2], HF_NEW))


def test_sampling_seeded_and_top_k_one_is_greedy(hf_pair):
  _, ours = hf_pair
  p = PROMPTS[1]
  greedy = generate(ours, p, HF_NEW)
  a = generate(ours, p, HF_NEW, temperature=1.5, seed=1)
  b = generate(ours, p, HF_NEW, temperature=1.5, seed=1)
  c = generate(ours, p, HF_NEW, temperature=1.5, seed=2)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert not np.array_equal(a, greedy)
  np.testing.assert_array_equal(generate(ours, p, HF_NEW, temperature=1.5, top_k=1, seed=3), greedy)
  # A tiny nucleus keeps only the most likely token: greedy again.
  np.testing.assert_array_equal(generate(ours, p, HF_NEW, temperature=1.0, top_p=1e-6, seed=4),
                                greedy)
  k3 = generate(ours, p, HF_NEW, temperature=1.5, top_k=3, top_p=0.9, seed=5)
  assert k3.shape == greedy.shape and not np.array_equal(k3, a)


def test_eos_stops_and_pads(hf_pair):
  _, ours = hf_pair
  greedy = generate(ours, list(PROMPTS), HF_NEW)
  # Stop row 1 at its 6th new token; the others keep going unless they meet the same id.
  eos = int(greedy[1][len(PROMPTS[1]) + 5])
  out, stats = generate_with_stats(ours, list(PROMPTS), HF_NEW, eos_id=eos, pad_id=1)
  new = out[1][len(PROMPTS[1]):]
  assert new[5] == eos and np.all(new[6:] == 1)
  np.testing.assert_array_equal(new[:6], greedy[1][len(PROMPTS[1]):][:6])
  # Alone, it stops the whole loop: the output ends at EOS, like transformers.
  alone = generate(ours, np.asarray([PROMPTS[1]]), HF_NEW, eos_id=eos)
  assert alone.shape == (1, len(PROMPTS[1]) + 6)
  assert stats.steps <= HF_NEW and stats.compile_s >= 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_ids=[]), "empty"),
    (dict(prompt_ids=[[1, 2], []]), "empty"),
    (dict(prompt_ids=np.zeros((1, 0), np.int32)), "empty"),
    (dict(prompt_ids=[1, 2, 100]), "outside the vocabulary"),
    (dict(prompt_ids=[[1, -1]]), "outside the vocabulary"),
    (dict(prompt_ids=[1, 2] * 9, max_prompt_len=16), "max_prompt_len"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(eos_id=100), "eos_id"),
    (dict(prompt_ids=np.ones((1, 3), np.float32)), "integer"),
    (dict(prompt_ids="hello"), "token-id"),
])
def test_bad_input(kwargs, match):
  args = dict(prompt_ids=[1, 2, 3], max_new_tokens=4) | kwargs
  with pytest.raises(ValueError, match=match):
    generate(small_model(), **args)
