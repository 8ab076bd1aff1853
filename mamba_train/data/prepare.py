"""Preparation: a Hugging Face `datasets` source to flat token shards on disk.

Layout of a prepared dataset `data/<name>/`:
  train.npy, validation.npy  one flat uint16 (vocab <= 65536) or uint32 array per
                             split: every document's tokens then EOS, back to back.
  tokenizer.json             the tokenizer that made them.
  metadata.json              written last; a directory without it is not a dataset.

The whole directory is built under a temporary name and renamed into place, so
a crash never leaves something that looks complete. Rerunning with the same
inputs (same fingerprint) returns the existing directory at once.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from mamba_train.data import tokenizer as tokenizer_lib
from mamba_train.errors import UserError

if TYPE_CHECKING:  # annotations only: importing datasets takes seconds (see _datasets)
  import datasets

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json",
             ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
_GLOB_CHARS = "*?["


def _datasets():
  # Imported when a dataset is prepared, not with the package: it takes seconds (pandas
  # and all), and train.py on a prepared dataset, the scripts and the tests' many
  # train.py processes never use it.
  import datasets
  return datasets


def shard_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def prepare_dataset(
    source: str | datasets.Dataset | datasets.DatasetDict,
    name: str | None = None,
    *,
    root: str = "data",
    text_field: str = "text",
    tokenizer: str = tokenizer_lib.BYTE,
    eos_token: str | None = None,
    config_name: str | None = None,
    val_fraction: float = 0.005,
    text_sample_by: str = "document",
    num_proc: int | None = None,
    source_fingerprint: str | None = None,
    source_description: str | None = None,
    cache_dir: str | None = None,
    force: bool = False,
) -> str:
  """Tokenizes `source` and writes `root/name/`; returns that path.

  source: a local file, directory or glob of .txt/.md (`text_sample_by`:
    "document" = one file per document, or "paragraph"/"line"), .json/.jsonl,
    .parquet or .arrow files; a directory written by `save_to_disk`; a hub
    dataset name (with `config_name`); or an in-memory Dataset/DatasetDict (then
    pass `source_fingerprint`, a hash of its content, to enable reuse, and a
    `source_description` for the metadata).
  A "validation" split of the source is used as is; otherwise `val_fraction` of
  the documents (at least one, chosen with a fixed seed) is split off.
  Non-UTF-8 bytes in text files are decoded as U+FFFD (errors="replace") and
  counted in the log and metadata; JSON files must be valid UTF-8.
  """
  datasets = _datasets()
  tok = tokenizer_lib.load_tokenizer(tokenizer, eos_token=eos_token)
  if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
    desc = source_description or "<in-memory dataset>"
    src_fp, load = source_fingerprint, lambda: source
  else:
    desc, src_fp, load = _resolve_source(source, config_name, text_sample_by, cache_dir)
  name = name or _default_name(source)
  out = os.path.join(root, name)
  settings = dict(format=FORMAT_VERSION, source=src_fp, text_field=text_field,
                  tokenizer=tok.fingerprint, eos_id=tok.eos_id, val_fraction=val_fraction,
                  text_sample_by=text_sample_by)
  fingerprint = (_hash(settings) if src_fp is not None else None)
  if not force and fingerprint and _existing_fingerprint(out) == fingerprint:
    log.info("Reusing %s: already prepared from the same inputs (fingerprint %s).",
             out, fingerprint)
    return out

  splits = _as_splits(load(), desc, text_field, val_fraction)
  os.makedirs(root, exist_ok=True)
  tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    meta: dict[str, Any] = dict(
        format_version=FORMAT_VERSION, name=name, source=desc, text_field=text_field,
        tokenizer=tok.name, tokenizer_fingerprint=tok.fingerprint,
        vocab_size=tok.vocab_size, eos_id=tok.eos_id,
        dtype=shard_dtype(tok.vocab_size).name, fingerprint=fingerprint, splits={},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    # Saved before tokenizing, which switches the tokenizer to read special tokens as text.
    tok.tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    for split, ds in splits.items():
      meta["splits"][split] = _write_split(ds, split, tmp, tok, text_field, num_proc, desc)
    meta["max_token_id"] = max(s.pop("max_token_id") for s in meta["splits"].values())
    with open(os.path.join(tmp, "metadata.json"), "w") as f:
      json.dump(meta, f, indent=2)
    _publish(tmp, out, fingerprint)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  log.info("Prepared %s: %s", out, {k: (v["documents"], v["tokens"])
                                    for k, v in meta["splits"].items()})
  return out


class DataError(UserError, ValueError):
  """Input data that cannot be used; the message names the file and what to do."""


class DataNotFoundError(DataError, FileNotFoundError):
  pass


def read_metadata(data_dir: str) -> dict:
  """The metadata.json of a prepared dataset, with a clear error when it is not one."""
  if not os.path.isdir(data_dir):
    raise DataNotFoundError(
        f"Dataset directory {data_dir!r} does not exist. Prepare it with "
        "`python scripts/prepare_data.py --source=... --name=...`.")
  path = os.path.join(data_dir, "metadata.json")
  if not os.path.isfile(path):
    raise DataNotFoundError(
        f"{path!r} is missing: {data_dir!r} is not a prepared dataset (or its "
        "preparation never finished). Run scripts/prepare_data.py again.")
  try:
    with open(path) as f:
      meta = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise DataError(f"{path!r} is damaged ({type(e).__name__}: {e}); prepare the dataset "
                    "again (scripts/prepare_data.py ... --force).") from None
  if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
    version = meta.get("format_version") if isinstance(meta, dict) else None
    raise DataError(f"{path!r} has format version {version}, this "
                    f"code reads {FORMAT_VERSION}; prepare the dataset again.")
  return meta


# --- Sources ------------------------------------------------------------------


def _resolve_source(source: str, config_name, sample_by, cache_dir):
  """(description, fingerprint or None, loader) for a path, glob or hub name.

  Local inputs are fingerprinted by path, size and mtime (no full read), so a
  rerun decides to reuse in milliseconds.
  """
  datasets = _datasets()
  path = os.path.expanduser(source)
  if os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_dict.json"))
                              or os.path.isfile(os.path.join(path, "state.json"))):
    stats = [_stat(f) for f in sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
             if os.path.isfile(f)]
    return path, _hash(stats), lambda: datasets.load_from_disk(path)
  files = _local_files(path)
  if files is None:  # Not a local path: a hub name.
    def load_hub():
      try:
        return datasets.load_dataset(source, config_name, cache_dir=cache_dir)
      except Exception as e:  # The hub client raises many types; all mean the same here.
        raise ValueError(
            f"{source!r} is not a local file or directory, and loading it from the "
            f"Hugging Face hub failed ({type(e).__name__}: {e}). Check the path, or "
            "the dataset name and your network.") from e
    # A hub dataset is identified by its name; pass force=True to fetch it afresh.
    return source, _hash(["hub", source, config_name]), load_hub
  exts = {os.path.splitext(f)[1].lower() for f in files}
  builders = {_BUILDERS.get(e) for e in exts}
  if None in builders or len(builders) != 1:
    raise ValueError(
        f"{source!r}: files must all be one kind of {sorted(_BUILDERS)}, found {sorted(exts)}.")
  builder = builders.pop()
  kwargs = dict(sample_by=sample_by, encoding_errors="replace") if builder == "text" else {}
  fp = _hash([builder, kwargs, config_name, [_stat(f) for f in files]])

  def load_files():
    if builder == "json":
      # Arrow's JSON reader may accept bad bytes and fail later, far from the file.
      bad = next((f for f in files if not _is_utf8(f)), None)
      if bad:
        raise ValueError(
            f"{bad!r} is not valid UTF-8. JSON inputs must be UTF-8; re-encode the file "
            "(e.g. `iconv -f latin1 -t utf-8`). Plain text files are read with "
            "undecodable bytes replaced by U+FFFD instead.")
      for f in files:
        if f.lower().endswith(".jsonl"):
          _check_json_lines(f)
    try:
      return datasets.load_dataset(builder, data_files={"train": files},
                                   cache_dir=cache_dir, **kwargs)
    except UnicodeDecodeError as e:
      bad = next((f for f in files if not _is_utf8(f)), files[0])
      raise ValueError(
          f"{bad!r} is not valid UTF-8 ({e.reason} at byte {e.start}). JSON inputs must "
          "be UTF-8; re-encode the file (e.g. `iconv -f latin1 -t utf-8`). Plain text "
          "files are read with undecodable bytes replaced by U+FFFD instead.") from e
  return ", ".join(files) if len(files) <= 3 else f"{source} ({len(files)} files)", fp, load_files


def _check_json_lines(path: str) -> None:
  """A .jsonl file must hold one JSON object per non-blank line; name the first bad line
  (the datasets library's own errors name neither file nor line)."""
  seen = False
  with open(path, "rb") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      seen = True
      try:
        row = json.loads(line)
      except ValueError as e:
        raise DataError(f"{path}:{number}: not a JSON object ({e}); each line of a .jsonl file "
                        "must be one JSON object. Fix or remove that line.") from None
      if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: a JSON {type(row).__name__}, not an object; each line "
                        "of a .jsonl file must be one JSON object like {\"text\": \"...\"}.")
  if not seen:
    raise DataError(f"{path} is empty: it holds no JSON lines. Remove it from --source or fill it.")


