"""Mamba-3 and mamba_ssm: the test-only PyTorch reference (`mamba3_torch`) against our
scan, mamba_ssm-format directories written from it on random weights loaded with its
logits, exports that give the same files back, and the refusals.

`mamba3_torch` itself was held to mamba_ssm's own MambaLMHeadModel (its GPU kernels
swapped for the references its tests use) by `tests/mamba3_vs_mamba_ssm.py`, run by
hand: that needs a mamba_ssm checkout, which this suite cannot import on CPU.
"""

import jax
import jax.numpy as jnp
import mamba3_torch as ref
import numpy as np
import torch

from mamba_train.ops import ssd3

from helpers import rel


def test_reference_scan_matches_ssd3_sequential():
  """The reference's recurrence is ops/ssd3.py's, float64, MIMO rank 2 over two groups
  (heads map to groups as mamba_ssm repeats them) and SISO."""
  rng = np.random.default_rng(0)
  b, l, h, p, n, g = 2, 7, 4, 3, 5, 2
  for rank in (2, None):
    R = rank or 1
    x = rng.standard_normal((b, l, h, p))
    dt = np.log1p(np.exp(rng.standard_normal((b, l, h)) - 1))
    A = -np.exp(rng.uniform(-1, 1.5, (b, l, h)))
    lam = 1 / (1 + np.exp(-2 * rng.standard_normal((b, l, h))))
    B, C = (rng.standard_normal((b, l, R, g, n)) for _ in range(2))
    D = rng.standard_normal(h)
    xp = rng.standard_normal((h, R, p)) if rank else None
    with jax.enable_x64(True):
      squeeze = (lambda t: t) if rank else (lambda t: t[:, :, 0])
      y, (state, _, _) = jax.jit(ssd3.ssd3_sequential)(
          *map(jnp.asarray, (x, dt, A, lam, squeeze(B), squeeze(C))), D=jnp.asarray(D),
          x_proj=None if xp is None else jnp.asarray(xp))
    T = torch.from_numpy
    per_head = lambda t: T(t).repeat_interleave(h // g, dim=3)
    v = T(x)[:, :, None] * (T(xp).transpose(0, 1) if rank else 1)
    y_ref, state_ref = ref.scan(v, T(dt), T(A), T(lam), per_head(B), per_head(C), T(D))
    y_ref = y_ref if rank else y_ref[:, :, 0]
    assert rel(np.asarray(y), y_ref.numpy()) < 1e-12
    assert rel(np.asarray(state), state_ref.numpy()) < 1e-12


# ----------------------------------------------------------------------------
# mamba_ssm Mamba-3 directories, written from the reference on random weights.

import json  # noqa: E402

import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from mamba_train import config_for, load_model  # noqa: E402
from mamba_train.interop import export, mamba_ssm as mamba_ssm_layout  # noqa: E402
from mamba_train.interop.load import load_config  # noqa: E402
from mamba_train.model.config import MAMBA3  # noqa: E402
from mamba_train.train.run_config import model_from_init  # noqa: E402

VOCAB = 50  # padded to 64 rows
# Between them, every path of the layer: SISO and MIMO (ranks 2, 4), the plain gate
# and the out-proj norm, rope_fraction 0.5 and 1.0, one and two groups, a gated MLP
# or none, tied and untied heads; chunks smaller than the 21 tokens, with a ragged tail.
VARIANTS = {
    "siso": dict(ssm=dict(ngroups=2, chunk_size=8), d_intermediate=0, tie=True),
    "siso-norm-mlp": dict(ssm=dict(is_outproj_norm=True, rope_fraction=1.0, chunk_size=8),
                          d_intermediate=128, tie=False),
    "mimo": dict(ssm=dict(is_mimo=True, mimo_rank=2, rope_fraction=1.0, chunk_size=4),
                 d_intermediate=0, tie=False),
    "mimo-norm-mlp": dict(ssm=dict(is_mimo=True, mimo_rank=4, is_outproj_norm=True, ngroups=2, chunk_size=4),
                          d_intermediate=128, tie=True),
}
forward = nnx.jit(lambda model, ids: model(ids))


def _config(name):
  v = VARIANTS[name]
  return ref.lm_config(d_model=32, n_layer=2, vocab_size=VOCAB, d_intermediate=v["d_intermediate"],
                       tie_embeddings=v["tie"], d_state=16, headdim=8, **v["ssm"])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """{variant: (directory, its config.json, its state dict)}."""
  root = tmp_path_factory.mktemp("m3")
  out = {}
  for i, name in enumerate(VARIANTS):
    config, sd = _config(name), None
    sd = ref.random_state_dict(config, seed=10 + i)
    out[name] = (ref.write_dir(root / name, config, sd), config, sd)
  return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_directory_loads_with_the_references_logits(dirs, name):
  path, config, sd = dirs[name]
  ours = load_model(path)
  assert ours.config.pattern == ("3-" if config["d_intermediate"] else "3") * 2
  ids = np.random.default_rng(1).integers(0, VOCAB, (2, 21))
  got = np.asarray(forward(ours, jnp.asarray(ids)))
  want = ref.logits(config, sd, torch.from_numpy(ids)).numpy()[..., :VOCAB]
  assert got.shape == want.shape and got.dtype == np.float32
  assert rel(got, want) < 1e-5


@pytest.mark.parametrize("name", ["siso", "mimo-norm-mlp"])
def test_export_gives_the_same_files_back(dirs, name, tmp_path):
  """load_model, then save_mamba_ssm: the same tensors bit for bit (a tied head still
  the embedding's own tensor), the same config.json (defaults written out); and a bfloat16 directory (the
  released checkpoints' dtype) back as the same bfloat16 bits."""
  path, config, sd = dirs[name]
  export.save_mamba_ssm(load_model(path), tmp_path / "out")
  back = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
  assert sorted(back) == sorted(sd)
  for k in sd:
    assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
  if config["tie_embeddings"]:
    assert back["lm_head.weight"].data_ptr() == back["backbone.embedding.weight"].data_ptr()
  # The config as read, with every Mamba3 field stated (defaults included).
  full = dict(config, ssm_cfg={**mamba_ssm_layout.MAMBA3_DEFAULTS, **config["ssm_cfg"]})
  assert json.loads((tmp_path / "out" / "config.json").read_text()) == full

  bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
  ref.write_dir(tmp_path / "bf16", config, bf16)
  export.save_mamba_ssm(load_model(tmp_path / "bf16"), tmp_path / "bf16-out", dtype="bfloat16")
  back = torch.load(tmp_path / "bf16-out" / "pytorch_model.bin", weights_only=True)
  assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], bf16[k]) for k in bf16)


