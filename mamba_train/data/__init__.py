"""Input pipeline: tokenizers, preparation into token shards, and the Grain loader.

  prepare_dataset / ensure_default_corpus  ->  data/<name>/{train,validation}.npy
  prepare_chat_dataset                     ->  packed chat rows with a loss mask (chat.py)
  prepare_preference_dataset               ->  one row per DPO pair (preference.py)
  load_prompts / PromptIterator            ->  GRPO's prompts, split, and their resumable order (prompts.py)
  make_train_loader / make_eval_loader     ->  numpy batches for this process
  make_mixture_loader                      ->  the same from weighted sources (mixture.py)
  SyntheticLoader                          ->  the same batches from a Markov stream, no files
"""

from mamba_train.data.chat import ChatFormatError, prepare_chat_dataset
from mamba_train.data.corpus import ensure_default_corpus
from mamba_train.data.loader import (check_splits, make_eval_loader, make_mixture_loader,
                                     make_train_loader, validate_for_model)
from mamba_train.data.mixture import (Source, SourceShare, check_sources, parse_mixture,
                                      parse_schedule)
from mamba_train.data.preference import prepare_preference_dataset
from mamba_train.data.prepare import DataError, prepare_dataset, read_metadata
from mamba_train.data.prompts import PromptFormatError, PromptIterator, load_prompts
from mamba_train.data.synthetic import SyntheticLoader
from mamba_train.data.tokenizer import byte_tokenizer, load_tokenizer

__all__ = ["byte_tokenizer", "ChatFormatError", "check_sources", "check_splits", "DataError",
           "ensure_default_corpus", "load_prompts", "load_tokenizer", "make_eval_loader", "make_mixture_loader",
           "make_train_loader", "parse_mixture", "parse_schedule", "prepare_chat_dataset",
           "prepare_dataset", "prepare_preference_dataset", "PromptFormatError", "PromptIterator",
           "read_metadata", "Source", "SourceShare", "SyntheticLoader", "validate_for_model"]
