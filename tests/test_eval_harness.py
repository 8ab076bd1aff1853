"""lm-evaluation-harness on our model, offline, with the tiny local tasks of
tests/data/harness: the same per-sample scores and generations as lm-eval's own `hf`
backend running the exported transformers weights (also from the training hook in a
two-process job), stop sequences matched on the device, lm-eval's batch sizes, and
the script's files and errors, and the script in a two-process job.

Cost: one random model, one hf-backend run and one run of ours per module (fixtures),
whose compiled programs the later tests reuse; the script and the two-process hook
run as subprocesses started at the top, in parallel with the in-process tests."""

import glob
import json
import os
import subprocess
import sys
import textwrap
from unittest import mock

import numpy as np
import pytest

from helpers import ROOT, SMALL_MODEL, free_port, random_model

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

TASKS = os.path.join(ROOT, "tests", "data", "harness")
NAMES = ["tiny_mc", "tiny_ppl", "tiny_gen"]
# A one-layer model (small shapes compile fast; lm-eval's torch run is quick); at seed 2
# it answers every prompt with " K K K...", which tiny_gen.yaml's "K K" stops.
SMALL = dict(SMALL_MODEL, n_layer=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A random byte-level model exported for transformers, and the local tasks with
  their data path made absolute."""
  from mamba_train import config_for
  from mamba_train.data import tokenizer as tokenizer_lib
  from mamba_train.interop.export import save_hf
  tmp = tmp_path_factory.mktemp("harness")
  os.environ["HF_DATASETS_OFFLINE"] = "1"
  tasks = tmp / "tasks"
  tasks.mkdir()
  for f in glob.glob(os.path.join(TASKS, "*.yaml")):
    text = open(f).read().replace("tests/data/harness/tiny.jsonl", os.path.join(TASKS, "tiny.jsonl"))
    (tasks / os.path.basename(f)).write_text(text)
  model = random_model(config_for("tiny", vocab_size=257, **SMALL), np.random.default_rng(2))
  tokenizer_lib.byte_tokenizer().save(str(tmp / "tokenizer.json"))
  hf = save_hf(model, tmp / "hf", tokenizer_file=tmp / "tokenizer.json",
               eos_token=tokenizer_lib.EOS_TOKEN, eos_token_id=256)
  return model, str(hf), str(tasks), tmp


# The trainer's harness hook in a two-process job (one CPU device each, the parameters
# split over both by fsdp): every process runs it, process 0 writes.
_HOOK_WORKER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from mamba_train.parallel import distributed
    distributed.initialize("127.0.0.1:{port}", 2, int(sys.argv[1]), init_timeout=120)
    import jax
    from configs import tiny
    from mamba_train.workdir import record
    from mamba_train.parallel.mesh import make_mesh
    from mamba_train.train import hooks, loop, run_config, session, step as steps
    c = tiny.get_config()
    c.model.update({small!r})
    c.mesh.update(dcn_fsdp=2, data=1, fsdp=1)
    c.harness.update(tasks={tasks!r}, every=1, include_path={include!r}, batch_size="auto",
                     max_batch_size=8)
    plan = run_config.validate(c, num_devices=jax.device_count(), process_count=2)
    state = steps.build(plan, make_mesh(c.mesh, shape=plan.mesh_shape),
                        params=session.load_init_params({hf!r}, plan.model)).state
    assert not state.params["embedding"].is_fully_addressable  # split over the processes
    run = loop.make_harness(plan, os.path.join({hf!r}, "tokenizer.json"))
    writer = record.MetricsWriter({out!r}, wandb_cfg={{"mode": "disabled"}}, run_config={{}},
                                  is_main=jax.process_index() == 0)
    run(7, state.params, writer, hooks.Throughput())
    writer.close()
""")


