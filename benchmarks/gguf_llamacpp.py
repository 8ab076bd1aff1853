"""llama.cpp on our GGUF export: its tokens, logits and greedy continuation beside
ours (not a test: llama.cpp is built from source, longer than the suite has).

  pip install llama-cpp-python      # builds llama.cpp (CMAKE_ARGS="-DGGML_NATIVE=off" for a portable build)
  python -m benchmarks.gguf_llamacpp                          # random tiny Mamba-2 and hybrid, byte and BPE tokenizers
  python -m benchmarks.gguf_llamacpp --model runs/tiny        # a trained model (anything load_model reads)

For each model, tokenizer and --dtypes (float32, bfloat16, q8_0): export with
`save_gguf`, load the file in llama.cpp (llama-cpp-python, no repair of any kind),
and compare
  * tokenization: llama.cpp's ids for --texts against the tokenizer's own (tokenizers);
  * logits: llama.cpp's over the prompt (one batch) against our float32 forward pass:
    the largest absolute difference and the relative one (norm of the difference over
    the norm of ours);
  * greedy decoding: --new_tokens tokens after the prompt, llama.cpp stepping its own
    recurrent state one token at a time, against `mamba_train.generate`: how many of
    them agree before the first difference.
Without --model the models are random (weights scaled as a trained model's, so the
next-token distributions are far from uniform). Prints a markdown table
(docs/bench/gguf.md keeps the dated results).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mamba_train import Mamba2Config, generate
from mamba_train.data.tokenizer import EOS_TOKEN, byte_tokenizer, load_tokenizer
from mamba_train.interop import gguf as gguf_export
from mamba_train.model.lm import Mamba2LM

TEXTS = ["The cat sat on the mat.", "  two  spaces,\ttabs\nand newlines\n\n", "naïve café — 東京 🦙 3.14 1000000",
         "don't won't I'll they've", "<|endoftext|> after a special token"]
PROMPT = "the cat sat on the mat, then the cat"


def random_model(cfg: Mamba2Config, seed: int) -> Mamba2LM:
  """The library's initialisation with each weight then scaled by its own factor in
  [0.5, 1.5] (norms and D differ by channel, as after training) and the head by 4, so
  that the logits spread by about 1 (initialised: about 0.2) and the next-token
  distributions are far from uniform."""
  rng = np.random.default_rng(seed)
  params = Mamba2LM(cfg, rngs=nnx.Rngs(seed)).params()
  params = jax.tree.map(lambda a: np.asarray(a) * rng.uniform(0.5, 1.5, a.shape).astype(np.float32), params)
  for head in ("embedding", "lm_head") if not cfg.tie_embeddings else ("embedding",):
    params[head] = params[head] * 4
  return Mamba2LM.from_params(cfg, params)


def bpe_tokenizer(path: Path, style: str) -> Path:
  """A small byte-level BPE trained on a few sentences: GPT-2's split ('gpt2'), or a
  Split by Llama 3's or Qwen2's regex before ByteLevel ('llama3', 'qwen2')."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

  from mamba_train.interop.gguf import SPLIT_PRES
  regex = {name: r for r, (name, _) in SPLIT_PRES.items()}
  tok = Tokenizer(models.BPE(ignore_merges=style == "llama3"))
  if style == "gpt2":
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex["llama-bpe" if style == "llama3" else "qwen2"]), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  corpus = [PROMPT, "the dog ate the cat's dinner", "I'll say it again: don't", *TEXTS] * 8
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS_TOKEN],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(path))
  return path


def file_weights_model(path: Path, model: Mamba2LM) -> Mamba2LM:
  """Our model with the weights the GGUF file holds (bfloat16 and q8_0 dequantized), read
  back through the export's own naming in reverse: what llama.cpp computes with."""
  import gguf

  from mamba_train.interop import convert
  cfg = model.config
  arch = gguf_export.architecture(cfg)
  layout = "hf" if arch == gguf.MODEL_ARCH.MAMBA2 else "nemotron_h"
  sd = convert.params_to_state_dict(model.params(), cfg, layout, vocab_rows=cfg.vocab_size)
  stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors}
  names = gguf.get_tensor_name_map(arch, cfg.n_layer)
  for name in list(sd):
    kind, new = names.get_type_and_name(name.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=(".weight", ".bias"))
    if new not in stored:  # a tied head: the embedding serves
      continue
    a = stored[new].astype(np.float32)
    sd[name] = (np.log(-a) if kind == gguf.MODEL_TENSOR.SSM_A else a).reshape(sd[name].shape)
  return Mamba2LM.from_params(cfg, convert.state_dict_to_params(sd, cfg, layout))


