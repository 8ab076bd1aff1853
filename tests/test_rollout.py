"""GRPO's on-device rollouts (`mamba_train.rollout`) against independent paths:

* the sampler's per-token log-probabilities against one full forward pass over
  prompt + completion (`sequence_logprobs`, what the trainer computes), a pure
  Mamba-2 model and a hybrid (attention and MLP layers too);
* greedy rollouts against `generate` (every copy of the prompt's state exact);
* a mixed-length batch against each prompt without the other's padding;
* EOS and stop strings against masks worked out from the tokens;
* per-row random streams; the same key, the same rollout; bad input.

Compiling is most of the cost on CPU: the calls share one shape (2 prompts x 4,
prompts padded to 16 or 32, 16 new tokens), and temperature, EOS and the rest are
traced, so a handful of programs serve every test.
"""

from __future__ import annotations

import functools
import json
import os
import sys

if __name__ == "__main__":  # the sharded worker (end of file): this checkout's package
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from mamba_train.generation import generate, token_byte_table
from mamba_train.model.config import Mamba2Config
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.runtime import Runtime
from mamba_train.parallel import sharding
from mamba_train.parallel.sharding import MESH_AXES
from mamba_train.rollout import rollout, sequence_logprobs

from helpers import scaled_random_model

# Chunk 8: prompts of 5 and 11 tokens (padded to 16) fall shorter and longer than a chunk.
CFG = Mamba2Config(d_model=64, n_layer=2, d_state=16, headdim=16, ngroups=2, chunk_size=8,
                   vocab_size=100)
HYB = Mamba2Config(d_model=32, n_layer=3, d_state=8, headdim=16, ngroups=2, chunk_size=8,
                   vocab_size=64, layer_pattern="M*-", attn_num_heads=4, attn_num_heads_kv=2,
                   attn_head_dim=8, attn_rotary_emb_dim=4, d_intermediate=48)
PROMPTS = [np.array([5, 17, 3, 88, 41]), np.array([9, 2, 60, 33, 71, 12, 4, 90, 27, 51, 8])]
G, NEW = 4, 16


@functools.lru_cache(maxsize=None)
def model(cfg: Mamba2Config = CFG) -> Mamba2LM:
  """Random weights scaled like a trained model's (helpers.scaled_random_model)."""
  return scaled_random_model(cfg)


@functools.partial(jax.jit, static_argnames="graphdef")
def _trainer_logprobs(graphdef, params, prompt_ids, prompt_mask, completion_ids, temperature):
  return sequence_logprobs(nnx.merge(graphdef, params), prompt_ids, prompt_mask, completion_ids,
                           temperature)


def _gap(m, r, temperature):
  """max |sampler - trainer| over the completion tokens of rollout r."""
  graphdef, params = nnx.split(m)
  want = np.asarray(_trainer_logprobs(graphdef, params, r.prompt_ids, r.prompt_mask,
                                      r.completion_ids, temperature))
  return float(np.abs(np.where(r.completion_mask, r.logprobs - want, 0.0)).max())


# Measured on this CPU: 9.5e-7 (pure Mamba-2), 1.2e-6 (hybrid), over log-probabilities
# of about -1 to -8: a few float32 ulps. 1e-5 leaves room for another CPU's rounding.
LOGPROB_BOUND = 1e-5