def test_init_from_takes_the_directorys_architecture(dirs):
  """`init_from` a mamba_ssm Mamba-3 directory: its config alone gives the architecture
  a run takes (the MIMO fields, the pattern with its MLPs) over the tiny recipe's."""
  import importlib.util

  from helpers import ROOT
  path, config, _ = dirs["mimo-norm-mlp"]
  arch = load_config(path)
  assert (arch.is_mimo, arch.mimo_rank, arch.is_outproj_norm, arch.ngroups, arch.chunk_size,
          arch.pattern) == (True, 4, True, 2, 4, "3-3-")
  spec = importlib.util.spec_from_file_location("tiny_m3", ROOT / "configs" / "tiny-mamba3.py")
  recipe = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(recipe)
  c = recipe.get_config()
  c.init_from = str(path)
  new, taken, problems = model_from_init(c, arch)
  assert not problems
  assert new.model.layer_pattern == "3-3-" and new.model.is_mimo and taken["is_mimo"] == (False, True)


def test_released_config_is_the_recipe():
  """The config.json of state-spaces/mamba3-mimo-1.5b (as pinned by its users: mamba_ssm's
  defaults but these fields) reads as SIZES['mamba3-mimo-1.5b'], configs/mamba3-1.5b.py's
  model: the same weights, the same chunk."""
  released = ref.lm_config(d_model=2048, n_layer=24, vocab_size=128256, d_intermediate=3824,
                           d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5,
                           chunk_size=16, is_mimo=True, mimo_rank=4, is_outproj_norm=False)
  ours = mamba_ssm_layout.mamba_ssm_config_to_ours(released)
  recipe = config_for("mamba3-mimo-1.5b")
  assert recipe.weight_differences(ours) == {} and recipe.chunk_size == ours.chunk_size == 16


