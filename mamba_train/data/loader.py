"""The Grain loader: shuffled fixed windows of the token stream, per-process shares.

Window w of a split is tokens[w*L : w*L + L + 1] for L = seq_len: inputs are its
first L tokens, targets its last L, so consecutive windows share one token and
every token but the first is a target exactly once per epoch.

Sharding across processes: the global order of windows is one seeded shuffle per
epoch (Grain reseeds each repeat), cut into global batches of B window ids. Process
p of P reads rows [p*b, (p+1)*b) of each, b = B/P, and touches only those windows
of the memory-mapped shard. The global batch at every step is therefore the same,
row for row, for any P: runs are comparable across process counts, and a run can
resume on a different number of hosts.

State: the iterators are Grain DatasetIterators; `get_state()`/`set_state()` or
`grain.checkpoint.CheckpointSave/Restore` in an Orbax Composite store the next
index only, and restoring yields exactly the batches that would have come next.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import grain
import numpy as np

from mamba_train.data import prepare
from mamba_train.data import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)


class _Windows:
  """Random access to the windows of one split's shard (a Grain data source).

  The shard is memory-mapped lazily and dropped when pickled, so worker
  processes open their own map instead of receiving a copy of the data.
  """

  def __init__(self, path: str, seq_len: int, n_tokens: int):
    self.path, self.seq_len, self.n_tokens = path, seq_len, n_tokens
    self._tokens = None

  def __len__(self) -> int:
    return max(0, (self.n_tokens - 1) // self.seq_len)

  def __getitem__(self, i: int) -> np.ndarray:
    if self._tokens is None:
      self._tokens = np.load(self.path, mmap_mode="r")
    start = i * self.seq_len
    return self._tokens[start:start + self.seq_len + 1]

  def __getstate__(self):
    return {**self.__dict__, "_tokens": None}


def _open_split(data_dir: str, split: str, seq_len: int) -> tuple[_Windows, dict]:
  meta = prepare.read_metadata(data_dir)
  if split not in meta["splits"]:
    raise prepare.DataError(f"{data_dir!r} has no {split!r} split (it has {list(meta['splits'])}); "
                     "prepare it with a nonzero val_fraction or a validation split.")
  info = meta["splits"][split]
  path = os.path.join(data_dir, info["file"])
  redo = "prepare the dataset again (scripts/prepare_data.py ... --force)"
  try:
    tokens = np.load(path, mmap_mode="r")
  except (OSError, ValueError) as e:  # missing, truncated (mmap longer than the file), bad header
    raise prepare.DataError(f"{path!r} ({split} split) cannot be read ({type(e).__name__}: "
                            f"{e}): the file is missing or damaged; {redo}.") from None
  if tokens.shape != (info["tokens"],) or tokens.dtype.name != meta["dtype"]:
    raise prepare.DataError(f"{path!r} holds {tokens.dtype}{list(tokens.shape)} but metadata.json "
                            f"says {meta['dtype']}[{info['tokens']}]: the file is damaged or "
                            f"from another preparation; {redo}.")
  try:  # the first and last pages: readable to the end (the shape check saw the header only)
    np.asarray(tokens[:4096]), np.asarray(tokens[-4096:])
  except (OSError, ValueError) as e:
    raise prepare.DataError(f"{path!r} ({split} split) cannot be read to the end ({e}); {redo}.") from None
  windows = _Windows(path, seq_len, info["tokens"])
  if len(windows) == 0:
    raise prepare.DataError(f"The {split} split of {data_dir!r} has {info['tokens']} tokens, "
                     f"fewer than seq_len + 1 = {seq_len + 1}; use a shorter seq_len "
                     "or more data.")
  unused = info["tokens"] - 1 - len(windows) * seq_len
  log.info("%s/%s: %d windows of %d+1 tokens; the last %d tokens (%.3f%%) are never a "
           "target.", data_dir, split, len(windows), seq_len, unused,
           100 * unused / info["tokens"])
  return windows, meta


def check_splits(data_dir: str, splits, seq_len: int) -> None:
  """Open every split a run will read (shape and dtype against metadata.json, first and
  last pages read) so that a damaged file stops the run before it compiles, not at the
  first evaluation."""
  for split in splits:
    _open_split(data_dir, split, seq_len)


def _make_batch(windows, eos_id: int, seq_len: int) -> dict[str, np.ndarray]:
  """Stacks windows (or None for padding rows) into the model's inputs.

  seq_idx counts the EOS tokens strictly before each position: the EOS belongs
  to the document it ends, and the token after it starts the next.
  """
  pad = np.full(seq_len + 1, eos_id, np.int32)
  w = np.stack([pad if x is None else x for x in windows]).astype(np.int32)
  inputs = np.ascontiguousarray(w[:, :-1])
  eos = (inputs == eos_id).astype(np.int32)
  loss_mask = np.ones(inputs.shape, np.float32)
  for row, x in enumerate(windows):
    if x is None:
      loss_mask[row] = 0.0
  return {"input_ids": inputs, "targets": np.ascontiguousarray(w[:, 1:]),
          "seq_idx": np.cumsum(eos, axis=1, dtype=np.int32) - eos, "loss_mask": loss_mask}


def _read_rows(ids: np.ndarray, windows: _Windows, rows: slice, eos_id: int):
  """This process's rows of one global batch of window ids (ids >= len: padding)."""
  return _make_batch([windows[i] if i < len(windows) else None for i in ids[rows]], eos_id,
                     windows.seq_len)


