"""A local Cloud Storage for the tests: gcp-storage-emulator, in memory, plus the parts
of real GCS that it leaves out and that Orbax (through tensorstore) and the workdir
lock rely on:

  * generation preconditions: `ifGenerationMatch` on uploads, downloads and deletes
    (412 when the object's generation differs; 0 means "absent") and
    `ifGenerationNotMatch` on downloads (304). Without them two writers of
    tensorstore's OCDBT manifest both "create" it, and create-if-absent always wins;
  * the `x-goog-generation` header on downloads, where tensorstore reads an object's
    version ("Malformed StorageGeneration" without it).

The emulator's server handles one request at a time, so a check and the write after
it are atomic, as on GCS.

  python tests/gcs_emulator.py PORT BUCKET     # prints "ready" once it serves

`client_env(port)` is the environment a process needs to use it (gcsfs,
google-cloud-storage and tensorstore each read their own variable).
"""

from __future__ import annotations

import sys
from http import HTTPStatus


def client_env(port: int) -> dict[str, str]:
  url = f"http://127.0.0.1:{port}"
  return {"STORAGE_EMULATOR_HOST": url,  # gcsfs, google-cloud-storage
          "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore
          "GOOGLE_CLOUD_PROJECT": "test",
          "NO_GCE_CHECK": "true",  # google-auth would probe for a metadata server (seconds)
          # gcsfs's default client asks a gRPC control API for the bucket's type first
          # (a 60 s timeout against an emulator); the plain JSON-API client does not.
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def _generation(storage, bucket, name) -> str:
  from gcp_storage_emulator.exceptions import NotFound
  try:
    return str(storage.get_file_obj(bucket, name)["generation"])
  except NotFound:
    return "0"


def _failed(request, response, storage, name) -> bool:
  """Answer 412 / 304 for a precondition the object does not meet."""
  q = request.query
  if not name or not ({"ifGenerationMatch", "ifGenerationNotMatch"} & set(q)):
    return False
  gen = _generation(storage, request.params["bucket_name"], name)
  if "ifGenerationMatch" in q and q["ifGenerationMatch"][0] != gen:
    response.status = HTTPStatus.PRECONDITION_FAILED
    response.json({"error": {"code": 412, "message": "Precondition Failed"}})
    return True
  if "ifGenerationNotMatch" in q and q["ifGenerationNotMatch"][0] == gen:
    response.status = HTTPStatus.NOT_MODIFIED
    return True
  return False


def _upload_name(request):
  if "name" in request.query:
    return request.query["name"][0]
  data = request.data
  if isinstance(data, dict):
    return (data.get("meta") or {}).get("name") or data.get("name")
  return None


def patched_server(port: int, bucket: str):
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects

  insert, download, get, delete = objects.insert, objects.download, objects.get, objects.delete

  def insert_(request, response, storage, *a, **k):
    if "upload_id" not in request.query and _failed(request, response, storage, _upload_name(request)):
      return None
    return insert(request, response, storage, *a, **k)

  def download_(request, response, storage, *a, **k):
    name = request.params.get("object_id")
    if _failed(request, response, storage, name):
      return None
    gen = _generation(storage, request.params["bucket_name"], name)
    if gen != "0":
      response["x-goog-generation"] = gen
      response["x-goog-metageneration"] = "1"
    return download(request, response, storage, *a, **k)

  def get_(request, response, storage, *a, **k):
    if request.query.get("alt") == ["media"]:
      return download_(request, response, storage, *a, **k)
    if _failed(request, response, storage, request.params.get("object_id")):
      return None
    return get(request, response, storage, *a, **k)

  def delete_(request, response, storage, *a, **k):
    if _failed(request, response, storage, request.params.get("object_id")):
      return None
    return delete(request, response, storage, *a, **k)

  swap = {insert: insert_, download: download_, get: get_, delete: delete_}
  for _, handlers in server.HANDLERS:
    for method, fn in list(handlers.items()):
      handlers[method] = swap.get(fn, fn)
  objects.insert = insert_  # the router's fallback for uploads without the /upload prefix
  return server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)


if __name__ == "__main__":
  import logging
  logging.disable(logging.CRITICAL)  # its request log would fill the test's pipe
  srv = patched_server(int(sys.argv[1]), sys.argv[2])
  srv.start()
  print("ready", flush=True)
  sys.stdin.read()  # until the test closes our stdin (or dies)
  srv.stop()
