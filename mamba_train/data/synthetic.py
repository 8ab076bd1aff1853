"""A synthetic token stream behind the data pipeline's batch interface, for tests
and for running without a prepared corpus (`config.data.source = 'synthetic'`).

Tokens follow a fixed random Markov chain: each token has four likely
successors, so a model can learn it quickly and the loss falls from ln(vocab)
towards the chain's entropy (about 1.1 nats). Documents of random length end
in an EOS token (the last id); `seq_idx` numbers the documents of a row and the
loss is masked where the target is the first token of the next document.

Batches are the same per-process dicts of numpy arrays that
`mamba_train.data.make_train_loader` yields: `input_ids`, `targets`, `seq_idx`
(int32, [per-process batch, seq_len]) and `loss_mask` (float32). They depend
only on (seed, batch index, row), so every process count sees the same global
batch.
"""

from __future__ import annotations

import numpy as np

_SUCCESSORS = 4
_PROBS = np.array([0.55, 0.25, 0.12, 0.08])


class SyntheticLoader:
  """An endless iterator of batches; `get_state`/`set_state` make it resumable."""

  def __init__(self, *, vocab_size: int, seq_len: int, global_batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1, mean_doc_len: int = 200):
    if global_batch_size % process_count:
      raise ValueError(f"batch {global_batch_size} does not divide over {process_count} processes")
    self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
    self.rows = global_batch_size // process_count
    self.first_row = process_index * self.rows
    self.mean_doc_len = mean_doc_len
    self.eos = vocab_size - 1
    table_rng = np.random.default_rng(12345)  # the chain is the same for every seed and split
    self.successors = np.stack([table_rng.choice(vocab_size - 1, _SUCCESSORS, replace=False)
                                for _ in range(vocab_size)])
    self.index = 0

  def get_state(self) -> dict:
    return {"index": self.index}

  def set_state(self, state: dict) -> None:
    self.index = int(state["index"])

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rows = [self._row(self.index, self.first_row + r) for r in range(self.rows)]
    self.index += 1
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def _row(self, index: int, row: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((self.seed, index, row))
    n = self.seq_len + 1
    toks = np.empty(n, np.int32)
    doc = np.empty(n, np.int32)
    choice = rng.choice(_SUCCESSORS, size=n, p=_PROBS)
    ends = rng.random(n) < 1.0 / self.mean_doc_len
    cur, d = int(rng.integers(self.vocab_size - 1)), 0
    for t in range(n):
      toks[t], doc[t] = cur, d
      if cur == self.eos:
        cur, d = int(rng.integers(self.vocab_size - 1)), d + 1
      elif ends[t]:
        cur = self.eos
      else:
        cur = int(self.successors[cur, choice[t]])
    return {"input_ids": toks[:-1], "targets": toks[1:], "seq_idx": doc[:-1],
            "loss_mask": (doc[1:] == doc[:-1]).astype(np.float32)}