@pytest.fixture(scope="module")
def background(setup):
  """The eval script and the two-process hook, started once: they run while the
  in-process tests do. -> {name: (process(es), log paths, output dir)}."""
  _, hf, tasks, tmp = setup
  # The suite's XLA flags (tests/conftest.py) and compilation cache, one CPU device each.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}

  def start(args, log):
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True)

  script = [os.path.join(ROOT, "scripts", "eval.py"), "--model", hf, "--include_path", tasks,
            "--limit", "3", "--batch_size", "auto:2", "--max_batch_size", "4", "--tasks", "tiny_mc",
            "--log_samples", "--output_path", str(tmp / "out"), "--num_fewshot", "1"]
  worker = _HOOK_WORKER.format(root=str(ROOT), port=free_port(), small=SMALL, tasks="tiny_ppl,tiny_gen",
                               include=tasks, hf=hf, out=str(tmp / "two"))
  os.makedirs(tmp / "two")
  # The same evaluation in a two-process job: each process scores its share of the rows.
  join = ["--coordinator_address", f"127.0.0.1:{free_port()}", "--num_processes", "2"]
  script2 = [str(tmp / "out2") if a == str(tmp / "out") else a for a in script] + join
  procs = {"script": ([start(script, tmp / "script.log")], [tmp / "script.log"], tmp / "out"),
           "script2": ([start([*script2, "--process_id", str(r)], tmp / f"script2_{r}.log")
                        for r in range(2)], [tmp / f"script2_{r}.log" for r in range(2)], tmp / "out2"),
           "two": ([start(["-c", worker, str(r)], tmp / f"two{r}.log") for r in range(2)],
                   [tmp / f"two{r}.log" for r in range(2)], tmp / "two")}
  yield procs
  for ps, _, _ in procs.values():
    for p in ps:
      if p.poll() is None:
        p.kill()
      p.wait()


def _finish(entry, timeout=600):
  procs, logs, out = entry
  codes = [p.wait(timeout=timeout) for p in procs]
  assert codes == [0] * len(procs), "\n\n".join(open(f).read()[-3000:] for f in logs)
  return out


@pytest.fixture(scope="module")
def theirs(setup):
  """lm-eval's own hf backend on the exported weights, every task."""
  import lm_eval.evaluator  # the submodule: lm_eval imports it lazily

  from mamba_train.interop import eval_harness
  _, hf, tasks, _ = setup
  with mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None):  # runs pip
    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32",
                                   tasks=NAMES, task_manager=eval_harness.task_manager(tasks, NAMES),
                                   device="cpu", batch_size=8, log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module")
def ours(setup):
  from mamba_train.data.tokenizer import load_tokenizer
  from mamba_train.interop import eval_harness
  model, hf, tasks, _ = setup
  # One batch holds all five prompts: one program per width to compile.
  lm = eval_harness.HarnessLM(model, load_tokenizer(os.path.join(hf, "tokenizer.json")), batch_size=8)
  return lm, eval_harness.run_tasks(lm, NAMES, manager=eval_harness.task_manager(tasks, NAMES),
                                    log_samples=True, bootstrap_iters=0, env_info=False)


def _by_doc(samples):
  return {s["doc_id"]: s for s in samples}


def _assert_same_results(flat, theirs, rtol):
  """Our flat harness/<task>/<metric> row against lm-eval's hf results."""
  from mamba_train.interop import eval_harness
  expected = eval_harness.flat_metrics(theirs)  # the same keys, lm-eval's values
  assert sorted(flat) == sorted(expected) and expected
  for key, value in expected.items():
    if "perplexity" in key or "bits_per_byte" in key:
      np.testing.assert_allclose(flat[key], value, rtol=rtol, err_msg=key)
    else:
      assert flat[key] == value, key


def test_same_scores_and_generations_as_lm_evals_hf_backend(background, ours, theirs):
  from mamba_train.interop import eval_harness
  _, ours = ours
  for task in NAMES:
    a, b = _by_doc(ours["samples"][task]), _by_doc(theirs["samples"][task])
    assert sorted(a) == sorted(b) == list(range(5))
    for doc in a:
      assert a[doc]["arguments"] == b[doc]["arguments"]
      ra, rb = a[doc]["filtered_resps"], b[doc]["filtered_resps"]
      if task == "tiny_gen":
        assert ra == rb
      elif task == "tiny_mc":  # [(loglikelihood, is_greedy)] per choice
        np.testing.assert_allclose([float(x[0]) for x in ra], [float(x[0]) for x in rb], rtol=1e-4)
        assert [x[1] for x in ra] == [x[1] for x in rb]
      else:
        np.testing.assert_allclose(float(ra[0]), float(rb[0]), rtol=1e-4)
  # The generations ended at a stop sequence ("K K", three tokens), found on the device.
  assert all(len(_by_doc(ours["samples"]["tiny_gen"])[d]["resps"][0][0]) < 12 for d in range(5))
  _assert_same_results(eval_harness.flat_metrics(ours), theirs, rtol=1e-4)


