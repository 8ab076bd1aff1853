"""The embedded default corpus: Python standard library sources, offline.

Every Python install has them, so `python train.py` works with no download.
Sources and their docstrings are a mix of English and code, enough for the
byte-level model to learn something visible in a short CPU run.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

from mamba_train.data import prepare


NAME = "default"
# Test suites hold deliberately odd encodings and generated data; the rest is prose-like.
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
              "lib2to3", "turtledemo"}


def stdlib_files(max_bytes: int) -> list[str]:
  """Standard library .py files in sorted (deterministic) walk order, up to max_bytes."""
  root = sysconfig.get_paths()["stdlib"]
  files, total = [], 0
  for d, dirs, names in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-"))
    for n in sorted(names):
      if not n.endswith(".py"):
        continue
      path = os.path.join(d, n)
      size = os.path.getsize(path)
      if total + size > max_bytes:
        continue  # Skip files that do not fit; smaller ones later may.
      files.append(path)
      total += size
  return files


def ensure_default_corpus(root: str = "data", *, max_bytes: int = 4_000_000) -> str:
  """Prepares `root/default` from the standard library (first call) and returns it.

  Later calls return at once when the same files were already prepared (a
  different Python install gives a different corpus and rebuilds it).
  """
  texts = []
  for path in stdlib_files(max_bytes):
    with open(path, encoding="utf-8", errors="replace") as f:
      texts.append(f.read())
  if not texts:
    raise FileNotFoundError(
        f"No Python sources found under {sysconfig.get_paths()['stdlib']!r} for the "
        "default corpus; prepare a dataset with scripts/prepare_data.py instead.")
  digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]
  ds = prepare._datasets().Dataset.from_dict({"text": texts})
  return prepare.prepare_dataset(ds, NAME, root=root, tokenizer="byte", val_fraction=0.02,
                                 num_proc=1, source_fingerprint=digest,
                                 source_description=f"Python {sysconfig.get_python_version()} "
                                 f"standard library ({len(texts)} .py files)")
