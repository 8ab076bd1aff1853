"""Checks against transformers' reference models that the NemotronH (`test_hybrid`,
`test_moe`) and Granite (`test_granite`) files share: a model loaded from a
reference's checkpoint has its logits (float32, 1e-5) and greedy tokens, and a model
exported with `save_hf` loads in transformers with the same logits and back through
`load_model`. They import torch and transformers, which `helpers` does not at import.

The known-upstream-bug skip (`helpers.skip_on_known_transformers_bug`) stays in the
tests that need it, before the first call here that runs the reference."""

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from mamba_train import generate, load_model
from mamba_train.interop.export import save_hf

from helpers import rel

# Same inputs in every file: rows of tokens below the models' vocabulary of 90 (by
# default 2 rows of 21: two chunks of 8 and a ragged tail), and an 11-token prompt for
# greedy decoding.
VOCAB = 90
PROMPT = [5, 17, 2, 44, 8, 61, 23, 60, 12, 33, 71]

forward = nnx.jit(lambda model, ids: model(ids))


def assert_logits_match(ref, ours, length: int = 21, seed: int = 1) -> None:
  """`ours` (loaded from `ref`'s checkpoint) gives `ref`'s logits on 2 random rows of
  `length` tokens: float32, within 1e-5."""
  ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
  with torch.no_grad():
    want = ref(ids).logits.numpy()
  got = np.asarray(forward(ours, jnp.asarray(ids.numpy())))
  assert got.shape == want.shape and got.dtype == np.float32
  assert rel(got, want) < 1e-5


def assert_greedy_matches(ref, ours, n: int) -> None:
  """`ours` decodes the same `n` greedy tokens after PROMPT as `ref.generate`."""
  with torch.no_grad():
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, eos_token_id=None, pad_token_id=0)[0].numpy()
  np.testing.assert_array_equal(generate(ours, PROMPT, n), want)


def export_to_transformers(ours, path):
  """`save_hf(ours, path)`, then transformers' `NemotronHForCausalLM.from_pretrained(path)`."""
  from transformers import NemotronHForCausalLM
  save_hf(ours, path)
  return NemotronHForCausalLM.from_pretrained(path).eval()


def assert_export_round_trip(ref, ours, path):
  """`ref` (`export_to_transformers(ours, path)`) gives `ours`'s logits within 1e-5 on
  2 rows of 19 tokens; returns the export read back through `load_model`, for the
  caller's checks of what came back."""
  ids = np.random.default_rng(0).integers(0, VOCAB, (2, 19))
  with torch.no_grad():
    want = ref(torch.tensor(ids)).logits.numpy()
  assert rel(np.asarray(forward(ours, jnp.asarray(ids))), want) < 1e-5
  return load_model(path)
