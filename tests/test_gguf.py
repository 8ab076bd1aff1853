"""The GGUF export (`mamba_train.interop.gguf`), read back by gguf's own reader.

llama.cpp itself is not run here (building it takes longer than the suite has; the
comparison with llama.cpp's greedy tokens and logits is benchmarks/gguf_llamacpp.py,
docs/bench/gguf.md). What stands in for it: a float64 numpy forward pass that reads
the file's tensors as llama.cpp's mamba2 and nemotron_h graphs read them (the in
projection split z | xBC | dt, the conv kernel's rows, A itself, the gated norm by
groups, heads sharing key/value heads) and gives our model's logits; every tensor's
name, shape and type and every key; quantized tensors within their format's bound;
the vocabulary as llama.cpp's loader wants it (as many tokens as embedding rows, merges,
the end-of-text id)."""

import json
import subprocess
import sys

import gguf  # the `gguf` extra, in the test extra
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mamba_train import Mamba2Config
from mamba_train.data.tokenizer import EOS_TOKEN, byte_tokenizer
from mamba_train.interop import export, gguf as gguf_export

from helpers import rel, scaled_random_model, script_env

forward = nnx.jit(lambda model, ids: model(ids))
IDS = np.array([[3, 200, 17, 256, 90, 44, 44, 8, 130, 61, 23, 255, 0, 12, 33, 71, 5, 99, 1]])

# Mamba-2 alone (tied head, 2 groups); a hybrid of every kind llama.cpp's nemotron_h
# has (untied head, grouped-query attention).
MAMBA2 = Mamba2Config(d_model=64, n_layer=2, vocab_size=257, d_state=16, headdim=16, ngroups=2,
                      chunk_size=8)
HYBRID = Mamba2Config(d_model=64, n_layer=4, vocab_size=257, d_state=16, headdim=16, ngroups=2,
                      chunk_size=8, layer_pattern="M*-M", attn_num_heads=4, attn_num_heads_kv=2,
                      attn_head_dim=16, d_intermediate=96, tie_embeddings=False)


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  byte_tokenizer().save(str(path))
  return path


@pytest.fixture(scope="module", params=["mamba2", "hybrid"])
def written(request, byte_tok, tmp_path_factory):
  """(model, {dtype: GGUFReader of its export})."""
  model = scaled_random_model(MAMBA2 if request.param == "mamba2" else HYBRID, seed=1)
  d = tmp_path_factory.mktemp(request.param)
  return model, {dt: gguf.GGUFReader(gguf_export.save_gguf(model, d / f"{dt}.gguf", tokenizer_file=byte_tok,
                                                           eos_token_id=256, dtype=dt))
                 for dt in gguf_export.DTYPES}


def tensors(reader) -> dict[str, np.ndarray]:
  """Every tensor of the file, dequantized, in numpy's (row-major, ggml's ne reversed) shape."""
  return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
      tuple(reversed([int(n) for n in t.shape]))) for t in reader.tensors}


def field(reader, key):
  return reader.fields[key].contents()


def arch_key(reader, key):
  """The architecture's key `key` (`ssm.state_size` is `mamba2.ssm.state_size`)."""
  return field(reader, f"{field(reader, 'general.architecture')}.{key}")


# ----------------------------------------------------------------------------
# llama.cpp's graphs in float64 numpy, reading only the file.


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _mamba2(t, b, h, reader, eps):
  """llama.cpp's build_mamba2_layer on one sequence h (l, d), as a sequential recurrence."""
  ng, ns, k = (arch_key(reader, f"ssm.{n}") for n in ("group_count", "state_size", "conv_kernel"))
  di, nh = arch_key(reader, "ssm.inner_size"), arch_key(reader, "ssm.time_step_rank")
  hp, conv_dim = di // nh, di + 2 * ng * ns
  zxbcdt = h @ t[f"{b}ssm_in.weight"].T
  z, xbc, dt = zxbcdt[:, :di], zxbcdt[:, di:di + conv_dim], zxbcdt[:, di + conv_dim:]
  w = t[f"{b}ssm_conv1d.weight"]  # (conv_dim, k): oldest input first
  padded = np.concatenate([np.zeros((k - 1, conv_dim)), xbc])
  xbc = sum(padded[j:j + len(h)] * w[:, j] for j in range(k)) + t[f"{b}ssm_conv1d.bias"]
  xbc = xbc / (1 + np.exp(-xbc))
  x = xbc[:, :di].reshape(-1, nh, hp)
  B = xbc[:, di:di + ng * ns].reshape(-1, ng, ns)
  C = xbc[:, di + ng * ns:].reshape(-1, ng, ns)
  dt = np.logaddexp(0, dt + t[f"{b}ssm_dt.bias"])  # softplus
  A, D = t[f"{b}ssm_a"][:, 0], t[f"{b}ssm_d"][:, 0]
  grp = np.arange(nh) // (nh // ng)
  s, ys = np.zeros((nh, hp, ns)), []
  for i in range(len(h)):
    s = s * np.exp(dt[i] * A)[:, None, None] + (dt[i][:, None] * x[i])[..., None] * B[i, grp][:, None, :]
    ys.append(np.einsum("hpn,hn->hp", s, C[i, grp]) + D[:, None] * x[i])
  y = np.stack(ys).reshape(len(h), di) * (z / (1 + np.exp(-z)))
  norm = t[f"{b}ssm_norm.weight"]  # (groups, d_inner / groups)
  y = _rms(y.reshape(len(h), ng, -1), norm, eps).reshape(len(h), di)
  return y @ t[f"{b}ssm_out.weight"].T