def test_stop_strings_end_rows_on_the_device(setup):
  """A made-up tokenizer whose tokens are 2 to 4 bytes ("7.", "42.", "256."), so stop
  strings start and end inside tokens: each row ends at the token completing its first
  stop string, with the tokens a run without stops makes up to there, and the loop
  ends when every row has."""
  from mamba_train.generation import generate_with_stats, token_byte_table
  model = setup[0]
  text = [f"{i}.".encode() for i in range(model.config.vocab_size)]
  table = token_byte_table(text)
  prompts = [np.frombuffer(p.encode(), np.uint8).astype(np.int32) for p in
             ("The sky is", "2 + 2 =", "def f(x):", "a", "Once upon a time")]
  run = lambda stops: generate_with_stats(model, prompts, 12, pad_id=0, stop_strings=stops,
                                          token_bytes=table)  # one program: (5, 2, 8) stops
  free, _ = run(["~", "~" * 8])  # never matched: the digits and dots of the tokens only
  free = [row[len(p):] for p, row in zip(prompts, free)]
  assert all(len(row) == 12 for row in free)

  def end(row, stops):  # index of the token that completes the first stop, on the host
    ends = np.cumsum([len(text[t]) for t in row])
    joined = b"".join(text[t] for t in row)
    hits = [joined.find(s) + len(s) for s in stops if s in joined]
    return int(np.searchsorted(ends, min(hits))) if hits else None

  # Per row, 3 to 5 bytes from the middle of its token 1, 2 or 3; then one list for all
  # rows, whose "." every token ends with: all end at their first token, from prefill.
  per_row = []
  for r, row in enumerate(free):
    joined, start = b"".join(text[t] for t in row), sum(len(text[t]) for t in row[:1 + r % 3]) + 1
    per_row.append([joined[start:start + 3 + r % 3], b"~"])
  for stops in (per_row, [b".", b"~" * 8]):
    out, stats = run(stops)
    want = [end(row, stops if isinstance(stops[0], bytes) else row_stops)
            for row, row_stops in zip(free, per_row)]
    assert all(k is not None and k < 11 for k in want)  # every row stops early...
    assert len(set(want)) > 1 if stops is per_row else want == [0] * 5
    width = max(want) + 1  # ...and so does the loop
    assert stats.steps == width and stats.new_tokens == sum(k + 1 for k in want)
    for p, row, ref, k in zip(prompts, out, free, want):
      np.testing.assert_array_equal(row[len(p):], np.r_[ref[:k + 1], np.zeros(width - k - 1, int)])
  # A row whose stop never comes runs to max_new_tokens, the others still end at theirs.
  out, stats = run([per_row[0], ["~", "~~"], *per_row[2:]])
  assert stats.steps == 12 and len(out[1]) == len(prompts[1]) + 12
  np.testing.assert_array_equal(out[0][len(prompts[0]):][:end(free[0], per_row[0]) + 1],
                                free[0][:end(free[0], per_row[0]) + 1])
  assert (out[0][len(prompts[0]) + end(free[0], per_row[0]) + 1:] == 0).all()
  with pytest.raises(ValueError, match="needs token_bytes"):
    generate_with_stats(model, prompts, 4, stop_strings=["."])
  with pytest.raises(ValueError, match="empty stop string"):
    generate_with_stats(model, prompts, 4, stop_strings=[""], token_bytes=table)


