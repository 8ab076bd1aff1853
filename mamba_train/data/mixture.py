"""Weighted mixtures of prepared datasets: the spec, the schedule, and the row order.

  config.data.mixture           "data/web:0.7,data/code:0.3:epochs=2,data/math:0.1:tokens=5e8"
  config.data.mixture_schedule  "9000:0.5,0.2,0.3"   (from step 9000 on; ';' separates more)

Each source's windows are shuffled per epoch (its own seed), repeated (for ever,
or `epochs` times, or up to `tokens` tokens), and Grain's `MapDataset.mix`
interleaves the sources by weight. A schedule, or a source that runs out, starts
a new phase: a fresh Grain mix of the sources still active, with the new weights
(renormalised over them), each source continuing where it stopped. The phases are
a Grain `DatasetSelectionMap` (global row -> (source, row within that source)),
fixed by the spec alone, so the row order is deterministic, identical for every
process count, and resumes from one index.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import os
import sys

import grain

from mamba_train.errors import UserError

INFINITE = sys.maxsize


class MixtureError(UserError, ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Source:
  dir: str
  weight: float
  epochs: float | None = None  # stop after this many passes (fractions allowed)
  tokens: int | None = None  # or after this many tokens

  @property
  def name(self) -> str:
    return os.path.basename(os.path.normpath(self.dir))

  def rows(self, n_windows: int, seq_len: int) -> int:
    """Rows this source can give: INFINITE unless capped."""
    caps = [INFINITE]
    if self.epochs is not None:
      caps.append(int(self.epochs * n_windows))
    if self.tokens is not None:
      caps.append(self.tokens // seq_len)
    return min(caps)


def parse_mixture(spec: str) -> list[Source]:
  """"DIR:WEIGHT[:epochs=E][:tokens=N],..." -> Sources (MixtureError on bad input)."""
  sources, problems = [], []
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    parts = item.split(":")
    if len(parts) < 2:
      problems.append(f"{item!r} has no weight (write DIR:WEIGHT)")
      continue
    try:
      weight = float(parts[1])
    except ValueError:
      problems.append(f"{item!r}: weight {parts[1]!r} is not a number")
      continue
    if not math.isfinite(weight) or weight < 0:
      problems.append(f"{item!r}: weight must be >= 0 and finite")
    caps = {}
    for opt in parts[2:]:
      key, _, value = opt.partition("=")
      if key not in ("epochs", "tokens"):
        problems.append(f"{item!r}: unknown option {opt!r} (epochs=E or tokens=N)")
        continue
      try:
        caps[key] = float(value) if key == "epochs" else int(float(value))
      except ValueError:
        problems.append(f"{item!r}: {key} {value!r} is not a number")
        continue
      if caps[key] <= 0:
        problems.append(f"{item!r}: {key} must be positive")
    sources.append(Source(parts[0], weight, **caps))
  if not sources and not problems:
    problems.append("no sources")
  if sources and sum(s.weight for s in sources) <= 0:
    problems.append("the weights sum to zero")
  names = [s.name for s in sources]
  if len(set(names)) != len(names):
    problems.append(f"two sources share a directory name ({names}); metrics are named by it")
  if sources and all(s.epochs is not None or s.tokens is not None for s in sources):
    problems.append("every source is capped, so the mixture would end; leave one uncapped")
  if problems:
    raise MixtureError(f"data.mixture {spec!r}: " + "; ".join(problems))
  return sources


def parse_schedule(spec: str, n_sources: int) -> list[tuple[int, list[float]]]:
  """"STEP:w1,...,wn;STEP:..." -> [(step, weights)], steps increasing."""
  out, problems = [], []
  for item in (s.strip() for s in spec.split(";")):
    if not item:
      continue
    step, _, ws = item.partition(":")
    try:
      step, weights = int(step), [float(w) for w in ws.split(",")]
    except ValueError:
      problems.append(f"{item!r} is not STEP:w1,...,w{n_sources}")
      continue
    if len(weights) != n_sources:
      problems.append(f"{item!r} has {len(weights)} weights for {n_sources} sources")
    elif any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
      problems.append(f"{item!r}: weights must be >= 0 and sum above zero")
    if step <= 0 or (out and step <= out[-1][0]):
      problems.append(f"{item!r}: steps must be positive and increasing")
    out.append((step, weights))
  if problems:
    raise MixtureError(f"data.mixture_schedule {spec!r}: " + "; ".join(problems))
  return out


def check_sources(sources: list[Source], metas: list[dict], seq_len: int) -> None:
  """Sources must share one tokenizer (same ids) and, if packed, the run's seq_len."""
  first, ref = sources[0], metas[0]
  for s, m in zip(sources, metas):
    if m["tokenizer_fingerprint"] != ref["tokenizer_fingerprint"] or m["vocab_size"] != ref["vocab_size"]:
      raise MixtureError(
          f"mixture source {s.dir!r} was tokenized with {m['tokenizer']!r} "
          f"(vocab {m['vocab_size']}, fingerprint {m['tokenizer_fingerprint']}) but "
          f"{first.dir!r} with {ref['tokenizer']!r} (vocab {ref['vocab_size']}, fingerprint "
          f"{ref['tokenizer_fingerprint']}); prepare every source with one tokenizer.")
    packed = m.get("packed")
    if packed and packed["seq_len"] != seq_len:
      raise MixtureError(f"{s.dir!r} is packed into rows of {packed['seq_len']} tokens but the "
                         f"run's seq_len is {seq_len}; prepare it with --seq_len={seq_len}.")


