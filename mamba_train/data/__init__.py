"""Input pipeline: tokenizers, preparation into token shards, and the Grain loader.

  prepare_dataset / ensure_default_corpus  ->  data/<name>/{train,validation}.npy
  make_train_loader / make_eval_loader     ->  numpy batches for this process
  to_global                                ->  globally sharded jax.Arrays
"""

from mamba_train.data.corpus import ensure_default_corpus
from mamba_train.data.loader import (loader_throughput, make_eval_loader, make_train_loader,
                                     to_global, validate_for_model)
from mamba_train.data.prepare import prepare_dataset, read_metadata
from mamba_train.data.tokenizer import byte_tokenizer, load_tokenizer

__all__ = ["byte_tokenizer", "ensure_default_corpus", "load_tokenizer", "loader_throughput",
           "make_eval_loader", "make_train_loader", "prepare_dataset", "read_metadata",
           "to_global", "validate_for_model"]
