"""Export never deletes what it reads: it refuses its own source (or a directory
holding it) and replaces only a previous export."""

import pytest

from helpers import export_cli, tree_sizes


def test_export_never_replaces_its_source_or_a_non_export(tmp_path):
  from mamba_train.interop import export
  src = tmp_path / "run"
  (src / "checkpoints" / "2" / "state").mkdir(parents=True)  # a workdir's shape: never opened
  (src / "metrics.jsonl").write_text("{}\n")
  before = tree_sizes(src)
  for out in (src, src / "exported", tmp_path):  # equal, inside, containing
    with pytest.raises(export.ExportPathError, match="checkpoint"):
      export.check_out(out, src / "checkpoints" / "2" if out == tmp_path else src)
  r = export_cli(src, src, "--overwrite")  # the reported failure: it deleted the run
  assert r.returncode == 2 and "is the checkpoint" in r.stderr and "Traceback" not in r.stderr, r.stderr
  assert tree_sizes(src) == before

  # --overwrite replaces a previous export only.
  from flax import nnx

  from mamba_train import Mamba2Config
  from mamba_train.model.lm import Mamba2LM
  model = Mamba2LM(Mamba2Config(d_model=32, n_layer=1, vocab_size=64, headdim=8, d_state=8,
                                chunk_size=8), rngs=nnx.Rngs(0))
  unrelated = tmp_path / "notes"
  unrelated.mkdir()
  (unrelated / "keep.txt").write_text("mine")
  with pytest.raises(export.ExportPathError, match="not a previous export"):
    export.save_hf(model, unrelated, overwrite=True)
  assert (unrelated / "keep.txt").read_text() == "mine"
  out = export.save_hf(model, tmp_path / "exp")
  assert (out / export.MARKER).exists()
  (out / "stale.txt").write_text("from the first export")
  export.save_hf(model, out, overwrite=True)
  assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
