"""Input pipeline: tokenizers, preparation into token shards, and the Grain loader.

  prepare_dataset / ensure_default_corpus  ->  data/<name>/{train,validation}.npy
  make_train_loader / make_eval_loader     ->  numpy batches for this process
  SyntheticLoader                          ->  the same batches from a Markov stream, no files
"""

from mamba_train.data.corpus import ensure_default_corpus
from mamba_train.data.loader import (check_splits, make_eval_loader, make_train_loader,
                                     validate_for_model)
from mamba_train.data.prepare import DataError, prepare_dataset, read_metadata
from mamba_train.data.synthetic import SyntheticLoader
from mamba_train.data.tokenizer import byte_tokenizer, load_tokenizer

__all__ = ["byte_tokenizer", "check_splits", "DataError", "ensure_default_corpus", "load_tokenizer", "make_eval_loader",
           "make_train_loader", "prepare_dataset", "read_metadata", "SyntheticLoader",
           "validate_for_model"]