def _local_files(path: str) -> list[str] | None:
  """Sorted data files for a file, directory or glob; None if `path` is no path."""
  if os.path.isfile(path):
    return [path]
  if os.path.isdir(path):
    files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                   if os.path.splitext(f)[1].lower() in _BUILDERS and os.path.isfile(f))
    if not files:
      raise FileNotFoundError(f"Directory {path!r} holds no data files ({sorted(_BUILDERS)}).")
    return files
  if any(c in path for c in _GLOB_CHARS):
    files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
      raise FileNotFoundError(f"No files match {path!r}.")
    return files
  looks_local = (path.startswith((".", "/", "~")) or os.path.splitext(path)[1].lower()
                 in _BUILDERS or path.count("/") > 1)
  if looks_local:
    raise FileNotFoundError(f"Data source {path!r} does not exist. Check the path.")
  return None


def _as_splits(ds, desc, text_field, val_fraction) -> dict[str, datasets.Dataset]:
  """{"train": ..., "validation": ...} with empty documents removed (and counted)."""
  datasets = _datasets()
  if isinstance(ds, datasets.Dataset):
    ds = datasets.DatasetDict(train=ds)
  if "train" not in ds:
    raise ValueError(f"{desc!r} has no 'train' split (it has {list(ds)}).")
  splits = {"train": ds["train"]}
  for val_name in ("validation", "valid", "val"):
    if val_name in ds:
      splits["validation"] = ds[val_name]
      break
  for split, d in splits.items():
    if text_field not in d.column_names:
      raise KeyError(f"{desc!r} ({split}) has no text field {text_field!r}; its fields are "
                     f"{d.column_names}. Pass --text_field=<one of them>.")
    n = len(d)
    d = d.filter(lambda t: [bool(x) for x in t], input_columns=text_field, batched=True)
    if n != len(d):
      log.warning("%s (%s): skipped %d empty documents of %d.", desc, split, n - len(d), n)
    if len(d) == 0:
      raise ValueError(f"{desc!r} ({split}) has no non-empty documents in field {text_field!r}.")
    splits[split] = d
  if "validation" not in splits and val_fraction > 0:
    train = splits["train"]
    if len(train) < 2:
      raise ValueError(f"{desc!r} has a single document: cannot split off validation. "
                       "Add documents or pass val_fraction=0.")
    n_val = min(len(train) - 1, max(1, round(val_fraction * len(train))))
    parts = train.train_test_split(test_size=n_val, shuffle=True, seed=0)
    splits = {"train": parts["train"], "validation": parts["test"]}
  return splits


