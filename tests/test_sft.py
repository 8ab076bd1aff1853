"""Instruction finetuning data: chat templates as transformers renders them, the loss
mask on assistant tokens, packing, and the errors that name the bad line."""

import json

import numpy as np
import pytest

from mamba_train import data
from mamba_train.data import chat, tokenizer as tokenizer_lib

CONVS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Japan?"},
                  {"role": "assistant", "content": "Tōkyō."}]},
    {"prompt": "2 + 2 =", "response": "4"},
    {"prompt": "Say hi " * 3, "response": "hi " * 12},
    {"prompt": "Write y", "response": "y" * 200},  # longer than a row
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _write(path, lines):
  with open(path, "wb") as f:
    for line in lines:
      f.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
  return str(path)


def test_rendering_matches_transformers_and_masks_assistant_turns(tmp_path):
  transformers = pytest.importorskip("transformers")
  tok = tokenizer_lib.byte_tokenizer()
  tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
  hf.chat_template = CHATML
  hf.save_pretrained(tmp_path / "tok")
  assert chat.chat_template(str(tmp_path / "tok")) == CHATML
  info = tokenizer_lib.load_tokenizer(str(tmp_path / "tok"), eos_token="<|im_end|>")
  msgs = chat._conversation(CONVS[0], "x")
  pieces = chat.render(chat.compile_template(CHATML), msgs, "<|im_end|>")
  assert "".join(t for t, _ in pieces) == hf.apply_chat_template(msgs, tokenize=False)
  ids, mask = chat.encode(info, pieces)
  assert list(ids) == hf.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
  # The learned tokens are the assistant contents and the tokens that close their turns.
  learned = hf.decode(ids[mask == 1])
  assert learned == "Paris.<|im_end|>\nTōkyō.<|im_end|>\n"


def test_default_template_packing_and_loader_rows(tmp_path):
  src = _write(tmp_path / "chat.jsonl", CONVS * 5)
  path = data.prepare_chat_dataset(src, "sft", root=str(tmp_path), seq_len=127,
                                   val_fraction=0.2, too_long="drop")
  meta = data.read_metadata(path)
  assert meta["packed"] == {"seq_len": 127, "too_long": "drop", "template": "default"}
  train = meta["splits"]["train"]
  assert train["dropped"] == 4 and train["documents"] == 16  # the long one, 4 times in train
  # Every kept example's tokens sit whole in one row, as rendered alone.
  info = tokenizer_lib.load_tokenizer("byte")
  tmpl = chat.compile_template(chat.DEFAULT_TEMPLATE)
  alone = {chat.encode(info, chat.render(tmpl, chat._conversation(c, ""), "<|endoftext|>"))[0]
           .tobytes() for c in CONVS[:3]}
  batches = list(data.make_eval_loader(path, seq_len=127, global_batch_size=2))
  seen = 0
  for b in batches:
    full = np.concatenate([b["input_ids"], b["targets"][:, -1:]], axis=1)
    seq = np.concatenate([b["seq_idx"], b["seq_idx"][:, -1:]], axis=1)
    for row, s, m in zip(full, seq, b["loss_mask"]):
      for j in np.unique(s):
        piece = row[s == j].astype(np.int64)
        if piece.tobytes() in alone:
          seen += 1
        else:
          assert (piece == 256).all()  # padding
      # Learned targets decode to responses with their EOS.
      text = bytes(t for t in b["targets"][0][b["loss_mask"][0] == 1] if t < 256).decode()
      assert text and all(w in "Paris. Tōkyō. 4 hi " for w in text.split())
  assert seen == meta["splits"]["validation"]["documents"] - meta["splits"]["validation"]["dropped"]
  truncated = data.prepare_chat_dataset(src, "sft_t", root=str(tmp_path), seq_len=127,
                                        val_fraction=0.2, too_long="truncate")
  assert data.read_metadata(truncated)["splits"]["train"]["truncated"] == 4  # the response survives


def test_masked_targets_get_zero_gradient_and_packed_row_equals_examples_alone(tmp_path):
  import jax
  import jax.numpy as jnp

  from mamba_train import Runtime, config_for
  from mamba_train.data import loader as loader_lib
  from mamba_train.train.step import loss_sums

  from helpers import random_model
  src = _write(tmp_path / "chat.jsonl", CONVS[:3] * 2)
  path = data.prepare_chat_dataset(src, "sft", root=str(tmp_path), seq_len=255, val_fraction=0)
  rows, _ = loader_lib._open_split(path, "train", 255)
  packed = rows[0]
  # Small shapes compile fast; chunks of 32 put eight chunk boundaries in a row.
  cfg = config_for("tiny", n_layer=1, d_model=64, d_state=16, headdim=16, chunk_size=32,
                   vocab_size=257)
  model = random_model(cfg, np.random.default_rng(0))
  params, rt = model.params(), Runtime().resolve("cpu")
  # Row 0 packed with seq_idx, then each of its examples alone in rows of the same width.
  examples = [packed[:, packed[2] == j] for j in np.unique(packed[2])]
  assert len(examples) == 4  # three examples and the padding
  alone = []
  for e in examples:  # right-padded with EOS under another seq_idx, mask 0
    a = np.zeros((3, 256), np.int32)
    a[0], a[2] = 256, 1
    a[:2, :e.shape[1]], a[2, :e.shape[1]] = e[:2], 0
    alone.append(a)
  batch = loader_lib._make_batch([packed, *alone], 256, 255)
  grad = jax.jit(jax.grad(lambda p, b: loss_sums(p, b, cfg, rt)[0]))
  per_row = jax.jit(jax.vmap(lambda b: loss_sums(params, jax.tree.map(lambda x: x[None], b),
                                                 cfg, rt)[0]))
  losses = np.asarray(per_row({k: jnp.asarray(v) for k, v in batch.items()}))
  np.testing.assert_allclose(losses[0], losses[1:].sum(), rtol=1e-5)
  assert batch["loss_mask"][0].sum() == sum(batch["loss_mask"][1:].sum(axis=1))
  # Scrambling the targets where the mask is 0 changes no gradient at all.
  one = {k: v[:1] for k, v in batch.items()}
  scrambled = dict(one, targets=np.where(one["loss_mask"] == 0,
                                         np.random.default_rng(1).integers(0, 257, one["targets"].shape),
                                         one["targets"]).astype(np.int32))
  g1, g2 = grad(params, one), grad(params, scrambled)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), g1, g2)
  assert (one["targets"] != scrambled["targets"]).any()


@pytest.mark.parametrize("line, message", [
    ({"messages": [{"content": "hi"}]}, "line 2: message 1 has no 'role'"),
    ({"prompt": "hi", "response": "  "}, "line 2: message 2 is an empty assistant response"),
    ({"instruction": "hi", "output": "x"}, "line 2: no 'messages'.*found \\['instruction', 'output'\\]"),
    (b'{"prompt": "caf\xe9", "response": "x"}\n', "line 2: not valid UTF-8 \\(byte 0xe9 at column 16"),
])
def test_bad_chat_lines_are_named(tmp_path, line, message):
  src = _write(tmp_path / "bad.jsonl", [CONVS[1], line])
  with pytest.raises(data.ChatFormatError, match=message):
    data.prepare_chat_dataset(src, "bad", root=str(tmp_path), seq_len=63)