def compare(model: Mamba2LM, tok_file: Path, out: Path, dtype: str, args) -> dict:
  """llama.cpp on the export against our float32 model, and against our model on the
  file's own (rounded) weights."""
  from llama_cpp import Llama

  info = load_tokenizer(str(tok_file))
  gguf_export.save_gguf(model, out, tokenizer_file=tok_file, eos_token_id=info.eos_id, dtype=dtype,
                        overwrite=True)
  # float32 attention cache (llama.cpp's default is float16): the comparison is of the file.
  llm = Llama(model_path=str(out), n_ctx=512, n_batch=512, logits_all=True, verbose=False,
              n_threads=args.threads, type_k=0, type_v=0)
  tok_ok = all(llm.tokenize(t.encode(), add_bos=False, special=True) == info.tokenizer.encode(t).ids
               for t in TEXTS + [PROMPT])
  ids = info.tokenizer.encode(PROMPT).ids
  llm.reset()
  llm.eval(ids)
  theirs = np.asarray(llm.scores[:len(ids)], np.float64)
  # Greedy: llama.cpp steps its recurrent state one token at a time.
  greedy = []
  for _ in range(args.new_tokens):
    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    greedy.append(nxt)
    llm.eval([nxt])
  row = {"dtype": dtype, "tokens_equal": tok_ok, "bytes": out.stat().st_size}
  for which, m in (("f32", model), ("file", model if dtype == "float32" else file_weights_model(out, model))):
    ours = np.asarray(m(jnp.asarray([ids]))[0, :, :model.config.vocab_size], np.float64)
    want = np.asarray(generate(m, np.asarray(ids), args.new_tokens))[len(ids):].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(greedy, want)) if a != b), len(want))
    row.update({f"max_abs_{which}": float(np.abs(theirs - ours).max()),
                f"rel_{which}": float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours)),
                f"greedy_{which}": f"{agree}/{len(want)}"})
  return row


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", help="Anything load_model reads (default: random tiny models).")
  p.add_argument("--tokenizer", help="Its tokenizer.json (default: found beside --model).")
  p.add_argument("--dtypes", default="float32,bfloat16,q8_0")
  p.add_argument("--new_tokens", type=int, default=16)
  p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
  args = p.parse_args()
  work = Path(tempfile.mkdtemp(prefix="gguf_bench_"))
  cases = []
  if args.model:
    from mamba_train.interop.load import load_model
    tok = Path(args.tokenizer or Path(args.model) / "tokenizer.json")
    cases.append((Path(args.model).name, load_model(args.model).merged(), tok))
  else:
    byte = work / "byte.json"
    byte_tokenizer().save(str(byte))
    mamba2 = dict(d_model=128, n_layer=4, d_state=32, headdim=32, ngroups=2, chunk_size=16)
    hybrid = dict(mamba2, layer_pattern="M*-M", attn_num_heads=4, attn_num_heads_kv=2, attn_head_dim=32,
                  d_intermediate=256, tie_embeddings=False)
    cases.append(("mamba2, byte", random_model(Mamba2Config(vocab_size=257, **mamba2), 0), byte))
    cases.append(("nemotron_h, byte", random_model(Mamba2Config(vocab_size=257, **hybrid), 1), byte))
    for style in ("gpt2", "llama3", "qwen2"):
      bpe = bpe_tokenizer(work / f"{style}.json", style)
      vocab = load_tokenizer(str(bpe)).vocab_size
      cases.append((f"mamba2, BPE ({style} split)", random_model(Mamba2Config(vocab_size=vocab, **mamba2), 2), bpe))
  print("| model, tokenizer | dtype | file bytes | tokenization equal | logits vs ours: max abs, rel | greedy agree | "
        "vs ours on the file's weights: max abs, rel | greedy agree |")
  print("|---|---|---|---|---|---|---|---|")
  results = []
  for name, model, tok in cases:
    # The other tokenizers' rows test the vocabulary: one dtype is enough.
    for dtype in args.dtypes.split(",") if "BPE" not in name else ["float32"]:
      r = compare(model, tok, work / f"case{len(results)}_{dtype}.gguf", dtype, args)
      results.append({"case": name, **r})
      print(f"| {name} | {dtype} | {r['bytes']} | {r['tokens_equal']} | {r['max_abs_f32']:.1e}, {r['rel_f32']:.1e} | "
            f"{r['greedy_f32']} | {r['max_abs_file']:.1e}, {r['rel_file']:.1e} | {r['greedy_file']} |", flush=True)
  (work / "results.json").write_text(json.dumps(results, indent=2))
  print(f"files and results.json in {work}")


if __name__ == "__main__":
  main()
