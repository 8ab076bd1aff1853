"""The input pipeline: preparation round trip, loader sharding and resume, bad inputs.

Every dataset here is made in a temp directory by the test; nothing touches the network.
"""

import collections
import json
import logging
import os
import socket

import numpy as np
import pytest

from mamba_train import data
from mamba_train.data import loader as loader_lib, tokenizer as tokenizer_lib

from helpers import orbax_round_trip, random_model

EOS = 256
SEQ_LEN = 16


def _docs(n=40, seed=0):
  """Documents of varied lengths with multi-byte text and a literal EOS string."""
  rng = np.random.default_rng(seed)
  words = ["alpha", "β-decay", "日本語", "naïve", "x = 1\n", "\t", "<|endoftext|>", "ok."]
  return [" ".join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(n)]


def _write_jsonl(path, docs, field="text"):
  with open(path, "w", encoding="utf-8") as f:
    for d in docs:
      f.write(json.dumps({field: d, "id": 0}) + "\n")
  return str(path)


def _split_docs(tokens, eos=EOS):
  """Token stream -> list of token lists, each ending at (and without) EOS."""
  cuts = np.flatnonzero(tokens == eos)
  assert len(cuts) and cuts[-1] == len(tokens) - 1, "stream must end with EOS"
  return [tokens[a + 1:b] for a, b in zip(np.concatenate([[-1], cuts[:-1]]), cuts)]


@pytest.fixture(scope="module")
def jsonl_dataset(tmp_path_factory):
  root = tmp_path_factory.mktemp("data")
  docs = _docs()
  src = _write_jsonl(root / "docs.jsonl", docs)
  return data.prepare_dataset(src, "docs", root=str(root), val_fraction=0.25), docs


@pytest.fixture(scope="module")
def window_dataset(tmp_path_factory):
  """Unique random windows, train split holding exactly 56 windows of SEQ_LEN."""
  root = tmp_path_factory.mktemp("windows")
  rng = np.random.default_rng(1)
  # 9 train docs of 99 letters + EOS = 900 tokens -> (900 - 1) // 16 = 56 windows.
  docs = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 99)) for _ in range(10)]
  src = _write_jsonl(root / "w.jsonl", docs)
  path = data.prepare_dataset(src, "w", root=str(root), val_fraction=0.1)
  tokens = np.load(os.path.join(path, "train.npy"))
  assert len(tokens) == 900
  index = {tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1].astype(np.int32).tobytes(): i
           for i in range(56)}
  assert len(index) == 56
  return path, index


def _window_ids(batch, index):
  full = np.concatenate([batch["input_ids"], batch["targets"][:, -1:]], axis=1)
  return [index[row.astype(np.int32).tobytes()] for row in full]


# --- Tokenizer and preparation --------------------------------------------------


def test_byte_tokenizer_is_utf8_bytes_and_loads_in_transformers(tmp_path):
  from transformers import PreTrainedTokenizerFast
  tok = tokenizer_lib.byte_tokenizer()
  text = "héllo 日本\n\t<|endoftext|> \x00\x7f"
  tok.encode_special_tokens = True
  ids = tok.encode(text, add_special_tokens=False).ids
  assert ids == list(text.encode("utf-8"))  # The numpy fast path in prepare relies on this.
  assert tok.token_to_id("<|endoftext|>") == EOS and tok.get_vocab_size() == 257
  tok.save(str(tmp_path / "tokenizer.json"))
  hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                               eos_token="<|endoftext|>")
  assert hf.eos_token_id == EOS
  assert hf("héllo")["input_ids"] == list("héllo".encode())
  assert hf.decode(ids) == text


def test_round_trip_and_metadata(jsonl_dataset):
  path, docs = jsonl_dataset
  meta = data.read_metadata(path)
  assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (257, EOS, "uint16")
  decoded = []
  for split, info in meta["splits"].items():
    tokens = np.load(os.path.join(path, info["file"]))
    assert len(tokens) == info["tokens"]
    split_docs = [bytes(d.astype(np.uint8)).decode() for d in _split_docs(tokens)]
    assert len(split_docs) == info["documents"]
    decoded += split_docs
  assert meta["splits"]["validation"]["documents"] == 10
  assert collections.Counter(decoded) == collections.Counter(docs)
  assert os.path.isfile(os.path.join(path, "tokenizer.json"))