def tag(source: int, key: int) -> tuple[int, int]:
  return source, key


class MixtureMap(grain.transforms.DatasetSelectionMap):
  """Global row -> (source, row within the source), phase by phase.

  lengths: rows each source can give (INFINITE if uncapped).
  schedule: [(first_row, weights)], first_row 0 first.
  Within a phase the order is Grain's `MapDataset.mix` of the active sources.
  """

  def __init__(self, lengths: list[int], schedule: list[tuple[int, list[float]]]):
    self.phases = []  # (first row, offsets per source, Grain mix of (source, key))
    offsets, row, k = [0] * len(lengths), 0, 0
    while row < INFINITE:
      bound = schedule[k + 1][0] if k + 1 < len(schedule) else INFINITE
      weights = schedule[k][1]
      active = [i for i, w in enumerate(weights) if w > 0 and offsets[i] < lengths[i]]
      if not active:
        break
      mixed = grain.MapDataset.mix(
          [grain.MapDataset.range(lengths[i] - offsets[i]).map(functools.partial(tag, i))
           for i in active], [weights[i] for i in active])
      stop = min(row + len(mixed), bound, INFINITE)
      self.phases.append((row, tuple(offsets), mixed))
      if stop < INFINITE:
        for i, n in _counts(mixed, stop - row, active).items():
          offsets[i] += n
      if stop == bound:
        k += 1
      row = stop
    self._starts = [p[0] for p in self.phases]
    self._length = row

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index: int) -> tuple[int, int]:
    if not 0 <= index < self._length:
      raise IndexError(index)
    start, offsets, mixed = self.phases[bisect.bisect_right(self._starts, index) - 1]
    source, key = mixed[index - start]
    return source, offsets[source] + key


def _counts(mixed, n: int, active: list[int]) -> dict[int, int]:
  """How many of the first n rows of a Grain mix came from each active source:
  the last row of each source before n has key = count - 1."""
  counts, j = {}, n - 1
  while j >= 0 and len(counts) < len(active):
    source, key = mixed[j]
    counts.setdefault(source, key + 1)
    j -= 1
  return {i: counts.get(i, 0) for i in active}


class SourceShare:
  """Tokens drawn from each source between two reads (batches carry `source_rows`,
  the rows of the global batch from each source)."""

  def __init__(self, names: list[str], seq_len: int):
    self.names, self.seq_len = names, seq_len
    self.rows = [0] * len(names)

  def add(self, batch) -> None:
    if "source_rows" in batch:
      self.rows = [a + int(b) for a, b in zip(self.rows, batch["source_rows"])]

  def read(self) -> dict[str, float]:
    total = sum(self.rows)
    out = {f"data/share/{n}": r / total for n, r in zip(self.names, self.rows)} if total else {}
    self.rows = [0] * len(self.names)
    return out
