"""The windowed SSD (`Mamba2Config.ssd_window`): the chunked form against a direct
float64 sum over each window, the model's cached decoding against its full forward,
8 simulated devices against one, and what refuses a window."""

import json
import os
import sys

if __name__ == "__main__":  # the multi-device worker: this checkout's package, not an installed one
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.ops import ssd

from helpers import packed_ids, rel, ssd_inputs

chunked = jax.jit(ssd.ssd_chunked, static_argnums=5, static_argnames=("form", "window"))


def direct_window(x, dt, A, B, C, D, window, seq_idx=None):
  """The definition, in float64 with no chunks: for each t, the sum over s in
  (t - W, t] of its document of (C_t . B_s) exp(sum_{s<r<=t} dt_r A) dt_s x_s, plus
  D x_t; and the windowed state after the last position. Every decay is a masked
  sum over r of the terms it covers, so it is differentiable for the gradients."""
  b, l, h, p = x.shape
  g = B.shape[2]
  t, s = jnp.arange(l)[:, None], jnp.arange(l)[None, :]
  r = jnp.arange(l)
  a = dt * A  # (b, l, h)
  covers = (r[None, None, :] > s[..., None]) & (r[None, None, :] <= t[..., None])  # (t, s, r)
  logd = jnp.einsum("tsr,brh->bhts", covers.astype(a.dtype), a)
  keep = (s <= t) & (t - s < window)
  keep = jnp.broadcast_to(keep, (b, l, l))
  if seq_idx is not None:
    keep = keep & (seq_idx[:, :, None] == seq_idx[:, None, :])
  cb = jnp.repeat(jnp.einsum("btgn,bsgn->bgts", C, B), h // g, axis=1)  # (b, h, t, s)
  m = jnp.where(keep[:, None], cb * jnp.exp(logd), 0.0)
  y = jnp.einsum("bhts,bsh,bshp->bthp", m, dt, x) + x * D[:, None]
  last = jnp.where(keep[:, None, -1], jnp.exp(logd[:, :, -1]), 0.0)  # (b, h, s): to the end
  Bh = jnp.repeat(B, h // g, axis=2)
  final = jnp.einsum("bhs,bsh,bshp,bshn->bhpn", last, dt, x, Bh)
  return y, final


def f64(*ts):
  return tuple(jnp.asarray(np.asarray(t, np.float64)) for t in ts)


# (l, chunk, groups, window, seq_idx): W a multiple of the chunk (one partial chunk)
# and not (two), W = chunk (no band), a band of several chunks (the doubling's
# rounds: 1, 2, 3 and 6 chunks), ragged tails, W >= l.
CASES = [(37, 8, 1, 8, False), (37, 8, 3, 13, True), (61, 8, 1, 24, True), (61, 8, 3, 32, False),
         (70, 8, 1, 60, True), (50, 16, 3, 40, True), (30, 8, 1, 64, True)]


@pytest.mark.parametrize("l,q,g,w,docs", CASES)
def test_windowed_matches_direct_sum(l, q, g, w, docs):
  x, dt, A, B, C, D, _ = ssd_inputs(l + w, 2, l, 6, 4, g, 5, jnp.float32)
  seq = packed_ids(l, 2, l) if docs else None
  y, final = chunked(x, dt, A, B, C, q, D=D, seq_idx=seq, window=w)
  with jax.enable_x64(True):
    y_ref, f_ref = direct_window(*f64(x, dt, A, B, C, D), w, seq)
  assert y.dtype == jnp.float32
  assert rel(y, y_ref) < 1e-5
  assert rel(final, f_ref) < 1e-5


def test_windowed_float64_is_exact_and_forms_agree():
  with jax.enable_x64(True):
    x, dt, A, B, C, D, _ = ssd_inputs(2, 2, 45, 6, 3, 3, 5, jnp.float64)
    seq = packed_ids(5, 2, 45)
    y_ref, f_ref = direct_window(x, dt, A, B, C, D, 20, seq)
    for form in ("scan", "parallel"):
      y, final = chunked(x, dt, A, B, C, 8, D=D, seq_idx=seq, window=20, form=form)
      assert rel(y, y_ref) < 1e-12
      assert rel(final, f_ref) < 1e-12


def test_window_at_least_the_length_is_the_exact_ssd():
  x, dt, A, B, C, D, _ = ssd_inputs(3, 2, 40, 4, 4, 1, 6, jnp.float32)
  seq = packed_ids(4, 2, 40)
  y0, s0 = chunked(x, dt, A, B, C, 8, D=D, seq_idx=seq)
  for w in (40, 64):
    y, s = chunked(x, dt, A, B, C, 8, D=D, seq_idx=seq, window=w)
    assert rel(y, y0) < 1e-6
    assert rel(s, s0) < 1e-6


@pytest.mark.parametrize("l,q,g,w", [(45, 8, 3, 20), (40, 8, 1, 16)])
def test_windowed_gradients_match_direct_sum(l, q, g, w):
  x, dt, A, B, C, D, _ = ssd_inputs(l, 2, l, 6, 3, g, 5, jnp.float32)
  seq = packed_ids(l + 1, 2, l)
  wy = jax.random.normal(jax.random.PRNGKey(9), x.shape)
  ws = jax.random.normal(jax.random.PRNGKey(10), (2, 6, 3, 5))

  def loss(fn, x, dt, A, B, C, D):
    y, s = fn(x, dt, A, B, C, D)
    return jnp.sum(y * wy.astype(y.dtype)) + jnp.sum(s * ws.astype(s.dtype))

  args = (x, dt, A, B, C, D)
  win = lambda *a: ssd.ssd_chunked(*a[:5], q, D=a[5], seq_idx=seq, window=w)
  g32 = jax.jit(jax.grad(lambda *a: loss(win, *a), argnums=tuple(range(6))))(*args)
  with jax.enable_x64(True):
    ref = lambda *a: direct_window(*a, w, seq)
    g64 = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=tuple(range(6))))(*f64(*args))
  for name, a, b in zip("x dt A B C D".split(), g32, g64):
    assert np.all(np.isfinite(np.asarray(a))), name
    assert rel(a, b) < 1e-5, name


