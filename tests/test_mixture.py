"""Weighted mixtures: Grain's mixing by weight, caps, schedules, resume, process counts,
and the refusals that come before any compile."""

import collections
import json
import os
import subprocess
import sys

import datasets
import numpy as np
import pytest

from mamba_train import data
from mamba_train.data import mixture as mixture_lib
from mamba_train.train import run_config

from helpers import FAST_XLA, ROOT, model_flags, orbax_round_trip

SEQ_LEN, BATCH = 16, 8
LETTERS = {"a": "abcdefgh", "b": "ijklmnop", "c": "qrstuvwx"}


def _prepare(root, name, letters, n_docs=12, tokenizer="byte"):
  """Documents drawn from `letters` only, so a row's first byte names its source."""
  rng = np.random.default_rng(len(name) + ord(letters[0]))
  docs = ["".join(rng.choice(list(letters), 63)) for _ in range(n_docs)]
  ds = datasets.Dataset.from_dict({"text": docs})
  return data.prepare_dataset(ds, name, root=str(root), tokenizer=tokenizer, val_fraction=0.2,
                              source_fingerprint=None)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  root = tmp_path_factory.mktemp("mix")
  return {k: _prepare(root, k, v) for k, v in LETTERS.items()}


def _source_of(row):
  return next(k for k, v in LETTERS.items() if chr(row[0]) in v or chr(row[1]) in v)


def _rows(it, n):
  """n batches -> list of (source, full window bytes) per row, in order."""
  out = []
  for _ in range(n):
    b = next(it)
    full = np.concatenate([b["input_ids"], b["targets"][:, -1:]], axis=1)
    out += [(_source_of(r), r.tobytes()) for r in full]
  return out


def test_mixture_weights_cap_and_resume(sources):
  # b is capped at one epoch (7 windows of its train split); a and c go on, c at 0.25.
  spec = f"{sources['a']}:0.5,{sources['b']}:0.25:epochs=1,{sources['c']}:0.25"
  srcs = data.parse_mixture(spec)
  kw = dict(seq_len=SEQ_LEN, global_batch_size=BATCH, seed=3)
  rows = _rows(data.make_mixture_loader(srcs, **kw), 30)
  n_b = (data.read_metadata(sources["b"])["splits"]["train"]["tokens"] - 1) // SEQ_LEN
  counts = collections.Counter(s for s, _ in rows)
  assert counts["b"] == n_b  # every b window once, then no more b
  assert len({r for s, r in rows if s == "b"}) == n_b
  # Until b runs out the shares follow the weights; after, a:c = 2:1.
  last_b = max(i for i, (s, _) in enumerate(rows) if s == "b")
  head = collections.Counter(s for s, _ in rows[:last_b + 1])
  assert abs(head["a"] / (last_b + 1) - 0.5) < 0.1 and abs(head["c"] / (last_b + 1) - 0.25) < 0.1
  tail = collections.Counter(s for s, _ in rows[last_b + 1:])
  assert abs(tail["a"] / sum(tail.values()) - 2 / 3) < 0.05
  # Source a (index 0, the run's seed) reads exactly as it does alone: b ending changes nothing.
  alone = _rows(data.make_train_loader(sources["a"], **kw), 30)
  a_rows = [r for s, r in rows if s == "a"]
  assert a_rows == [r for _, r in alone[:len(a_rows)]]
  # Batches carry the global rows per source; they add up to the counts above.
  it = data.make_mixture_loader(srcs, **kw)
  share = data.SourceShare([s.name for s in srcs], SEQ_LEN)
  for _ in range(30):
    share.add(next(it))
  got = share.read()
  assert got == {f"data/share/{k}": counts[k] / len(rows) for k in "abc"}
  # Resume from the iterator state (past b's end) reproduces the rest, row for row.
  state = it.get_state()
  it.set_state(data.make_mixture_loader(srcs, **kw).get_state())  # rewind to the start
  assert _rows(it, 30) == rows
  fresh = data.make_mixture_loader(srcs, **kw)
  fresh.set_state(state)
  more = _rows(data.make_mixture_loader(srcs, **kw), 34)[30 * BATCH:]
  assert _rows(fresh, 4) == more


def test_mixture_resumes_through_orbax_after_a_source_ended(sources, tmp_path):
  """The checkpoint train.py writes (Grain's handler in an Orbax Composite), across a
  schedule change and a capped source's end; the pipeline also pickles for workers."""
  import pickle
  srcs = data.parse_mixture(f"{sources['a']}:1,{sources['b']}:1:epochs=0.5,{sources['c']}:0")
  kw = dict(seq_len=SEQ_LEN, global_batch_size=BATCH, seed=1,
            schedule=data.parse_schedule("2:1,1,1", 3))
  reference = _rows(data.make_mixture_loader(srcs, **kw), 8)
  it = data.make_mixture_loader(srcs, **kw)
  _rows(it, 5)
  fresh = data.make_mixture_loader(srcs, **kw)
  orbax_round_trip(it, fresh, tmp_path / "ckpt")
  assert _rows(fresh, 3) == reference[5 * BATCH:]
  assert {s for s, _ in reference[:2 * BATCH]} == {"a", "b"}  # c joins at step 2
  assert {s for s, _ in reference[2 * BATCH:]} >= {"a", "c"}
  n_b = (data.read_metadata(sources["b"])["splits"]["train"]["tokens"] - 1) // SEQ_LEN
  assert sum(s == "b" for s, _ in reference) == int(0.5 * n_b)
  m = mixture_lib.MixtureMap([mixture_lib.INFINITE, 3], [(0, [1, 1])])
  assert [pickle.loads(pickle.dumps(m))[j] for j in range(10)] == [m[j] for j in range(10)]