def test_token_bytes_join_to_the_decoded_text():
  """ByteLevel BPE: a sequence's bytes are its tokens' bytes (special tokens none);
  a Metaspace tokenizer gets none, so stops are cut on the host only."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

  from mamba_train.data.tokenizer import token_bytes
  texts = ["Tōkyō and Zürich; naïve café.\n", "def add(a, b):\n    return a + b\n", "The sky  is blue."]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts * 5, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.add_tokens([AddedToken("<tab>", special=False)])
  table = token_bytes(tok, 320)
  assert len(table) == 320 and table[tok.token_to_id("<|endoftext|>")] == b"" and table[-1] == b""
  for t in [*texts, "<|endoftext|>x <tab> ō"]:
    ids = tok.encode(t).ids
    assert b"".join(table[i] for i in ids) == tok.decode(ids).encode()
  assert any(len(b) > 3 for b in table)  # merges: multi-byte tokens
  meta = Tokenizer(models.BPE())
  meta.pre_tokenizer, meta.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  assert token_bytes(meta) is None


def test_batch_size_as_lm_eval_reads_it(setup, ours, monkeypatch):
  from mamba_train.interop import eval_harness
  for bad in ("big", "0", "-2", "auto:0", "auto:x", "auto8"):
    with pytest.raises(ValueError, match="as lm-eval reads it"):
      eval_harness.parse_batch_size(bad)
  assert eval_harness.parse_batch_size("auto:3") == ("auto", 3.0)
  assert eval_harness.parse_batch_size(8) == eval_harness.parse_batch_size("8") == (8, 1.0)
  model, hf, tasks, _ = setup
  lm, fixed = ours
  auto = eval_harness.HarnessLM(model, lm.tok, batch_size="auto:2", max_batch_size=8)
  assert eval_harness._free_device_bytes() is None  # the CPU reports no limit: the most allowed
  assert auto.detect_batch_size(32) == 8
  # A device with room for 4 rows of 32 tokens but not 8 (XLA's figures for the program).
  need = {}
  for rows in (4, 8):
    m = eval_harness._scorer(auto._graphdef, auto._params, rows, 32).memory_analysis()
    need[rows] = m.temp_size_in_bytes + m.output_size_in_bytes + rows * 32 * 4
  assert need[4] < need[8]
  monkeypatch.setattr(eval_harness, "_free_device_bytes", lambda: (need[4] + need[8]) // 2)
  assert auto.detect_batch_size(32) == 4
  res = eval_harness.run_tasks(auto, ["tiny_mc"], manager=eval_harness.task_manager(tasks, ["tiny_mc"]),
                               log_samples=True, bootstrap_iters=0, env_info=False)
  assert res["config"]["batch_size"] == "auto:2"
  # Detected at the longest request (question, space, choice: byte tokens) first.
  docs = [json.loads(line) for line in open(os.path.join(TASKS, "tiny.jsonl"))]
  longest = max(len(f"{d['question']} {c}".encode()) for d in docs for c in d["choices"])
  width = eval_harness.round_up_pow2(longest, eval_harness.MIN_WIDTH)
  fits = [r for r in (8, 4, 2, 1) if r == 1 or (lambda m: m.temp_size_in_bytes + m.output_size_in_bytes
          + r * width * 4)(eval_harness._scorer(auto._graphdef, auto._params, r, width)
                            .memory_analysis()) <= (need[4] + need[8]) // 2]
  sizes = res["config"]["batch_sizes"]
  assert len(sizes) == 2 and sizes[0] == fits[0] and sizes[1] in (1, 2, 4, 8)  # auto:2: two slots
  a, b = _by_doc(res["samples"]["tiny_mc"]), _by_doc(fixed["samples"]["tiny_mc"])
  for doc in a:  # the same scores whatever the batch
    np.testing.assert_allclose([float(x[0]) for x in a[doc]["filtered_resps"]],
                               [float(x[0]) for x in b[doc]["filtered_resps"]], rtol=1e-5)


def test_training_hook_logs_task_scores(setup, theirs, tmp_path):
  """The trainer's harness hook on the parity model: it logs what lm-eval's hf backend scores."""
  from configs import tiny
  from mamba_train.train import hooks, loop, run_config
  from mamba_train.workdir import record
  model, hf, tasks, _ = setup
  c = tiny.get_config()
  c.model.update(SMALL)
  c.harness.update(tasks="tiny_mc,tiny_ppl", every=1, include_path=tasks, batch_size="8")
  plan = run_config.validate(c, num_devices=1)
  assert plan.model == model.config
  run = loop.make_harness(plan, os.path.join(hf, "tokenizer.json"))
  writer = record.MetricsWriter(str(tmp_path), wandb_cfg={"mode": "disabled"}, run_config={})
  run(5, model.params(), writer, hooks.Throughput())
  writer.close()
  row = json.loads(open(tmp_path / "metrics.jsonl").read())
  assert row.pop("step") == 5
  _assert_same_results(row, {"results": {t: theirs["results"][t] for t in ("tiny_mc", "tiny_ppl")}},
                       rtol=1e-4)
  c.harness.update(batch_size="many")  # refused before any task is indexed
  with pytest.raises(run_config.ConfigError, match="as lm-eval reads it"):
    loop.make_harness(run_config.validate(c, num_devices=1), os.path.join(hf, "tokenizer.json"))


def test_training_hook_in_a_two_process_job(background, theirs):
  """Both processes run the scoring (rolling loglikelihoods) and generate programs on
  the split parameters; process 0 writes lm-eval's hf scores."""
  out = _finish(background["two"])
  rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert len(rows) == 1 and rows[0].pop("step") == 7
  _assert_same_results(rows[0], {"results": {t: theirs["results"][t] for t in ("tiny_ppl", "tiny_gen")}},
                       rtol=1e-4)