# --- Writing ------------------------------------------------------------------


def _write_split(ds, split, out_dir, tok, text_field, num_proc, desc) -> dict:
  dtype = shard_dtype(tok.vocab_size)
  eos = np.array([tok.eos_id], dtype)
  encoder = tok.tokenizer

  def encode(texts):
    bad = [t.count("\ufffd") for t in texts]
    if tok.name == tokenizer_lib.BYTE:
      # The byte tokenizer's ids are the UTF-8 bytes (tested): numpy does in
      # milliseconds what the tokenizers library needs seconds for.
      return {"ids": [np.concatenate([np.frombuffer(t.encode("utf-8", "replace"), np.uint8)
                                      .astype(dtype), eos]) for t in texts], "bad": bad}
    # Literal "<|endoftext|>" in a document is text, not a boundary: only the EOS
    # we append may split documents (seq_idx is built from EOS positions).
    encoder.encode_special_tokens = True
    encs = encoder.encode_batch_fast(texts, add_special_tokens=False)
    return {"ids": [np.concatenate([np.asarray(e.ids, dtype), eos]) for e in encs],
            "bad": bad}

  if num_proc is None:  # Worker processes pay off only on large inputs.
    num_proc = max(1, min(os.cpu_count() or 1, len(ds) // 20_000)) or None
  datasets = _datasets()
  features = datasets.Features({"ids": datasets.Sequence(datasets.Value(dtype.name)),
                                "bad": datasets.Value("int64")})
  ds = ds.map(encode, input_columns=text_field, batched=True, batch_size=256,
              remove_columns=ds.column_names, features=features,
              num_proc=num_proc if num_proc > 1 else None, desc=f"Tokenizing {split}")
  import pyarrow.compute as pc  # with datasets, which brings it: not on every train.py start
  lengths = pc.list_value_length(ds.data.column("ids"))
  n_tokens = pc.sum(lengths).as_py()
  n_bad = pc.sum(ds.data.column("bad")).as_py()
  if n_bad:
    log.warning("%s (%s): %d U+FFFD replacement characters (undecodable bytes, or "
                "present in the source) were tokenized as such.", desc, split, n_bad)
  filename = f"{split}.npy"
  arr = np.lib.format.open_memmap(os.path.join(out_dir, filename), "w+", dtype, (n_tokens,))
  pos, max_id = 0, 0
  with tqdm(total=n_tokens, unit="tok", unit_scale=True, desc=f"Writing {split}") as bar:
    for table in ds.with_format("arrow").iter(batch_size=4096):
      flat = pc.list_flatten(table.column("ids")).to_numpy()
      arr[pos:pos + len(flat)] = flat
      max_id = max(max_id, int(flat.max()))
      pos += len(flat)
      bar.update(len(flat))
  arr.flush()
  del arr
  if max_id >= tok.vocab_size:  # Only a broken tokenizer file can do this.
    raise ValueError(f"Tokenizer {tok.name!r} emitted id {max_id} >= its vocab size "
                     f"{tok.vocab_size}; the tokenizer file is inconsistent.")
  return dict(file=filename, tokens=n_tokens, documents=len(ds),
              replacement_characters=n_bad, max_token_id=max_id)


def _publish(tmp: str, out: str, fingerprint: str | None) -> None:
  """Move the finished `tmp` to `out`, replacing an older dataset there."""
  old = None
  if os.path.exists(out):
    old = f"{tmp}.old"
    os.rename(out, old)
  try:
    os.rename(tmp, out)
  except OSError:
    # Another process published the same dataset between our two renames.
    if not (fingerprint and _existing_fingerprint(out) == fingerprint):
      raise
  if old:
    shutil.rmtree(old, ignore_errors=True)


# --- Small helpers ------------------------------------------------------------


def _existing_fingerprint(out: str) -> str | None:
  try:
    with open(os.path.join(out, "metadata.json")) as f:
      return json.load(f).get("fingerprint")
  except (OSError, ValueError):
    return None


def _default_name(source) -> str:
  """"corpus/*.jsonl" -> corpus, "a/b.txt" -> b, "org/set" -> set."""
  if not isinstance(source, str):
    return "dataset"
  s = source.rstrip("/")
  if any(c in s for c in _GLOB_CHARS):
    s = os.path.dirname(s.split("*")[0].split("?")[0].split("[")[0]) or "dataset"
  return os.path.splitext(os.path.basename(s.rstrip("/")))[0] or "dataset"


def _stat(path: str) -> list:
  st = os.stat(path)
  return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def _hash(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _is_utf8(path: str) -> bool:
  try:
    with open(path, encoding="utf-8") as f:
      while f.read(1 << 24):
        pass
    return True
  except UnicodeDecodeError:
    return False