def test_mixture_same_rows_for_any_process_count_and_schedule(sources):
  srcs = data.parse_mixture(f"{sources['a']}:1,{sources['b']}:1")
  schedule = data.parse_schedule("5:0,1", 2)  # only b after step 5
  kw = dict(seq_len=SEQ_LEN, global_batch_size=BATCH, seed=7, schedule=schedule)
  one = _rows(data.make_mixture_loader(srcs, **kw), 10)
  halves = [_rows(data.make_mixture_loader(srcs, process_index=p, process_count=2, **kw), 10)
            for p in range(2)]
  two = [r for step in range(10) for p in range(2)
         for r in halves[p][step * BATCH // 2:(step + 1) * BATCH // 2]]
  assert two == one
  before = collections.Counter(s for s, _ in one[:5 * BATCH])
  assert before == {"a": 20, "b": 20}
  assert {s for s, _ in one[5 * BATCH:]} == {"b"}
  # b continues its own order across the change: no b window repeats within its epoch.
  b_rows = [r for s, r in one if s == "b"]
  n_b = (data.read_metadata(sources["b"])["splits"]["train"]["tokens"] - 1) // SEQ_LEN
  assert len(set(b_rows[:n_b])) == n_b


def test_mixture_map_is_grains_mix_within_a_phase():
  """One phase is exactly Grain's MapDataset.mix of the sources' rows."""
  m = mixture_lib.MixtureMap([mixture_lib.INFINITE] * 2, [(0, [0.7, 0.3])])
  import grain
  ref = grain.MapDataset.mix([grain.MapDataset.range(10**6).map(lambda k: (0, k)),
                              grain.MapDataset.range(10**6).map(lambda k: (1, k))], [0.7, 0.3])
  assert [m[j] for j in range(200)] == [ref[j] for j in range(200)]


@pytest.mark.parametrize("spec, message", [
    ("{a}:-1,{b}:1", "weight must be >= 0"),
    ("{a}:0,{b}:0", "sum to zero"),
    ("{a}:1:epochs=1,{b}:1:tokens=100", "every source is capped"),
    ("{a}:1:epoch=2", "unknown option"),
    ("{a}", "has no weight"),
])
def test_bad_mixture_specs_refused_by_validate(sources, spec, message):
  from configs import tiny
  c = tiny.get_config()
  c.data.mixture = spec.format(**sources)
  with pytest.raises(run_config.ConfigError, match=message):
    run_config.validate(c, num_devices=1)


def test_missing_source_and_other_tokenizer_refused_before_compile(sources, tmp_path):
  from configs import tiny
  from mamba_train.train import inputs

  def make_loaders(c):
    plan = run_config.validate(c, num_devices=1)
    return inputs.make_loaders(plan, inputs.data_sources(plan))

  c = tiny.get_config()
  c.data.mixture = f"{sources['a']}:1,{tmp_path}/nope:1"
  with pytest.raises(run_config.ConfigError, match="nope.*does not exist"):
    make_loaders(c)
  # Same bytes, but a tokenizer with an extra token: other ids, so refused by name.
  from mamba_train.data import tokenizer as tokenizer_lib
  tok = tokenizer_lib.byte_tokenizer()
  tok.add_special_tokens(["<|pad|>"])
  tok.save(str(tmp_path / "other.json"))
  other = _prepare(tmp_path, "other", LETTERS["c"], tokenizer=str(tmp_path / "other.json"))
  c.model.vocab_size = 258
  c.data.mixture = f"{sources['a']}:1,{other}:1"
  with pytest.raises(run_config.ConfigError, match="other.*tokenized with"):
    make_loaders(c)


def test_mixture_run_logs_share_and_eval_per_source(tmp_path):
  """train.py on a two-source mixture: realised token share and eval loss per source."""
  a, b = (_prepare(tmp_path, k, LETTERS[k], n_docs=40) for k in "ab")
  small = [*model_flags(n_layer=1), "--config.seq_len=32", "--config.batch_size=8",
           "--config.optim.lr=1e-2", "--config.eval_batches=2"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_SILENT": "true",
         "XLA_FLAGS": FAST_XLA}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "train.py"), "--workdir", str(tmp_path / "run"), *small,
       "--config.data.source=corpus", f"--config.data.mixture={a}:0.75,{b}:0.25",
       "--config.model.vocab_size=257", "--config.steps=8", "--config.eval_every=8",
       "--config.log_every=8", "--config.wandb.mode=disabled"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  merged = {k: v for r in rows for k, v in r.items()}
  # 8 steps x 8 rows at weights 3:1, in Grain's interleave.
  assert merged["data/share/a"] == pytest.approx(0.75, abs=1 / 64)
  assert merged["data/share/a"] + merged["data/share/b"] == pytest.approx(1.0)
  pooled = (merged["eval_loss/a"] * merged["eval_tokens/a"] + merged["eval_loss/b"]
            * merged["eval_tokens/b"]) / (merged["eval_tokens/a"] + merged["eval_tokens/b"])
  assert merged["eval_loss"] == pytest.approx(pooled)
