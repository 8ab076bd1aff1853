"""Where a run's files live: a local directory or a Cloud Storage bucket (`gs://`).

Every file of a workdir (config, metrics, lock, checkpoints, set-aside steps) is
reached through `path()`, an etils `epath.Path` (what Orbax and Grain use), so the
same code writes to a disk or to a bucket. What differs is what is atomic:

  * a local disk renames atomically: a file is rewritten by writing a temporary
    file and `os.replace`-ing it, a directory is moved by one rename;
  * a bucket has no atomic rename (a rename is a copy and a delete per object, and
    gcsfuse refuses directory renames on ordinary buckets), but one object upload
    is atomic (the object appears whole or not at all), and an object can be created
    only if absent, or deleted only if unchanged (generation preconditions).

So nothing here renames on a bucket. A file is rewritten in one upload
(`write_text`); a directory is "moved" by copying it, writing a marker that says
the copy is whole, then deleting the source (`move_dir`). Checkpoints themselves go
to Orbax as `gs://` paths: it then marks a finished step with a commit file
instead of renaming a temporary directory.

A `gs://` path needs the `gcs` extra (gcsfs for epath, google-cloud-storage for the
preconditions and copies; Orbax needs it too, to delete old steps).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time

from etils import epath

from mamba_train.errors import UserError

GCS = "gs://"
MOVED_MARKER = ".moved_from"  # in a moved directory on a bucket: the copy is whole


class StorageError(UserError, ValueError):
  """A path this library cannot write to: a scheme other than gs://, the gcs extra missing,
  a bucket that is not there, no credentials."""


def is_remote(p) -> bool:
  return "://" in os.fspath(p)


def path(p) -> epath.Path:
  """`p` as an epath.Path: absolute if local, checked (scheme, installed client) if remote."""
  s = os.fspath(p)
  if not is_remote(s):
    return epath.Path(os.path.abspath(s))
  if not s.startswith(GCS):
    raise StorageError(f"{s}: only local paths and gs:// buckets are supported")
  _check_gcs_client()
  return epath.Path(s)


@functools.cache
def _check_gcs_client() -> None:
  try:
    import gcsfs  # noqa: F401  (epath's gs:// backend)
    from google.cloud import storage  # noqa: F401
  except ImportError as e:
    raise StorageError(f"a gs:// path needs the gcs extra ({e.name} is missing): "
                       "pip install -e '.[gcs]'") from None


def check_workdir(p) -> None:
  """Raise StorageError, naming the fix, when `p` cannot be a workdir here: a bucket that
  does not exist or that these credentials cannot see (said now, not at the first save)."""
  if not is_remote(p):
    return
  path(p)
  from google.auth import exceptions as auth_errors
  bucket = _split(p)[0]
  try:
    found = _client().bucket(bucket).exists()
  except auth_errors.DefaultCredentialsError as e:
    raise StorageError(f"{p}: no Google Cloud credentials ({str(e).splitlines()[0]}); run "
                       "`gcloud auth application-default login`, or use a VM's service account") from None
  if not found:
    raise StorageError(f"{p}: the bucket gs://{bucket} does not exist or these credentials cannot "
                       "see it; create it (gcloud storage buckets create gs://...) or fix the name")


def makedirs(p) -> None:
  """Create the directory `p` (a bucket has none: nothing to do, and gcsfs would create
  a missing bucket)."""
  if not is_remote(p):
    os.makedirs(p, exist_ok=True)


def free_bytes(p) -> int | None:
  """Free space on the disk holding `p` (its nearest existing parent); None for a bucket."""
  if is_remote(p):
    return None
  q = os.path.abspath(os.fspath(p))
  while not os.path.exists(q) and q != os.path.dirname(q):
    q = os.path.dirname(q)
  return shutil.disk_usage(q).free


# -- whole files --


def write_text(p, text: str) -> None:
  """Replace the file `p` with `text` atomically: readers see the old or the new, never part."""
  if is_remote(p):
    path(p).write_text(text)  # one upload: the object appears whole
    return
  tmp = f"{p}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, p)


def create_new(p, text: str) -> bool:
  """Create the file `p` holding `text` if it does not exist; False if it does."""
  if is_remote(p):
    from google.api_core import exceptions
    blob = _blob(p)
    if blob.exists():
      return False
    try:
      blob.upload_from_string(text, if_generation_match=0)  # a racing creator: one wins
    except exceptions.PreconditionFailed:
      return False
    finally:
      _forget_listings(p)
    return True
  try:
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # local disks, NFS v3+
  except FileExistsError:
    return False
  with os.fdopen(fd, "w") as f:
    f.write(text)
  return True


def version(p) -> tuple[object, float] | None:
  """(a token that changes whenever `p` is written, its modification time), or None if absent."""
  if is_remote(p):
    blob = _gcs_bucket(p).get_blob(_split(p)[1])
    return None if blob is None else (blob.generation, blob.updated.timestamp())
  try:
    st = os.stat(p)
  except FileNotFoundError:
    return None
  return (st.st_ino, st.st_mtime_ns), st.st_mtime


def remove_if_unchanged(p, token) -> bool:
  """Delete `p` if it is still the version `token` names; True if this call removed it.
  Of several callers racing to remove the same version, one wins."""
  if is_remote(p):
    from google.api_core import exceptions
    try:
      _blob(p).delete(if_generation_match=token)
    except (exceptions.PreconditionFailed, exceptions.NotFound):
      return False
    finally:
      _forget_listings(p)
    return True
  # A rename to a name of our own: one taker wins, the others find no file. (A local
  # disk has no compare-and-delete: a version written between the check and the
  # rename is taken too.)
  now = version(p)
  if now is None or now[0] != token:
    return False
  mine = f"{p}.taken.{os.getpid()}"
  try:
    os.replace(p, mine)
  except FileNotFoundError:
    return False
  os.unlink(mine)
  return True


def local_copy(p) -> str:
  """A local path holding the file `p`: `p` itself on a disk, else a temporary copy (for
  libraries that read only local files, like tokenizers)."""
  if not is_remote(p):
    return os.fspath(p)
  local = os.path.join(tempfile.mkdtemp(prefix="mamba_train_"), os.path.basename(os.fspath(p)))
  with open(local, "wb") as f:
    f.write(path(p).read_bytes())
  return local


# -- directories --


def move_dir(src, dst, *, first: tuple[str, ...] = ()) -> None:
  """Move the directory `src` to `dst` (which must not exist); nothing is lost if the
  process dies at any point.

  Local: one rename (atomic). Bucket: copy every object to `dst`, then write
  `dst/.moved_from` (the copy is whole: a `dst` without it is an interrupted copy and
  `src` is still intact), then delete the sources, the names in `first` before the
  rest (Orbax's commit file: from then on `src` is no finished step)."""
  if not is_remote(src):
    os.rename(src, dst)
    return
  bucket, src_key = _split(src)
  dst_key = _split(dst)[1]
  b = _gcs_bucket(src)
  blobs = list(b.list_blobs(prefix=src_key.rstrip("/") + "/"))
  for blob in blobs:
    b.copy_blob(blob, b, dst_key.rstrip("/") + "/" + blob.name[len(src_key.rstrip("/")) + 1:])
  b.blob(dst_key.rstrip("/") + "/" + MOVED_MARKER).upload_from_string(
      json.dumps({"from": f"{GCS}{bucket}/{src_key}", "objects": len(blobs), "time": time.time()}))
  top = src_key.rstrip("/") + "/"
  blobs.sort(key=lambda blob: blob.name[len(top):] not in first)
  try:
    for blob in blobs:
      blob.delete()
  finally:
    _forget_listings(None)


# -- the bucket client --


def _split(p) -> tuple[str, str]:
  bucket, _, key = os.fspath(p)[len(GCS):].partition("/")
  return bucket, key


@functools.cache
def _client():
  _check_gcs_client()
  from google.cloud import storage
  return storage.Client()


def _gcs_bucket(p):
  return _client().bucket(_split(p)[0])


def _blob(p):
  return _gcs_bucket(p).blob(_split(p)[1])


def _forget_listings(p) -> None:
  """gcsfs (epath's client, and Orbax's) caches directory listings: after a change made
  through the other client, drop those of `p` and its parents (None: all), or Orbax
  would still list a step that was moved away."""
  from etils.epath import backend
  fs = backend.fsspec_backend.fs(GCS)
  fs.invalidate_cache(None if p is None else os.fspath(p))
