"""A run's inputs, from its plan: the datasets it reads, the train iterator and the
held-out batches, every one checked against the model before anything compiles."""

from __future__ import annotations

import functools
import itertools
import os
from typing import Callable, Iterator

import jax

from mamba_train import data
from mamba_train.parallel import sharding
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train.run_config import ConfigError, Plan
from mamba_train.workdir import storage


def data_sources(plan: Plan) -> list[data.Source]:
  """The prepared datasets a corpus run reads (the default corpus prepared on first
  use); none for synthetic data."""
  if plan.default_corpus:
    return [data.Source(data.ensure_default_corpus(plan.default_corpus), 1.0)]
  return list(plan.sources)


def tokenizer_path(sources: list[data.Source]) -> str:
  """The tokenizer of the (first) data source; 'byte' for synthetic data."""
  return os.path.join(sources[0].dir, "tokenizer.json") if sources else "byte"


def make_loaders(plan: Plan, sources: list[data.Source], workdir: str | None = None
                 ) -> tuple[Iterator[dict], dict[str, Callable[[], Iterator[dict]]]]:
  """(train iterator, {source name: factory of eval-batch iterators}), both yielding
  this process's rows of `sources` (`data_sources(plan)`): those of its data group
  (`parallel.sharding.data_group`), whole; `train.step.to_global` keeps its positions. One unnamed ('') eval
  source unless the run reads a mixture. With a workdir, process 0 copies the
  tokenizer there (exports ship it)."""
  config, vocab_size = plan.config, plan.model.vocab_size
  # The processes of one data group (a sequence split across them) read the same rows.
  group, groups = sharding.data_group(make_mesh(config.mesh, shape=plan.mesh_shape))
  if config.batch_size % groups:  # a layout the plan's check could not foresee
    raise ConfigError(f"batch_size {config.batch_size} does not divide over the {groups} sets of "
                      f"rows the {jax.process_count()} processes of this mesh load; use a multiple of {groups}")
  kw = dict(seq_len=config.seq_len, global_batch_size=config.batch_size,
            process_index=group, process_count=groups)
  if not sources:  # synthetic
    train = data.SyntheticLoader(vocab_size=vocab_size, seed=config.seed, **kw)
    held_out = lambda: itertools.islice(
        data.SyntheticLoader(vocab_size=vocab_size, seed=config.seed + 7919, **kw),
        config.eval_batches)
    return train, {"": held_out}
  try:  # a missing source, another tokenizer or vocabulary: refused before compiling
    metas = [data.read_metadata(s.dir) for s in sources]
    for m in metas:
      data.validate_for_model(m, vocab_size)
    data.check_sources(sources, metas, config.seq_len)
    preference = [s.dir for s, m in zip(sources, metas) if m.get("packed", {}).get("preference")]
    if plan.dpo is not None and len(preference) != len(sources):
      raise ValueError(f"objective='dpo' needs a preference set, and {sources[0].dir} is not one: "
                       "prepare it with scripts/prepare_data.py --preference")
    if plan.dpo is None and preference:
      raise ValueError(f"{preference} hold preference pairs: train on them with configs/dpo.py "
                       "(objective='dpo'), which learns from the pairs, not from both responses")
    no_val = [s.dir for s, m in zip(sources, metas) if "validation" not in m["splits"]]
    if config.eval_every > 0 and no_val:
      raise ValueError(f"{no_val} hold no validation split; prepare them with a nonzero "
                       "val_fraction, or set eval_every=0")
  except (OSError, ValueError) as e:
    raise ConfigError(str(e)) from None
  # Every split the run will read, now: a damaged validation shard must not wait for the first eval.
  for s in sources:
    data.check_splits(s.dir, ["train"] + (["validation"] if config.eval_every > 0 else []),
                      config.seq_len)
  tokenizer = tokenizer_path(sources)
  if workdir and jax.process_index() == 0 and os.path.exists(tokenizer):
    with open(tokenizer) as f:  # exports ship it
      storage.write_text(storage.path(workdir) / "tokenizer.json", f.read())
  train = data.make_mixture_loader(sources, seed=config.seed, schedule=list(plan.schedule), **kw)
  named = len(sources) > 1
  held_out = {s.name if named else "": functools.partial(
      data.make_eval_loader, s.dir, num_batches=config.eval_batches, **kw) for s in sources}
  return train, held_out