def test_refusals_name_the_field(dirs, tmp_path):
  """What mamba_ssm's Mamba3 config says that ours cannot hold, and what ours holds that
  it cannot: one line, naming the field, before any weight is read or written."""
  _, config, sd = dirs["siso"]
  bad = dict(config, ssm_cfg=dict(config["ssm_cfg"], use_fancy_kernel=True))
  ref.write_dir(tmp_path / "unknown", bad, sd)
  with pytest.raises(ValueError, match=r"ssm_cfg fields \['use_fancy_kernel'\] are not supported") as e:
    load_model(tmp_path / "unknown")
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="ssm_cfg.layer is 'Mamba1'"):
    mamba_ssm_layout.mamba_ssm_config_to_ours(dict(config, ssm_cfg={}))
  # Kernel choices are the same function: read, and not written back.
  fused = dict(config, ssm_cfg=dict(config["ssm_cfg"], fuse_pregate_headwise_norm=False))
  assert mamba_ssm_layout.mamba_ssm_config_to_ours(fused) == mamba_ssm_layout.mamba_ssm_config_to_ours(config)
  # mamba_ssm takes int(expand * d_model): a whole float is the same model.
  floats = dict(config, ssm_cfg=dict(config["ssm_cfg"], expand=2.0))
  assert mamba_ssm_layout.mamba_ssm_config_to_ours(floats).expand == 2

  cfg = mamba_ssm_layout.mamba_ssm_config_to_ours(config)
  with pytest.raises(ValueError, match="A_activation='softplus'; mamba_ssm's Mamba3 computes A with the heavy-tail"):
    mamba_ssm_layout.ours_to_mamba_ssm_config(cfg.replace(A_activation="softplus"))
  with pytest.raises(ValueError, match=r"Mamba-2 \('M'\) and Mamba-3 \('3'\) layers"):
    mamba_ssm_layout.ours_to_mamba_ssm_config(cfg.replace(layer_pattern="M" + MAMBA3))
  model = load_model(dirs["siso"][0])
  with pytest.raises(export.NotExpressibleError, match="no Mamba-3 class; export with --format mamba_ssm"):
    export.save_hf(model, tmp_path / "hf")
  assert not (tmp_path / "hf").exists()


def test_mamba3_flop_count_matches_xla():
  """metrics' Mamba-3 term against XLA's count of one MIMO layer's forward (the
  parallel form; XLA also counts the elementwise work and the decays' segment-sum
  matmuls, 2 q^2 a token and head, which the formula leaves out as not the model's)."""
  from mamba_train import Mamba2LM, Runtime, metrics
  cfg = config_for("tiny", d_model=256, n_layer=1, vocab_size=256, d_state=32, headdim=64, chunk_size=16,
                   layer_pattern="3", is_mimo=True, mimo_rank=4)
  rt = Runtime(ssd_form="parallel", ssd_impl="xla").resolve("cpu")
  graph, state = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt))
  ids = jnp.zeros((1, 256), jnp.int32)
  xla = jax.jit(lambda s, x: nnx.merge(graph, s)(x)).lower(state, ids).cost_analysis()["flops"] / ids.size
  ours = metrics.forward_flops_per_token(cfg, rt, 256)
  segsum = 2 * cfg.chunk_size ** 2 * cfg.nheads
  assert 0.9 < (ours + segsum) / xla < 1.0, (ours, segsum, xla)  # 0.968 measured