@pytest.mark.parametrize("cfg", [CFG, HYB], ids=["mamba2", "hybrid"])
def test_sampler_logprobs_equal_the_trainers(cfg):
  m = model(cfg)
  prompts = [p % cfg.vocab_size for p in PROMPTS]
  r = rollout(m, prompts, G, NEW, key=jax.random.key(0), temperature=1.3, top_k=20, top_p=0.95)
  assert r.completion_ids.shape == r.logprobs.shape == (2 * G, NEW)
  assert r.completion_mask.all()  # no EOS: every row runs NEW tokens
  assert np.all(r.logprobs < 0) and np.isfinite(r.logprobs).all()
  gap = _gap(m, r, 1.3)
  print(f"{cfg.pattern}: max |sampler - trainer| log-probability {gap:.2e}")
  assert gap < LOGPROB_BOUND
  # Each row is its prompt, left-padded, row r of prompt r // G.
  for row in range(2 * G):
    p = prompts[row // G]
    np.testing.assert_array_equal(r.prompt_ids[row][r.prompt_mask[row]], p)
    assert r.prompt_mask[row].sum() == p.size and not r.prompt_mask[row, :-p.size].any()


def test_bfloat16_sampler_and_trainer_differ_by_bfloat16s_own_error():
  """bfloat16 matmuls: the sampler's and the trainer's log-probabilities (each in
  bfloat16) differ by no more than the bfloat16 trainer differs from the float32 one
  (measured: 2.1e-2 and 2.4e-2; the hybrid 1.9e-2 and 4.1e-2, 32 new tokens)."""
  base = model()
  m = Mamba2LM.from_params(CFG, base.params(), runtime=Runtime(compute_dtype="bfloat16"))
  r = rollout(m, PROMPTS, G, NEW, key=jax.random.key(0), temperature=1.0)
  trainer = {}
  for name, mm in (("bfloat16", m), ("float32", base)):
    graphdef, params = nnx.split(mm)
    trainer[name] = np.asarray(_trainer_logprobs(graphdef, params, r.prompt_ids, r.prompt_mask,
                                                 r.completion_ids, 1.0))
  gap = float(np.abs(r.logprobs - trainer["bfloat16"])[r.completion_mask].max())
  trainer_err = float(np.abs(trainer["bfloat16"] - trainer["float32"])[r.completion_mask].max())
  print(f"bfloat16: sampler - trainer {gap:.2e}, trainer - float32 trainer {trainer_err:.2e}")
  assert 1e-4 < trainer_err < 0.1  # bfloat16's rounding, not a bug
  assert gap < 1.5 * trainer_err


def test_greedy_copies_equal_generate():
  """temperature 0: every one of a prompt's G rows is generate's greedy continuation
  (the repeated state is an exact copy); the log-probabilities are then the model's own
  (temperature counts as 1), again equal to the trainer's."""
  m = model()
  r = rollout(m, PROMPTS, G, NEW, key=jax.random.key(3), temperature=0.0)
  want = generate(m, PROMPTS, NEW)
  for row in range(2 * G):
    np.testing.assert_array_equal(r.completion_ids[row], want[row // G][PROMPTS[row // G].size:])
  assert _gap(m, r, 0.0) < LOGPROB_BOUND


def test_mixed_lengths_equal_each_prompt_without_the_others_padding():
  """A 5-token prompt beside a 20-token one is padded to 32; with a copy of itself, to
  16. Row r's random stream depends on the key and r alone, so its samples are the same."""
  m = model()
  short, long = PROMPTS[0], np.arange(1, 21) * 3 % 100
  key = jax.random.key(7)
  mixed = rollout(m, [short, long], G, NEW, key=key)
  assert mixed.prompt_ids.shape == (2 * G, 32)
  for i, p in enumerate((short, long)):
    alone = rollout(m, [p, p], G, NEW, key=key)
    rows = slice(i * G, (i + 1) * G)
    np.testing.assert_array_equal(mixed.completion_ids[rows], alone.completion_ids[rows])
    np.testing.assert_allclose(mixed.logprobs[rows], alone.logprobs[rows], atol=1e-5)


def test_eos_and_stop_strings_end_the_mask():
  m = model()
  greedy = rollout(m, PROMPTS, G, NEW, key=0, temperature=0.0, pad_id=1)
  # EOS: prompt 0's 4th greedy token; prompt 1's rows stop there only if they meet it.
  eos = int(greedy.completion_ids[0, 3])
  r = rollout(m, PROMPTS, G, NEW, key=0, temperature=0.0, eos_id=eos, pad_id=1)
  for row in range(2 * G):
    ids = greedy.completion_ids[row]
    hits = np.flatnonzero(ids == eos)
    end = hits[0] + 1 if hits.size else NEW
    assert r.lengths[row] == end
    np.testing.assert_array_equal(r.completion_mask[row], np.arange(NEW) < end)
    np.testing.assert_array_equal(r.completion_ids[row, :end], ids[:end])
    assert np.all(r.completion_ids[row, end:] == 1) and np.all(r.logprobs[row, end:] == 0)
  assert r.lengths[0] == 4
  # Stop strings, one list per prompt: token i is the two bytes of chr(i + 32) twice,
  # prompt 1 stops at the bytes of its 5th and 6th greedy tokens (across the two).
  table = token_byte_table([bytes([32 + i, 32 + i]) for i in range(CFG.vocab_size)])
  t5, t6 = greedy.completion_ids[G, 4:6]
  stop = bytes([32 + t5, 32 + t6])
  r = rollout(m, PROMPTS, G, NEW, key=0, temperature=0.0, pad_id=1,
              stop_strings=[["\x7f\x7f\x7f"], [stop]], token_bytes=table)
  assert np.all(r.lengths[:G] == NEW) and r.completion_mask[:G].all()
  for row in range(G, 2 * G):
    assert r.lengths[row] == 6  # through the token that completes the stop string
    np.testing.assert_array_equal(r.completion_mask[row], np.arange(NEW) < 6)
    assert np.all(r.completion_ids[row, 6:] == 1)
    np.testing.assert_array_equal(r.completion_ids[row, :6], greedy.completion_ids[row, :6])


def test_rows_sample_apart_and_the_key_reproduces():
  m = model()
  a = rollout(m, PROMPTS, G, NEW, key=jax.random.key(1))
  b = rollout(m, PROMPTS, G, NEW, key=jax.random.key(1))
  c = rollout(m, PROMPTS, G, NEW, key=jax.random.key(2))
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert not np.array_equal(a.completion_ids, c.completion_ids)
  for p in range(2):  # the G rows of one prompt are G different samples
    rows = a.completion_ids[p * G:(p + 1) * G]
    assert len({tuple(x) for x in rows}) == G
  assert a.stats["tokens"] == 2 * G * NEW and a.stats["tokens_per_s"] > 0
  assert {"seconds", "prefill_s", "decode_s"} <= set(a.stats)


@pytest.mark.parametrize("kwargs, match", [
    (dict(group_size=0), "group_size"),
    (dict(group_size=2.0), "group_size"),
    (dict(prompt_ids=[np.array([1, 2]), np.array([], np.int32)]), "prompt 1 is empty"),
    (dict(prompt_ids=[]), "no prompts"),
    (dict(logprob_of="processed"), "logprob_of"),
    (dict(eos_id=100), "eos_id"),
    (dict(temperature=-1.0), "temperature"),
    (dict(stop_strings=["ab"]), "token_bytes"),
])
def test_bad_input_is_refused_before_compiling(kwargs, match):
  args = dict(prompt_ids=PROMPTS, group_size=2, max_new_tokens=4) | kwargs
  with pytest.raises(ValueError, match=match):
    rollout(model(), key=0, **args)


def test_rows_that_do_not_split_over_the_data_axes_are_refused():
  """3 prompts x 2 over data=4 (an abstract mesh: the check runs before anything is
  placed or compiled)."""
  mesh = AbstractMesh((4, 1, 1, 1, 1), MESH_AXES)
  with sharding.use_rules(mesh), pytest.raises(ValueError, match="6 rows do not split over the "
                                               "data-parallel size 4"):
    rollout(model(), PROMPTS + PROMPTS[:1], 2, 4, key=0)


# ----------------------------------------------------------------------------
# Sharded: 8 simulated CPU devices in a subprocess (the device count is fixed when
# JAX starts); the test reads what it saved.

MESHES = {"data8": {"data": 8}, "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2}}


def _worker(out_dir):
  from mamba_train.parallel.mesh import make_mesh
  assert jax.device_count() == 8, jax.devices()
  m = model()
  out = {}
  for name, mesh_cfg in {"one": None, **MESHES}.items():
    for how, temperature in (("sampled", 1.3), ("greedy", 0.0)):
      if mesh_cfg is None:
        r = rollout(m, PROMPTS, G, NEW, key=jax.random.key(5), temperature=temperature, top_k=30)
      else:
        with sharding.use_rules(make_mesh(mesh_cfg)):
          r = rollout(m, PROMPTS, G, NEW, key=jax.random.key(5), temperature=temperature, top_k=30)
      out[f"{name}_{how}"] = {"ids": r.completion_ids.tolist(), "logprobs": r.logprobs.tolist()}
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(out, f)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory, on_simulated_devices):
  return on_simulated_devices(os.path.abspath(__file__), tmp_path_factory.mktemp("rollout"))


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("how", ["sampled", "greedy"])
def test_sharded_rollout_equals_one_device(sharded_runs, mesh, how):
  """B*G = 8 rows split over the data axes (and the cache's heads over tensor): each
  row's tokens are the one device's (its random stream is its own, whatever device
  holds it), its log-probabilities equal to float32 rounding."""
  one, got = sharded_runs[f"one_{how}"], sharded_runs[f"{mesh}_{how}"]
  np.testing.assert_array_equal(got["ids"], one["ids"])
  np.testing.assert_allclose(got["logprobs"], one["logprobs"], atol=1e-5)


if __name__ == "__main__":
  from mamba_train.xla_flags import apply_cpu_defaults
  apply_cpu_defaults()  # as every entry point does, before JAX's first computation
  _worker(sys.argv[1])
