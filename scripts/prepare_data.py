"""Tokenizes a text dataset into data/<name>/ for training.

  # Local files (txt/md: one file per document; json/jsonl/parquet/arrow: one row each):
  python scripts/prepare_data.py --source='corpus/*.jsonl' --name=mycorpus --text_field=text
  # A hub dataset with the GPT-NeoX tokenizer of the released Mamba-2 models (network):
  python scripts/prepare_data.py --source=roneneldan/TinyStories \
      --tokenizer=EleutherAI/gpt-neox-20b --name=tinystories
  # Chat / instruction data ({"messages": [...]} or {"prompt", "response"} per line), rendered
  # with the tokenizer's chat template, loss on assistant tokens only, packed into rows:
  python scripts/prepare_data.py --chat --source=chats.jsonl --name=sft \
      --tokenizer=EleutherAI/gpt-neox-20b --seq_len=2048 --too_long=drop
  # Preference pairs for DPO ({"prompt", "chosen", "rejected"} per line: strings, or lists of
  # messages as UltraFeedback has), rendered and masked as --chat does, one pair a row:
  python scripts/prepare_data.py --preference --source='prefs/*.jsonl' --name=prefs \
      --tokenizer=EleutherAI/gpt-neox-20b --seq_len=2048
  # The embedded default corpus (Python standard library, byte tokenizer, offline):
  python scripts/prepare_data.py --default_corpus

Rerunning with the same inputs returns at once; --force rebuilds.
"""

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend

import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from mamba_train import cli, data  # noqa: E402

_SOURCE = flags.DEFINE_string("source", None, "Files, directory, glob or hub dataset name.")
_NAME = flags.DEFINE_string("name", None, "Output directory name under --root.")
_ROOT = flags.DEFINE_string("root", "data", "Where prepared datasets live.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "Column holding the text.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte",
                                 "'byte', a tokenizer.json path, or a transformers name.")
_EOS = flags.DEFINE_string("eos_token", None, "End-of-text token, if not the tokenizer's.")
_CONFIG = flags.DEFINE_string("config_name", None, "Hub dataset configuration.")
_VAL = flags.DEFINE_float("val_fraction", 0.005,
                          "Fraction of documents for validation if the source has none.")
_SAMPLE_BY = flags.DEFINE_enum("sample_by", "document", ["document", "paragraph", "line"],
                               "What one document is in .txt/.md files.")
_NUM_PROC = flags.DEFINE_integer("num_proc", None, "Tokenizer processes (default: by size).")
_FORCE = flags.DEFINE_bool("force", False, "Rebuild even if already prepared.")
_DEFAULT = flags.DEFINE_bool("default_corpus", False, "Prepare the embedded default corpus.")
_CHAT = flags.DEFINE_bool("chat", False, "--source is a chat/instruction jsonl file.")
_PREFERENCE = flags.DEFINE_bool("preference", False, "--source is DPO preference jsonl (path or glob).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "Chat, preference: packed row length (the run's seq_len).")
_TOO_LONG = flags.DEFINE_enum("too_long", "drop", ["drop", "truncate"],
                              "Chat: examples longer than a row are dropped or truncated.")
_TEMPLATE = flags.DEFINE_string("chat_template", None,
                                "Chat: a jinja template file (default: the tokenizer's own, "
                                "else a built-in one).")


def main(argv):
  del argv
  try:
    prepare()
  except (data.DataError, FileNotFoundError, KeyError, ValueError) as e:
    # Bad input: one line naming the file (and line) and what to do.
    print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
    sys.exit(2)


def prepare():
  if _DEFAULT.value:
    path = data.ensure_default_corpus(_ROOT.value)
  elif _SOURCE.value is None:
    raise app.UsageError("Pass --source=... (or --default_corpus).")
  elif _CHAT.value or _PREFERENCE.value:  # rendered with the chat template, packed with a loss mask
    prepare_packed = data.prepare_preference_dataset if _PREFERENCE.value else data.prepare_chat_dataset
    try:
      path = prepare_packed(
          _SOURCE.value, _NAME.value, root=_ROOT.value, seq_len=_SEQ_LEN.value,
          tokenizer=_TOKENIZER.value, eos_token=_EOS.value, template=_TEMPLATE.value,
          too_long=_TOO_LONG.value, val_fraction=_VAL.value)
    except data.ChatFormatError as e:
      raise SystemExit(f"error: {e}") from None
  else:
    path = data.prepare_dataset(
        _SOURCE.value, _NAME.value, root=_ROOT.value, text_field=_TEXT_FIELD.value,
        tokenizer=_TOKENIZER.value, eos_token=_EOS.value, config_name=_CONFIG.value,
        val_fraction=_VAL.value, text_sample_by=_SAMPLE_BY.value, num_proc=_NUM_PROC.value,
        force=_FORCE.value)
  meta = data.read_metadata(path)
  for split, info in meta["splits"].items():
    logging.info("%s: %s documents, %s tokens", split, f"{info['documents']:,}",
                 f"{info['tokens']:,}")
  print(path)


if __name__ == "__main__":
  cli.run(main)