def test_window_refusals():
  x, dt, A, B, C, D, h0 = ssd_inputs(1, 1, 16, 2, 2, 1, 2, jnp.float32)
  with pytest.raises(ValueError, match="at least the chunk"):
    ssd.ssd_chunked(x, dt, A, B, C, 8, window=4)
  with pytest.raises(ValueError, match="no initial_state"):
    ssd.ssd_chunked(x, dt, A, B, C, 8, window=8, initial_state=h0)



def test_config_and_runtime_with_a_window():
  from mamba_train import Mamba2Config, Runtime
  with pytest.raises(ValueError, match=r"ssd_window \(32\) must be at least chunk_size \(64\)"):
    Mamba2Config(chunk_size=64, ssd_window=32)
  with pytest.raises(ValueError, match="ssd_window must be 0"):
    Mamba2Config(ssd_window=-1)
  # An architecture field: a checkpoint's differs; a run may learn it from an exact init_from.
  assert Mamba2Config(ssd_window=256).weight_differences(Mamba2Config()) == {"ssd_window": (256, 0)}
  assert Mamba2Config(ssd_window=256).weight_differences(Mamba2Config(), init=False) == {}
  # The fused kernels have no window: a windowed model runs XLA's form on TPU too.
  rt = Runtime().resolve("tpu")
  assert rt.ssd_plan(256)[0] == "mosaic"
  assert rt.ssd_plan(256, 1024) == ("parallel", rt.parallel_chunk_size)
  assert Runtime().resolve("cpu").ssd_plan(256, 1024) == ("scan", 64)


# ---------------------------------------------------------------------------
# The model: cached decoding, checkpoints and exports.


def window_model(window=12, **kw):
  from mamba_train import config_for

  from helpers import random_model
  cfg = config_for("tiny", d_model=32, n_layer=2, d_state=16, headdim=16, chunk_size=8,
                   vocab_size=64, ssd_window=window, **kw)
  return random_model(cfg, np.random.default_rng(0))


