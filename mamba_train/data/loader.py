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

from mamba_train.data import mixture as mixture_lib
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


class _PackedRows:
  """Rows of a packed (instruction) split: (3, seq_len + 1) int32 per row holding
  the tokens, the loss mask (1 where the token is a target to learn) and the
  example number within the row (seq_idx)."""

  def __init__(self, paths: dict[str, str], seq_len: int, n_rows: int):
    self.paths, self.seq_len, self.n_rows = paths, seq_len, n_rows
    self._arrays = None

  def __len__(self) -> int:
    return self.n_rows

  def __getitem__(self, i: int) -> np.ndarray:
    if self._arrays is None:
      self._arrays = [np.load(self.paths[k], mmap_mode="r") for k in PACKED_FIELDS]
    return np.stack([a[i] for a in self._arrays]).astype(np.int32)

  def __getstate__(self):
    return {**self.__dict__, "_arrays": None}


PACKED_FIELDS = ("tokens", "loss_mask", "seq_idx")


def _open_split(data_dir: str, split: str, seq_len: int):
  meta = prepare.read_metadata(data_dir)
  if split not in meta["splits"]:
    raise prepare.DataError(f"{data_dir!r} has no {split!r} split (it has {list(meta['splits'])}); "
                     "prepare it with a nonzero val_fraction or a validation split.")
  info = meta["splits"][split]
  if "packed" in meta:
    if meta["packed"]["seq_len"] != seq_len:
      raise ValueError(f"{data_dir!r} is packed into rows of {meta['packed']['seq_len']} "
                       f"tokens, not seq_len {seq_len}; prepare it with --seq_len={seq_len}.")
    paths = {k: os.path.join(data_dir, info["files"][k]) for k in PACKED_FIELDS}
    return _PackedRows(paths, seq_len, info["rows"]), meta
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
  """Stacks rows into the model's inputs. A row is a window of the token stream
  (seq_len + 1 tokens), a packed row (3, seq_len + 1), or None (padding, masked).

  In a window, seq_idx counts the EOS tokens strictly before each position: the
  EOS belongs to the document it ends, and the token after it starts the next.
  A packed row carries its own loss mask and seq_idx.
  """
  rows = np.zeros((len(windows), 3, seq_len + 1), np.int32)
  rows[:, 0] = eos_id
  flat = np.zeros(len(windows), bool)
  for r, x in enumerate(windows):
    if x is None:
      continue
    if x.ndim == 1:
      rows[r, 0], rows[r, 1], flat[r] = x, 1, True
    else:
      rows[r] = x
  inputs = np.ascontiguousarray(rows[:, 0, :-1])
  eos = (inputs == eos_id).astype(np.int32)
  seq_idx = np.where(flat[:, None], np.cumsum(eos, axis=1, dtype=np.int32) - eos, rows[:, 2, :-1])
  return {"input_ids": inputs, "targets": np.ascontiguousarray(rows[:, 0, 1:]),
          "seq_idx": seq_idx.astype(np.int32),
          # A packed row never learns the first token of an example from the one before.
          "loss_mask": (rows[:, 1, 1:] * (rows[:, 2, 1:] == rows[:, 2, :-1])).astype(np.float32)}


def _read_rows(ids: np.ndarray, windows: _Windows, rows: slice, eos_id: int):
  """This process's rows of one global batch of window ids (ids >= len: padding)."""
  return _make_batch([windows[i] if i < len(windows) else None for i in ids[rows]], eos_id,
                     windows.seq_len)


def _read_mixed_rows(ids, sources: list, rows: slice, eos_id: int):
  """This process's rows of one global batch of (source, row) pairs, and how many
  rows of the whole global batch each source gave (`source_rows`)."""
  src, key = ids
  batch = _make_batch([sources[s][k] for s, k in zip(src[rows], key[rows])], eos_id,
                      sources[0].seq_len)
  if len(sources) > 1:
    batch["source_rows"] = np.bincount(src, minlength=len(sources))
  return batch


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
  input_ids, targets, seq_idx (int32, (b, seq_len)) and loss_mask (float32: all
  1 for a token stream, the stored mask for a packed instruction set).
  """
  return make_mixture_loader([mixture_lib.Source(data_dir, 1.0)], seq_len=seq_len,
                             global_batch_size=global_batch_size, seed=seed,
                             process_index=process_index, process_count=process_count,
                             worker_count=worker_count, num_threads=num_threads)


def make_mixture_loader(sources: list[mixture_lib.Source], *, seq_len: int,
                        global_batch_size: int, seed: int,
                        schedule: list[tuple[int, list[float]]] = (),
                        process_index: int = 0, process_count: int = 1,
                        worker_count: int = 0, num_threads: int = 2):
  """`make_train_loader` over a weighted mixture (mamba_train/data/mixture.py).

  schedule: [(step, weights)] from parse_schedule; the weights apply to the
  batches after that many steps. Batches also carry `source_rows` (int, one per
  source): the rows of the whole global batch drawn from each source.
  """
  b = _local_batch(global_batch_size, process_index, process_count)
  opened = [_open_split(s.dir, "train", seq_len) for s in sources]
  mixture_lib.check_sources(sources, [m for _, m in opened], seq_len)
  parents, lengths = [], []
  for i, (s, (windows, _)) in enumerate(zip(sources, opened)):
    if len(windows) < global_batch_size:
      log.warning("%s: %d rows per epoch, fewer than one global batch of %d: batches "
                  "repeat rows.", s.dir, len(windows), global_batch_size)
    n = s.rows(len(windows), seq_len)
    # Source 0 keeps the run's seed, so a single dataset reads as it always has.
    order = grain.MapDataset.range(len(windows)).shuffle(seed=seed + 1_000_003 * i)
    order = order.repeat(None if n == mixture_lib.INFINITE else -(-n // len(windows)))
    parents.append(order if n == mixture_lib.INFINITE else order[:n])
    lengths.append(n)
  phases = [(0, [s.weight for s in sources])]
  phases += [(step * global_batch_size, w) for step, w in schedule]
  selection = mixture_lib.MixtureMap(lengths, phases)
  ds = grain.MapDataset.select_from_datasets(  # rows are (source, row id)
      [p.map(functools.partial(mixture_lib.tag, i)) for i, p in enumerate(parents)], selection)
  ds = ds.batch(global_batch_size, drop_remainder=True).map(functools.partial(
      _read_mixed_rows, sources=[w for w, _ in opened],
      rows=slice(process_index * b, (process_index + 1) * b), eos_id=opened[0][1]["eos_id"]))
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