def _attention(t, b, h, reader, il):
  nh, nkv = arch_key(reader, "attention.head_count"), arch_key(reader, "attention.head_count_kv")[il]
  hd, n = arch_key(reader, "attention.key_length"), len(h)
  q = (h @ t[f"{b}attn_q.weight"].T).reshape(n, nh, hd)
  k = (h @ t[f"{b}attn_k.weight"].T).reshape(n, nkv, hd)[:, np.arange(nh) // (nh // nkv)]
  v = (h @ t[f"{b}attn_v.weight"].T).reshape(n, nkv, hd)[:, np.arange(nh) // (nh // nkv)]
  s = np.einsum("qhe,khe->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), 1)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hqk,khe->qhe", p, v).reshape(n, nh * hd) @ t[f"{b}attn_output.weight"].T


def llama_cpp_logits(reader, ids) -> np.ndarray:
  """The logits llama.cpp's graph computes from the file's tensors and keys."""
  t, arch = tensors(reader), field(reader, "general.architecture")
  eps = arch_key(reader, "attention.layer_norm_rms_epsilon")
  ff = arch_key(reader, "feed_forward_length")
  kv = arch_key(reader, "attention.head_count_kv") if arch == "nemotron_h" else None
  x = t["token_embd.weight"][ids]
  for il in range(arch_key(reader, "block_count")):
    b = f"blk.{il}."
    h = _rms(x, t[f"{b}attn_norm.weight"], eps)
    if arch == "mamba2" or (kv[il] == 0 and ff[il] == 0):  # llama.cpp's is_recr
      x = x + _mamba2(t, b, h, reader, eps)
    elif ff[il] == 0:
      x = x + _attention(t, b, h, reader, il)
    else:  # squared ReLU
      x = x + np.maximum(h @ t[f"{b}ffn_up.weight"].T, 0) ** 2 @ t[f"{b}ffn_down.weight"].T
  return _rms(x, t["output_norm.weight"], eps) @ t.get("output.weight", t["token_embd.weight"]).T


# ----------------------------------------------------------------------------


def test_float32_file_computes_our_logits(written):
  """llama.cpp's graph on the float32 file gives our float32 logits (1e-5)."""
  model, readers = written
  want = np.asarray(forward(model, jnp.asarray(IDS)))[0, :, :model.config.vocab_size]
  got = llama_cpp_logits(readers["float32"], IDS[0])
  assert got.shape == want.shape
  assert rel(got, want) < 1e-5


def test_every_tensor_and_key(written):
  model, readers = written
  cfg = model.config
  arch = "mamba2" if cfg.pattern == "M" * cfg.n_layer else "nemotron_h"
  f32 = tensors(readers["float32"])
  p = {k: (np.asarray(v) if not isinstance(v, dict) else {n: np.asarray(a) for n, a in v.items()})
       for k, v in model.params().items()}
  # The model's own numbers where llama.cpp takes them changed: the tied embedding as the
  # head (no output.weight), A as -exp(A_log), A and D as columns.
  np.testing.assert_array_equal(f32["token_embd.weight"], p["embedding"][:cfg.vocab_size])
  assert ("output.weight" in f32) == (not cfg.tie_embeddings)
  mamba_layers = [i for i, k in enumerate(cfg.pattern) if k == "M"]
  for j, i in enumerate(mamba_layers):
    np.testing.assert_allclose(f32[f"blk.{i}.ssm_a"][:, 0], -np.exp(p["layers"]["A_log"][j].astype(np.float64)),
                               rtol=1e-6)
    np.testing.assert_array_equal(f32[f"blk.{i}.ssm_d"][:, 0], p["layers"]["D"][j])
    assert f32[f"blk.{i}.ssm_norm.weight"].shape == (cfg.ngroups, cfg.d_inner // cfg.ngroups)
    assert f32[f"blk.{i}.ssm_conv1d.weight"].shape == (cfg.conv_dim, cfg.d_conv)
  # Names: exactly what llama.cpp's loader creates for this pattern (gguf's table).
  kinds = {"M": ["attn_norm", "ssm_in", "ssm_conv1d", "ssm_conv1d_b", "ssm_dt", "ssm_a", "ssm_d", "ssm_norm",
                 "ssm_out"],
           "*": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"], "-": ["attn_norm", "ffn_up", "ffn_down"]}
  suffix = {"ssm_a": "", "ssm_d": "", "ssm_dt": ".bias", "ssm_conv1d_b": ".bias"}
  want = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not cfg.tie_embeddings else set())
  for i, k in enumerate(cfg.pattern):
    want |= {f"blk.{i}.{n.removesuffix('_b')}{suffix.get(n, '.weight')}" for n in kinds[k]}
  for dt, reader in readers.items():
    assert {t.name for t in reader.tensors} == want
    assert field(reader, "general.architecture") == arch
    assert field(reader, "general.file_type") == int(gguf_export.DTYPES[dt][1])
    for t in reader.tensors:
      big = t.name.endswith(".weight") and len(t.shape) == 2 and "norm" not in t.name and "conv1d" not in t.name
      assert t.tensor_type == (gguf_export.DTYPES[dt][0] if big else gguf.GGMLQuantizationType.F32), t.name
  keys = {f"{arch}.{k}": v for k, v in {
      "block_count": cfg.n_layer, "embedding_length": cfg.d_model, "ssm.conv_kernel": cfg.d_conv,
      "ssm.inner_size": cfg.d_inner, "ssm.state_size": cfg.d_state, "ssm.time_step_rank": cfg.nheads,
      "ssm.group_count": cfg.ngroups}.items()}
  if arch == "nemotron_h":
    keys.update({f"{arch}.feed_forward_length": [96 if k == "-" else 0 for k in cfg.pattern],
                 f"{arch}.attention.head_count_kv": [2 if k == "*" else 0 for k in cfg.pattern],
                 f"{arch}.attention.head_count": 4, f"{arch}.attention.key_length": 16})
  for k, v in keys.items():
    assert field(readers["q8_0"], k) == v, k
  assert field(readers["q8_0"], f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.norm_eps)


def test_quantized_within_their_bounds(written):
  """bfloat16: each weight rounded to 8 significant bits; q8_0: each block of 32 within
  half its step d = max |w| / 127, plus 127 times d's rounding to float16 (the format
  stores d in float16: at most d * 2^-11); the rest float32 and exact."""
  _, readers = written
  f32, bf16, q8 = (tensors(readers[d]) for d in ("float32", "bfloat16", "q8_0"))
  for name, w in f32.items():
    assert np.all(np.abs(bf16[name] - w) <= np.abs(w) * 2.0 ** -8), name
    blocks = w.reshape(-1, 32) if w.ndim == 2 and w.shape[-1] % 32 == 0 else None
    err = np.abs(q8[name] - w)
    if blocks is None or "norm" in name or "conv1d" in name:
      np.testing.assert_array_equal(q8[name], w)
    else:
      step = np.abs(blocks).max(-1, keepdims=True) / 127
      assert np.all(err.reshape(-1, 32) <= step * (0.5 + 127 * 2.0 ** -11)), name
      assert err.max() > 0  # it was quantized


def test_byte_vocabulary(written):
  """The byte tokenizer as llama.cpp's gpt2 vocabulary: byte b is GPT-2's stand-in character
  for b, end-of-text a control token."""
  _, readers = written
  r = readers["q8_0"]
  tokens = field(r, "tokenizer.ggml.tokens")
  # GPT-2's byte -> printable character table: printable Latin-1 as itself, the rest from U+0100.
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  table = {b: chr(b) for b in printable}
  table.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable)})
  assert tokens == [table[b] for b in range(256)] + [EOS_TOKEN]
  types = field(r, "tokenizer.ggml.token_type")
  assert types == [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL]
  assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "gpt-2"
  assert field(r, "tokenizer.ggml.eos_token_id") == 256 and field(r, "tokenizer.ggml.add_bos_token") is False
  # Its one merge never applies: both halves are longer than a single character.
  assert [len(h) for h in field(r, "tokenizer.ggml.merges")[0].split(" ")] == [2, 2]