def _local_batch(global_batch_size: int, process_index: int, process_count: int) -> int:
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count}).")
  if global_batch_size % process_count:
    raise ValueError(f"global_batch_size {global_batch_size} must be a multiple of the "
                     f"process count {process_count}.")
  return global_batch_size // process_count


def _iterate(ds: grain.MapDataset, worker_count: int, num_threads: int):
  # Threads read ahead of the consumer; worker processes (worker_count > 0) also
  # take the batch assembly off the training process's Python thread.
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads,
                                               prefetch_buffer_size=max(4, 2 * num_threads)))
  if worker_count > 0:
    from absl import flags  # pylint: disable=import-outside-toplevel
    if not flags.FLAGS.is_parsed():
      # Grain's workers read its absl flags; outside absl.app.run (pytest, a
      # notebook, the bench script) nothing parsed them, so take their defaults.
      flags.FLAGS.mark_as_parsed()
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
  return iter(it_ds)


def make_train_loader(data_dir: str, *, seq_len: int, global_batch_size: int, seed: int,
                      process_index: int = 0, process_count: int = 1,
                      worker_count: int = 0, num_threads: int = 2):
  """Infinite, shuffled, checkpointable iterator over this process's share of batches.

  Yields dicts of numpy arrays with b = global_batch_size // process_count rows:
  input_ids, targets, seq_idx (int32, (b, seq_len)) and loss_mask (float32, all 1).
  """
  b = _local_batch(global_batch_size, process_index, process_count)
  windows, meta = _open_split(data_dir, "train", seq_len)
  if len(windows) < global_batch_size:
    log.warning("%s: %d windows per epoch, fewer than one global batch of %d: batches "
                "repeat windows.", data_dir, len(windows), global_batch_size)
  order = grain.MapDataset.range(len(windows)).shuffle(seed=seed).repeat(None)  # per-epoch shuffle
  ds = order.batch(global_batch_size, drop_remainder=True).map(functools.partial(
      _read_rows, windows=windows, rows=slice(process_index * b, (process_index + 1) * b),
      eos_id=meta["eos_id"]))
  return _iterate(ds, worker_count, num_threads)


def make_eval_loader(data_dir: str, *, seq_len: int, global_batch_size: int,
                     process_index: int = 0, process_count: int = 1,
                     num_batches: int | None = None, num_threads: int = 2):
  """Finite, in-order iterator over the validation split (the same every call).

  Every process yields the same number of batches: the last one is padded with
  rows whose loss_mask is 0, so no validation window is dropped. `num_batches`
  caps it to the first num_batches global batches.
  """
  b = _local_batch(global_batch_size, process_index, process_count)
  windows, meta = _open_split(data_dir, "validation", seq_len)
  n_batches = math.ceil(len(windows) / global_batch_size)
  if num_batches is not None and num_batches < n_batches:
    log.info("%s: evaluating on the first %d of %d validation batches (num_batches).",
             data_dir, num_batches, n_batches)
    n_batches = num_batches
  ds = grain.MapDataset.range(n_batches * global_batch_size).batch(global_batch_size)
  ds = ds.map(functools.partial(
      _read_rows, windows=windows, rows=slice(process_index * b, (process_index + 1) * b),
      eos_id=meta["eos_id"]))  # ids past the last window become padding rows
  return _iterate(ds, 0, num_threads)


def validate_for_model(metadata: dict, vocab_size: int, tokenizer: str | None = None) -> None:
  """Fails before training when the shards cannot feed a model of `vocab_size`.

  tokenizer: what the run config names ("byte", a tokenizer.json path, or a
  transformers name); the shards must come from that same tokenizer.
  """
  where = metadata.get("name", "the dataset")
  if metadata["max_token_id"] >= vocab_size:
    raise prepare.DataError(f"{where!r} contains token id {metadata['max_token_id']}, outside the "
                     f"model's vocabulary of {vocab_size}; raise vocab_size.")
  if metadata["vocab_size"] > vocab_size:
    raise prepare.DataError(
        f"Tokenizer {metadata['tokenizer']!r} of {where!r} has {metadata['vocab_size']} "
        f"tokens but the model's vocab_size is {vocab_size}; set the model vocab_size "
        f">= {metadata['vocab_size']} or prepare the data with a smaller tokenizer.")
  if tokenizer is None or tokenizer == metadata["tokenizer"]:
    return
  local = tokenizer == tokenizer_lib.BYTE or os.path.exists(tokenizer)
  if local and (tokenizer_lib.load_tokenizer(tokenizer).fingerprint
                == metadata["tokenizer_fingerprint"]):
    return  # Named differently, same ids.
  raise prepare.DataError(
      f"{where!r} was tokenized with {metadata['tokenizer']!r} but the config names "
      f"tokenizer {tokenizer!r}; prepare the data with that tokenizer or change the config.")