def test_cached_decoding_matches_the_full_forward():
  """A prompt longer than the window (W = 12, not a multiple of the chunk 8), one
  row left-padded: prefill and steps give the full forward's logits at each
  position, and greedy tokens are the full forward's argmax."""
  from flax import nnx

  from mamba_train.generation import prefill, step
  model = window_model()
  graphdef, params = nnx.split(model)
  prompt, new = 30, 8
  ids = np.random.default_rng(1).integers(0, 64, (2, prompt)).astype(np.int32)
  mask = np.ones((2, prompt), bool)
  mask[1, :5] = False  # left padding
  pre = jax.jit(lambda p, ids, mask: prefill(nnx.merge(graphdef, p), ids, mask))
  stp = jax.jit(lambda p, tok, cache: step(nnx.merge(graphdef, p), tok, cache))
  logits, cache = pre(params, ids, mask)
  assert cache.ssm is None and cache.win_x.shape == (2, 2, 12, 4, 16)
  seen, tokens = [logits], []
  for _ in range(new):
    tok = jnp.argmax(seen[-1], -1).astype(jnp.int32)
    tokens.append(tok)
    logits, cache = stp(params, tok, cache)
    seen.append(logits)
  full_ids = np.concatenate([ids, np.stack(tokens, 1)], 1)
  full_mask = np.concatenate([mask, np.ones((2, new), bool)], 1)

  def forward(p, ids, mask):
    m = nnx.merge(graphdef, p)
    return m.logits(m.backbone(ids, mask=mask)[0])
  full = jax.jit(forward)(params, full_ids, full_mask)
  cached = jnp.stack(seen, 1)  # logits after positions prompt-1 .. prompt+new-1
  assert rel(cached, full[:, prompt - 1:]) < 1e-5
  assert np.array_equal(np.asarray(jnp.argmax(full[:, prompt - 1:-1], -1)), np.stack(tokens, 1))
  # The on-device decode loop, on prompts it left-pads to its own length: padding adds
  # nothing (x = 0, dt = 0) and precedes every valid position, so no window changes.
  from mamba_train.generation import generate
  out = generate(model, [ids[0], ids[1, 5:]], new, eos_id=None)
  assert np.array_equal(np.stack([o[-new:] for o in out]), np.stack(tokens, 1))
  # The window changes the function: the exact model's logits differ.
  exact = window_model(window=0)
  logits_of = lambda m: jax.jit(lambda ids: m(ids))(full_ids)  # jitted: eagerly each op is a compile
  assert rel(logits_of(exact), logits_of(model)) > 1e-4


def test_window_cache_size_is_per_position():
  from mamba_train.model.cache import Mamba2Cache
  cfg = window_model(window=16).config
  per = Mamba2Cache.window_bytes_per_position(cfg, 3)
  assert per == 2 * 3 * 4 * (4 * 16 + 16 + 4)
  assert (Mamba2Cache.bytes_for(cfg, 3) - Mamba2Cache.bytes_for(cfg.replace(ssd_window=8), 3)
          == 8 * per)
  assert Mamba2Cache.window_bytes_per_position(cfg.replace(ssd_window=0), 3) == 0


def test_export_refuses_a_window(tmp_path):
  from mamba_train.interop.export import NotExpressibleError, save_hf, save_mamba_ssm
  model = window_model(window=16)
  for save, fmt in ((save_hf, "transformers"), (save_mamba_ssm, "mamba_ssm")):
    with pytest.raises(NotExpressibleError, match=f"ssd_window=16 as {fmt}"):
      save(model, tmp_path / fmt)
    assert not (tmp_path / fmt).exists()


@pytest.fixture(scope="module")
def windowed_run(tmp_path_factory):
  """A 2-step train.py run of a windowed model (W = 32 < seq_len 64), and a small
  prepared byte-level data set with a validation split."""
  from mamba_train import data

  from helpers import run_train
  work = tmp_path_factory.mktemp("windowed") / "w"
  r = run_train(work, "--config.model.ssd_window=32", "--config.seq_len=64", "--config.steps=2",
                "--config.checkpoint_every=2")
  assert r.returncode == 0, r.stderr[-3000:]
  root = tmp_path_factory.mktemp("data")
  rng = np.random.default_rng(0)
  docs = ["".join(rng.choice(list("abcdefgh "), 400)) for _ in range(8)]
  with open(root / "docs.jsonl", "w") as f:
    f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
  return work, data.prepare_dataset(str(root / "docs.jsonl"), "val", root=str(root), val_fraction=0.5)


def test_window_mismatch_is_refused(windowed_run, tmp_path):
  """A windowed checkpoint does not load or resume as an exact model, nor an exact
  model as a windowed one: the window is part of the architecture."""
  from mamba_train import load_model
  from mamba_train.interop.export import save_hf

  from helpers import run_train
  work, _ = windowed_run
  assert load_model(work).config.ssd_window == 32
  with pytest.raises(ValueError, match="ssd_window"):
    load_model(work, ssd_window=0)
  r = run_train(work, "--config.seq_len=64", "--config.steps=4")  # the exact model: ssd_window 0
  assert r.returncode != 0
  assert "holds checkpoints of another model" in r.stderr and "'ssd_window': (32, 0)" in r.stderr
  save_hf(window_model(window=0), tmp_path / "hf")
  with pytest.raises(ValueError, match="ssd_window"):
    load_model(tmp_path / "hf", ssd_window=16)