def test_bpe_vocabulary(tmp_path):
  """A trained byte-level BPE tokenizer: its tokens, merges and special token, the
  model's rows past it llama.cpp's unused [PAD<i>] tokens."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(["the cat sat on the mat, then the cat ate"] * 4, trainers.BpeTrainer(
      vocab_size=280, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp_path / "bpe.json"))
  blob = json.loads((tmp_path / "bpe.json").read_text())
  v = gguf_export.read_vocab(tmp_path / "bpe.json", 300, tok.token_to_id(EOS_TOKEN))
  assert v.merges == [" ".join(m) if isinstance(m, list) else m for m in blob["model"]["merges"]] != []
  n = tok.get_vocab_size()
  assert v.tokens[:n] == [tok.id_to_token(i) for i in range(n)]
  assert v.tokens[n:] == [f"[PAD{i}]" for i in range(n, 300)] and v.pre == "gpt-2"
  assert v.types[tok.token_to_id(EOS_TOKEN)] == gguf.TokenType.CONTROL
  assert set(v.types[n:]) == {gguf.TokenType.UNUSED}
  # Split by Llama 3's regex (whole words looked up first) or Qwen2's, then ByteLevel: the
  # names llama.cpp knows them by; Llama 3's split with merges applied to every word has none.
  for regex, (name, ignore_merges) in gguf_export.SPLIT_PRES.items():
    for ignore in (True, False):
      blob["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
          {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
          {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
      blob["model"]["ignore_merges"] = ignore
      (tmp_path / "split.json").write_text(json.dumps(blob))
      if ignore == ignore_merges:
        assert gguf_export.read_vocab(tmp_path / "split.json", 300, None).pre == name
      else:
        with pytest.raises(gguf_export.TokenizerNotExpressibleError, match="pre_tokenizer"):
          gguf_export.read_vocab(tmp_path / "split.json", 300, None)


def test_refusals(byte_tok, tmp_path):
  model = scaled_random_model(MAMBA2.replace(n_layer=1), seed=0)
  for cfg, match in ((MAMBA2.replace(dt_limit=(0.0, 5.0)), "clamps dt"),
                     (MAMBA2.replace(ssd_window=16), "ssd_window"),
                     (HYBRID.replace(attn_rotary_emb_dim=8), "rotary"),
                     (HYBRID.replace(layer_pattern="ME", n_layer=2, n_routed_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32, moe_shared_expert_intermediate_size=32),
                      "mixture-of-experts")):
    with pytest.raises(export.NotExpressibleError, match=match):
      gguf_export.architecture(cfg)
  with pytest.raises(export.ExportPathError, match=r"<name>\.gguf"):
    gguf_export.save_gguf(model, tmp_path / "m.bin", tokenizer_file=byte_tok)
  keep = tmp_path / "notes.gguf"
  keep.write_text("mine")
  with pytest.raises(FileExistsError):
    gguf_export.save_gguf(model, keep, tokenizer_file=byte_tok)
  with pytest.raises(export.ExportPathError, match="not a GGUF file"):
    gguf_export.save_gguf(model, keep, tokenizer_file=byte_tok, overwrite=True)
  assert keep.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.gguf"]
  wordpiece = tmp_path / "wp.json"
  wordpiece.write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}}, "decoder": {"type": "WordPiece"},
                                   "pre_tokenizer": {"type": "Whitespace"}}))
  with pytest.raises(gguf_export.TokenizerNotExpressibleError, match="WordPiece.*convert_hf_to_gguf"):
    gguf_export.read_vocab(wordpiece, 257, None)


def test_cli_exports_a_transformers_directory(byte_tok, tmp_path):
  """scripts/export.py --format gguf on a transformers export (its tokenizer found beside
  it): the file holds the same tensors as the library's; a wrong --dtype is one line."""
  model = scaled_random_model(MAMBA2, seed=1)
  export.save_hf(model, tmp_path / "hf", tokenizer_file=byte_tok, eos_token=EOS_TOKEN, eos_token_id=256)
  cmd = [sys.executable, "scripts/export.py", "--model", str(tmp_path / "hf"), "--format", "gguf"]
  r = subprocess.run(cmd + ["--out", str(tmp_path / "m.gguf"), "--dtype", "q8_0"], capture_output=True,
                     text=True, env=script_env(), timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "wrote GGUF (mamba2, q8_0)" in r.stdout
  lib = gguf_export.save_gguf(model, tmp_path / "lib.gguf", tokenizer_file=byte_tok, eos_token_id=256,
                              dtype="q8_0")
  a, b = gguf.GGUFReader(tmp_path / "m.gguf"), gguf.GGUFReader(lib)
  assert [(t.name, t.tensor_type) for t in a.tensors] == [(t.name, t.tensor_type) for t in b.tensors]
  for ta, tb in zip(a.tensors, b.tensors):
    np.testing.assert_array_equal(ta.data, tb.data)
  assert field(a, "tokenizer.ggml.tokens") == field(b, "tokenizer.ggml.tokens")