def test_round_trip_with_tokenizer_json(tmp_path):
  """A trained BPE tokenizer goes through the tokenizers path, not the byte fast path."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  docs = _docs(30, seed=3)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(docs, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp_path / "tok.json"))
  src = _write_jsonl(tmp_path / "d.jsonl", docs)
  path = data.prepare_dataset(src, root=str(tmp_path), tokenizer=str(tmp_path / "tok.json"),
                              val_fraction=0)
  assert os.path.basename(path) == "d"
  meta = data.read_metadata(path)
  eos = meta["eos_id"]
  assert eos == tok.token_to_id("<|endoftext|>") and list(meta["splits"]) == ["train"]
  tokens = np.load(os.path.join(path, "train.npy"))
  # A literal "<|endoftext|>" in the text is text: the EOS count equals the document count.
  assert (tokens == eos).sum() == len(docs)
  decoded = [tok.decode(d.tolist()) for d in _split_docs(tokens, eos)]
  assert decoded == docs  # no validation split, so the order is kept


def test_rerun_reuses_and_changed_input_rebuilds(tmp_path, caplog):
  src = _write_jsonl(tmp_path / "r.jsonl", _docs(8))
  path = data.prepare_dataset(src, root=str(tmp_path))
  created = data.read_metadata(path)["fingerprint"]
  with caplog.at_level(logging.INFO):
    assert data.prepare_dataset(src, root=str(tmp_path)) == path
  assert "Reusing" in caplog.text
  _write_jsonl(tmp_path / "r.jsonl", _docs(9))
  data.prepare_dataset(src, root=str(tmp_path))
  meta = data.read_metadata(path)
  assert meta["fingerprint"] != created
  assert sum(s["documents"] for s in meta["splits"].values()) == 9
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dirs left


def test_default_corpus_builds_offline(tmp_path, monkeypatch):
  def no_network(*args, **kwargs):
    raise AssertionError("the default corpus must not use the network")
  monkeypatch.setattr(socket.socket, "connect", no_network)
  path = data.ensure_default_corpus(str(tmp_path), max_bytes=300_000)
  meta = data.read_metadata(path)
  assert meta["tokenizer"] == "byte" and meta["splits"]["train"]["tokens"] > 100_000
  assert "standard library" in meta["source"]
  assert data.ensure_default_corpus(str(tmp_path), max_bytes=300_000) == path


# --- Loader ---------------------------------------------------------------------


def test_batch_fields_and_seq_idx():
  w = np.array([5, 6, EOS, 7, EOS, EOS, 8, 9, 10], np.uint16)
  b = loader_lib._make_batch([w, None], EOS, len(w) - 1)
  np.testing.assert_array_equal(b["input_ids"][0], w[:-1])
  np.testing.assert_array_equal(b["targets"][0], w[1:])
  # The EOS belongs to the document it ends; the token after it starts the next.
  np.testing.assert_array_equal(b["seq_idx"][0], [0, 0, 0, 1, 1, 2, 3, 3])
  np.testing.assert_array_equal(b["loss_mask"], [[1] * 8, [0] * 8])
  assert {k: v.dtype.name for k, v in b.items()} == dict(
      input_ids="int32", targets="int32", seq_idx="int32", loss_mask="float32")


def test_seq_idx_matches_documents_in_loaded_batches(jsonl_dataset):
  path, docs = jsonl_dataset
  it = data.make_train_loader(path, seq_len=64, global_batch_size=4, seed=0)
  doc_set = {d.encode() for d in docs}
  for _ in range(3):
    b = next(it)
    for x, s in zip(b["input_ids"], b["seq_idx"]):
      assert s[0] == 0 and np.all(np.diff(s) >= 0)
      pieces = [x[s == k] for k in range(s[-1] + 1)]
      for k, piece in enumerate(pieces):
        assert (piece == EOS).sum() == (k < len(pieces) - 1)  # only the last may lack its EOS
        text = bytes(piece[piece != EOS].astype(np.uint8))
        if 0 < k < len(pieces) - 1:  # whole documents inside the window
          assert text in doc_set


def test_two_processes_disjoint_and_cover_epoch(window_dataset):
  path, index = window_dataset
  kw = dict(seq_len=SEQ_LEN, global_batch_size=4, seed=7)
  p0 = data.make_train_loader(path, process_index=0, process_count=2, **kw)
  p1 = data.make_train_loader(path, process_index=1, process_count=2, **kw)
  single = data.make_train_loader(path, **kw)
  seen = []
  for _ in range(14):  # 56 windows / 4 per global step = one epoch
    a, b = _window_ids(next(p0), index), _window_ids(next(p1), index)
    assert len(a) == len(b) == 2 and not set(a) & set(b)
    assert a + b == _window_ids(next(single), index)  # the same global batch, row for row
    seen += a + b
  assert sorted(seen) == list(range(56))
  second = [w for _ in range(14) for w in _window_ids(next(single), index)]
  assert sorted(second) == list(range(56)) and second != seen  # reshuffled per epoch


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  for a, b in zip(batches_a, batches_b, strict=True):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_resume_with_get_state(window_dataset):
  path, _ = window_dataset
  kw = dict(seq_len=SEQ_LEN, global_batch_size=4, seed=3, process_index=1, process_count=2)
  reference = _take(data.make_train_loader(path, **kw), 20)  # crosses an epoch boundary
  it = data.make_train_loader(path, **kw)
  _take(it, 12)
  state = it.get_state()
  fresh = data.make_train_loader(path, **kw)
  fresh.set_state(state)
  _assert_same(_take(fresh, 8), reference[12:])


def test_resume_with_orbax_composite(window_dataset, tmp_path):
  path, _ = window_dataset
  kw = dict(seq_len=SEQ_LEN, global_batch_size=4, seed=5)
  reference = _take(data.make_train_loader(path, **kw), 6)
  it = data.make_train_loader(path, **kw)
  _take(it, 3)
  fresh = data.make_train_loader(path, **kw)
  orbax_round_trip(it, fresh, tmp_path / "ckpt")
  _assert_same(_take(fresh, 3), reference[3:])


def test_eval_loader_covers_validation_once_and_pads(jsonl_dataset):
  path, _ = jsonl_dataset
  meta = data.read_metadata(path)
  n_windows = (meta["splits"]["validation"]["tokens"] - 1) // SEQ_LEN
  kw = dict(seq_len=SEQ_LEN, global_batch_size=8)
  batches = list(data.make_eval_loader(path, **kw))
  assert len(batches) == -(-n_windows // 8)
  assert sum(b["loss_mask"][:, 0].sum() for b in batches) == n_windows
  _assert_same(batches, list(data.make_eval_loader(path, **kw)))  # deterministic
  p1 = list(data.make_eval_loader(path, process_index=1, process_count=2, **kw))
  assert len(p1) == len(batches) and p1[0]["input_ids"].shape == (4, SEQ_LEN)
  assert len(list(data.make_eval_loader(path, num_batches=1, **kw))) == 1
  # A process whose rows are all past the last window still yields its (padding) batch.
  big = 2 * n_windows + 2
  p1 = list(data.make_eval_loader(path, seq_len=SEQ_LEN, global_batch_size=big,
                                  process_index=1, process_count=2))
  assert len(p1) == 1 and p1[0]["loss_mask"].sum() == 0


def test_to_global_single_process(jsonl_dataset):
  import jax

  from mamba_train.parallel import sharding
  from mamba_train.parallel.mesh import make_mesh
  path, _ = jsonl_dataset
  b = next(data.make_train_loader(path, seq_len=SEQ_LEN, global_batch_size=2, seed=0))
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  g = sharding.to_global(b, mesh)
  assert g["input_ids"].shape == (2, SEQ_LEN)
  np.testing.assert_array_equal(np.asarray(g["seq_idx"]), b["seq_idx"])


def test_packed_window_with_seq_idx_equals_documents_alone():
  import jax.numpy as jnp
  from flax import nnx

  from mamba_train import config_for
  rng = np.random.default_rng(0)
  # Lengths straddle the tiny config's 64-token chunks; each document ends with EOS.
  lengths = (69, 30, 40)
  docs = [np.append(rng.integers(0, 256, n), EOS) for n in lengths]
  window = np.append(np.concatenate(docs), EOS)
  b = loader_lib._make_batch([window], EOS, len(window) - 1)
  width = b["input_ids"].shape[1]
  # One call, one compile. Rows: packed with seq_idx; packed without; each document
  # alone, right-padded (causal, so the padding changes nothing before it).
  rows = np.zeros((2 + len(docs), width), np.int32)
  rows[:2] = b["input_ids"]
  seq_idx = np.zeros_like(rows)
  seq_idx[0] = b["seq_idx"][0]
  for r, d in enumerate(docs):
    rows[2 + r, :len(d)] = d
  m = random_model(config_for("tiny", n_layer=2), rng)
  out = np.asarray(nnx.jit(lambda m, x, s: m(x, seq_idx=s))(m, jnp.asarray(rows),
                                                             jnp.asarray(seq_idx)))
  alone = np.concatenate([out[2 + r, :len(d)] for r, d in enumerate(docs)])
  scale = np.abs(alone).max()
  np.testing.assert_allclose(out[0], alone, rtol=0, atol=1e-5 * scale)
  assert np.abs(out[1] - alone).max() > 1e-2 * scale  # seq_idx is what makes them equal


# --- Bad input ------------------------------------------------------------------


def test_missing_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl.*does not exist"):
    data.prepare_dataset(str(tmp_path / "nope.jsonl"), root=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="No files match"):
    data.prepare_dataset(str(tmp_path / "*.parquet"), root=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="does not exist.*prepare_data.py"):
    data.make_train_loader(str(tmp_path / "absent"), seq_len=8, global_batch_size=1, seed=0)


def test_empty_dataset(tmp_path):
  src = _write_jsonl(tmp_path / "empty.jsonl", ["", ""])
  with pytest.raises(ValueError, match="empty.jsonl.*no non-empty documents"):
    data.prepare_dataset(src, root=str(tmp_path))


def test_missing_text_field_lists_fields(tmp_path):
  src = _write_jsonl(tmp_path / "f.jsonl", ["a", "b"], field="content")
  with pytest.raises(KeyError, match=r"no text field 'text'.*\['content', 'id'\]"):
    data.prepare_dataset(src, root=str(tmp_path))


def test_non_utf8_text_is_replaced_and_counted(tmp_path, caplog):
  (tmp_path / "src").mkdir()
  (tmp_path / "src" / "a.txt").write_bytes(b"caf\xe9 ok\n")
  (tmp_path / "src" / "b.txt").write_bytes("fine ü\n".encode())
  with caplog.at_level(logging.WARNING):
    path = data.prepare_dataset(str(tmp_path / "src"), root=str(tmp_path), val_fraction=0)
  assert "1 U+FFFD replacement characters" in caplog.text
  assert data.read_metadata(path)["splits"]["train"]["replacement_characters"] == 1
  (tmp_path / "bad.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
  with pytest.raises(ValueError, match="bad.jsonl.*not valid UTF-8.*iconv"):
    data.prepare_dataset(str(tmp_path / "bad.jsonl"), root=str(tmp_path))


def test_model_vocab_and_tokenizer_checks(jsonl_dataset, tmp_path):
  path, _ = jsonl_dataset
  meta = data.read_metadata(path)
  data.validate_for_model(meta, 512, tokenizer="byte")
  data.validate_for_model(meta, 512, tokenizer=os.path.join(path, "tokenizer.json"))
  with pytest.raises(ValueError, match="token id 256, outside the model's vocabulary of 256"):
    data.validate_for_model(meta, 256)
  with pytest.raises(ValueError, match="has 1000 tokens but the model's vocab_size is 512"):
    data.validate_for_model(dict(meta, vocab_size=1000), 512)
  with pytest.raises(ValueError, match="tokenized with 'byte' but the config names"):
    data.validate_for_model(meta, 60_000, tokenizer="EleutherAI/gpt-neox-20b")
  other = tokenizer_lib.byte_tokenizer()
  other.add_special_tokens(["<pad>"])
  other.save(str(tmp_path / "other.json"))
  with pytest.raises(ValueError, match="tokenized with 'byte'"):
    data.validate_for_model(meta, 512, tokenizer=str(tmp_path / "other.json"))


def test_damaged_or_incomplete_dataset(tmp_path):
  src = _write_jsonl(tmp_path / "x.jsonl", _docs(6))
  path = data.prepare_dataset(src, root=str(tmp_path))
  np.save(os.path.join(path, "train.npy"), np.zeros(5, np.uint16))
  with pytest.raises(ValueError, match="train.npy.*damaged"):
    data.make_train_loader(path, seq_len=4, global_batch_size=1, seed=0)
  with pytest.raises(ValueError, match="fewer than seq_len"):
    data.make_eval_loader(path, seq_len=10_000, global_batch_size=1)
  os.remove(os.path.join(path, "metadata.json"))
  with pytest.raises(FileNotFoundError, match="metadata.json.*not a prepared dataset"):
    data.read_metadata(path)
