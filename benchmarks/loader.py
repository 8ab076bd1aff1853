"""How many tokens per second the train loader hands one process, on the
default byte-level corpus (built under data/ on first use).

A train step must never wait for data: this is the rate to hold against the
train step's tokens/s. Only the loader runs here, no model.
"""

from __future__ import annotations

import os

from benchmarks.common import ROOT, add_rows, log
from mamba_train import data
from mamba_train.metrics import Timer


def loader_throughput(data_dir: str, seq_len: int = 2048, batch: int = 8,
                      seconds: float = 5.0, worker_count: int = 0, num_threads: int = 2) -> float:
  """Tokens (input positions) per second the train loader delivers to one process."""
  it = data.make_train_loader(data_dir, seq_len=seq_len, global_batch_size=batch, seed=0,
                              worker_count=worker_count, num_threads=num_threads)
  try:
    next(it)  # Start-up (threads, workers, first page faults) is not throughput.
    n, clock = 0, Timer()
    while clock.elapsed < seconds:
      n += next(it)["input_ids"].size
    return n / clock.elapsed
  finally:
    it.close()  # Stops worker processes and frees their shared memory now, not at exit.


def bench_loader(args, results):
  d = os.path.join(ROOT, "data", "default")
  if not os.path.exists(os.path.join(d, "metadata.json")):
    d = data.ensure_default_corpus(os.path.join(ROOT, "data"))
  l, b = args.seq_len or 2048, args.batch or 8
  tps = loader_throughput(d, seq_len=l, batch=b, seconds=3.0)
  row = {"bench": "loader", "impl": "ours", "batch": b, "seq_len": l, "tokens_per_s": tps}
  log(f"  loader {b}x{l}: {tps:.3g} tok/s")
  return add_rows(results, [row])