def test_window_search_script(windowed_run, tmp_path):
  import subprocess

  from helpers import ROOT, script_env
  work, data_dir = windowed_run
  out = tmp_path / "report.json"
  cmd = [sys.executable, str(ROOT / "scripts" / "window_search.py"), f"--model={work}",
         f"--data={data_dir}", "--seq_len=64", "--batch_size=2", "--batches=2", "--windows=32,16",
         "--tolerance=10", f"--out={out}"]
  r = subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  rep = json.loads(out.read_text())
  assert rep["tokens"] == 2 * 2 * 64 and np.isfinite(rep["exact"])
  assert sorted(rep["overall"]) == ["16", "32"] and len(rep["per_layer"]) == 2
  # Every candidate is within 10 nats: the smallest is reported, overall and per layer.
  assert rep["smallest_overall"] == 16 and rep["smallest_per_layer"] == [16, 16]
  assert "smallest W" in r.stdout
  bad = subprocess.run(cmd[:-3] + ["--windows=8"], cwd=ROOT, env=script_env(), capture_output=True,
                       text=True, timeout=300)
  assert bad.returncode == 2 and "shorter than the model's chunk_size (16)" in bad.stderr


# ---------------------------------------------------------------------------
# 8 simulated devices against one: slices shorter than the window (each takes the
# tails of two neighbours) and at least as long (its left neighbour's alone).

SPLITS = {"seq8_l128": ({"sequence": 8}, 128), "s4d2_l128": ({"sequence": 4, "data": 2}, 128),
          "s4d2_l96": ({"sequence": 4, "data": 2}, 96)}


def _split_worker(out_dir):
  from mamba_train import Mamba2LM
  from mamba_train.parallel import sharding
  from mamba_train.parallel.mesh import make_mesh
  assert jax.device_count() == 8
  model = window_model(window=24)
  cfg, rt = model.config, model.runtime
  params = model.params()
  rng = np.random.default_rng(0)

  def f(params, ids, seq, weights):
    return jnp.sum(Mamba2LM.from_params(cfg, params, rt)(ids, seq_idx=seq) * weights)
  # The inputs as arguments, one set a length: the meshes of one length share the
  # one-device reference (one compile and run a length, not one a mesh).
  ref = jax.jit(jax.value_and_grad(f))
  inputs, refs, out = {}, {}, {}
  for name, (mesh_cfg, l) in SPLITS.items():
    if l not in inputs:
      seq = np.zeros((2, l), np.int32)
      seq[0, 30:] += 1  # a document starting inside a slice's window reach
      seq[1, 64:] += 1  # and on a device edge
      inputs[l] = (jnp.asarray(rng.integers(0, 64, (2, l)), jnp.int32), jnp.asarray(seq),
                   jnp.asarray(rng.normal(size=(2, l, 64)), jnp.float32))
      refs[l] = ref(params, *inputs[l])
    ref_loss, ref_grads = refs[l]
    mesh = make_mesh(mesh_cfg)

    def sharded(params, ids, seq, weights, mesh=mesh):
      with sharding.use_rules(mesh):
        return jax.value_and_grad(f)(params, ids, seq, weights)
    loss, grads = jax.jit(sharded)(params, *inputs[l])
    out[name] = {"loss": [float(loss), float(ref_loss)],
                 "grads": max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
                              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))}
  with open(os.path.join(out_dir, "results.json"), "w") as fh:
    json.dump(out, fh)


def test_split_sequence_with_window_equals_one_device(on_simulated_devices, tmp_path):
  results = on_simulated_devices(os.path.abspath(__file__), tmp_path)
  assert sorted(results) == sorted(SPLITS)
  for name, r in results.items():
    got, want = r["loss"]
    assert abs(got - want) <= 1e-5 * abs(want), name
    assert r["grads"] < 1e-5, name


if __name__ == "__main__":
  from mamba_train.xla_flags import apply_cpu_defaults
  apply_cpu_defaults()
  _split_worker(sys.argv[1])