def test_eval_script_writes_lm_evals_files_and_unknown_tasks_are_refused(background, setup):
  _, _, tasks, _ = setup
  out = _finish(background["script"])
  # In a directory named after the model, as lm_eval's command line names it.
  named = out / os.path.abspath(setup[1]).replace("/", "__")
  results = glob.glob(str(named / "results_*.json"))
  samples = glob.glob(str(named / "samples_tiny_mc_*.jsonl"))
  assert len(results) == 1 and len(samples) == 1
  r = json.load(open(results[0]))
  assert r["n-shot"]["tiny_mc"] == 1 and 0 <= r["results"]["tiny_mc"]["acc,none"] <= 1
  # --batch_size auto:2 on a CPU, which states no memory limit: --max_batch_size rows.
  assert r["config"]["batch_size"] == "auto:2" and r["config"]["batch_sizes"] == [4, 4]  # 2 slots
  assert len(open(samples[0]).readlines()) == 3  # --limit 3
  # Unknown names are refused before any weight loads, with what was found (the script
  # calls this; indexing lm-eval's own tasks too would take 20 s here).
  from mamba_train.interop import eval_harness
  with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['tiny_mcq'\].*Found: tiny_gen, tiny_mc, tiny_ppl"):
    eval_harness.check_tasks(["tiny_mc", "tiny_mcq"], eval_harness.task_manager(tasks, ["tiny_mc"]))


def test_eval_script_in_a_two_process_job_scores_as_one(background, setup):
  """Two processes, one device each: each scores its share of every batch's rows, and
  process 0 writes the files, with the single process's results and per-sample scores."""
  one, two = _finish(background["script"]), _finish(background["script2"])
  named = os.path.abspath(setup[1]).replace("/", "__")
  files = {tag: (glob.glob(str(out / named / "results_*.json")),
                 glob.glob(str(out / named / "samples_tiny_mc_*.jsonl"))) for tag, out in
           (("one", one), ("two", two))}
  assert [len(f) for f in files["two"]] == [1, 1], files  # written once, by process 0
  r1, r2 = (json.load(open(files[t][0][0])) for t in ("one", "two"))
  assert r2["results"] == r1["results"] and r2["n-shot"] == r1["n-shot"]
  assert r2["config"]["batch_sizes"] == r1["config"]["batch_sizes"]  # per replica, as lm-eval's
  s1, s2 = ([json.loads(line) for line in open(files[t][1][0])] for t in ("one", "two"))
  assert [s["filtered_resps"] for s in s2] == [s["filtered_resps"] for s in s1]
  logs = [open(f).read() for f in background["script2"][1]]
  assert "n-shot" in logs[0] and "n-shot" not in logs[1]  # lm-eval's table: process 0's only
