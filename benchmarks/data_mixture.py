"""Loader throughput of a weighted mixture, and SFT packing efficiency.

  python -m benchmarks.data_mixture                 # 130m batch shape: 256 x 2048 tokens
  python -m benchmarks.data_mixture --batches 20 --batch_size 64

Prints markdown tables (figures for docs/bench/data.md). One process, the
loader's default two reader threads, no worker processes: the train step at
this shape consumes 0.5M tokens per step, far below what the loader gives.
"""

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import datasets  # noqa: E402
import numpy as np  # noqa: E402

from mamba_train import data  # noqa: E402
from mamba_train.data import chat  # noqa: E402


def _source(root: str, name: str, n_tokens: int, seed: int) -> str:
  """A byte-level source of documents averaging 2,000 bytes."""
  rng = np.random.default_rng(seed)
  alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      \n.,", np.uint8)
  docs = []
  total = 0
  while total < n_tokens:
    n = int(rng.integers(200, 4000))
    docs.append(alphabet[rng.integers(0, len(alphabet), n)].tobytes().decode())
    total += n + 1
  return data.prepare_dataset(datasets.Dataset.from_dict({"text": docs}), name, root=root,
                              val_fraction=0.01, source_fingerprint=f"bench-{seed}-{n_tokens}")


def _throughput(make, batches: int) -> float:
  it = make()
  next(it)  # first batch: thread start-up and page faults
  t0 = time.perf_counter()
  tokens = 0
  for _ in range(batches):
    b = next(it)
    tokens += b["input_ids"].size
  return tokens / (time.perf_counter() - t0)


def _chat_file(path: str, n: int, seed: int = 0) -> str:
  """Chats with lengths drawn log-normally (median prompt 300 bytes, response 600),
  a third with a system turn and a fifth with two rounds, as instruction sets have."""
  rng = np.random.default_rng(seed)
  words = "the a model data train loss token sequence chunk state of to and is in".split()

  def text(median):
    return " ".join(rng.choice(words, max(1, int(rng.lognormal(np.log(median / 5), 0.8)))))

  with open(path, "w") as f:
    for _ in range(n):
      msgs = [{"role": "system", "content": text(80)}] if rng.random() < 0.33 else []
      for _ in range(2 if rng.random() < 0.2 else 1):
        msgs += [{"role": "user", "content": text(300)}, {"role": "assistant", "content": text(600)}]
      f.write(json.dumps({"messages": msgs}) + "\n")
  return path


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--seq_len", type=int, default=2048)
  p.add_argument("--batches", type=int, default=10)
  p.add_argument("--chats", type=int, default=3000)
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as root:
    per_source = 2 * args.batch_size * (args.seq_len + 1)
    dirs = [_source(root, f"s{i}", per_source, i) for i in range(3)]
    kw = dict(seq_len=args.seq_len, global_batch_size=args.batch_size, seed=0)
    one = _throughput(lambda: data.make_train_loader(dirs[0], **kw), args.batches)
    srcs = data.parse_mixture(f"{dirs[0]}:0.5,{dirs[1]}:0.3,{dirs[2]}:0.2")
    mix = _throughput(lambda: data.make_mixture_loader(srcs, **kw), args.batches)
    print(f"\nLoader, {args.batch_size} x {args.seq_len} tokens per batch, one process, "
          f"{args.batches} batches:\n")
    print("| loader | tokens/s |\n|---|---|")
    print(f"| one source | {one / 1e6:.1f}M |\n| 3-source mixture 0.5/0.3/0.2 | {mix / 1e6:.1f}M |")

    path = _chat_file(os.path.join(root, "chats.jsonl"), args.chats)
    print(f"\nSFT packing, {args.chats} sample chats, byte tokenizer, default template:\n")
    print("| seq_len | too_long | rows | examples kept | dropped | truncated | non-pad share | "
          "learned share |\n|---|---|---|---|---|---|---|---|")
    for seq_len in (512, 2048):
      for rule in ("drop", "truncate"):
        t0 = time.perf_counter()
        d = data.prepare_chat_dataset(path, f"sft{seq_len}{rule}", root=root, seq_len=seq_len,
                                      too_long=rule, val_fraction=0)
        secs = time.perf_counter() - t0
        s = data.read_metadata(d)["splits"]["train"]
        kept = s["examples"] - s["dropped"]
        print(f"| {seq_len} | {rule} | {s['rows']} | {kept} | {s['dropped']} | {s['truncated']} | "
              f"{100 * s['efficiency']:.1f}% | {100 * s['loss_tokens'] / s['tokens']:.1f}% |")
    print(f"\n(preparing {args.chats} chats took {secs:.1f} s, template "
          f"{chat.DEFAULT_TEMPLATE[:20]!r}...)")


if __name__ == "__main__":
  main()
