"""The README and the guides under docs/ say what runs: every fenced bash and python block
runs here, unless the line before its fence says why it cannot
(`<!-- not runnable here: REASON -->`); every relative link resolves; the configuration
reference is its generator's output; every `train.py` command names a real config file and
real config keys. docs/testing.md ("The documentation runs") says how the blocks run.

The blocks run in order (README first) in one scratch directory, so a later block uses what
an earlier one made; `train.py` gets tiny shapes appended (TINY, SMALL_MODEL) where the command
does not set those keys, which keeps the file near a minute of CPU."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FAST_XLA, ROOT, log_tail

# The guides in reading order; any other docs/*.md runs after them, sorted.
ORDER = ("training", "data", "finetuning", "evaluation", "interop", "models", "multihost",
         "long-context", "performance", "reliability", "configuration", "testing", "layout")
# Guides other sessions are writing: the README's map may link them before they exist.
EXPECTED_GUIDES = {"mamba3.md", "mamba3-interop.md", "observability.md", "gguf.md"}
# What the documentation test appends to each `python train.py` (docs/testing.md).
TINY = ["--config.steps=2", "--config.seq_len=32", "--config.batch_size=2", "--config.log_every=1",
        "--config.eval_every=0", "--config.checkpoint_every=2", "--config.wandb.mode=disabled"]
SMALL_MODEL = ["--config.model.d_model=64", "--config.model.n_layer=2", "--config.model.d_state=16",
               "--config.model.headdim=16", "--config.model.chunk_size=16"]
MARK = re.compile(r"^<!-- not runnable here: (.*\S.*) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")


def doc_files() -> list[Path]:
  docs = {p.stem: p for p in (ROOT / "docs").glob("*.md")}
  ordered = [docs.pop(name) for name in ORDER if name in docs]
  return [ROOT / "README.md", *ordered, *sorted(docs.values())]


def blocks() -> list[dict]:
  """Every fenced bash / python block: file, line, language, code, and the reason it does
  not run (None: it runs)."""
  out = []
  for path in doc_files():
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
      m = FENCE.match(lines[i])
      if not m:
        i += 1
        continue
      end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
      if m.group(1) in ("bash", "python"):
        mark = MARK.match(lines[i - 1].strip()) if i else None
        out.append(dict(file=path.relative_to(ROOT).as_posix(), line=i + 1, lang=m.group(1),
                        code="\n".join(lines[i + 1:end]) + "\n", reason=mark.group(1) if mark else None,
                        marked="not runnable here" in (lines[i - 1] if i else "")))
      i = end + 1
  return out


BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if b["reason"] is None]


def test_every_block_either_runs_or_says_why_not():
  """A marker names its reason; the README's set-up commands stay as CI runs them."""
  assert [b for b in BLOCKS if b["marked"] and not b["reason"]] == []
  assert len(RUNNABLE) >= 8, [(b["file"], b["line"]) for b in RUNNABLE]
  readme = (ROOT / "README.md").read_text()
  ci = (ROOT / ".ci" / "run").read_text()
  for command in ('pip install -e ".[test]" -c constraints.txt', "python -m pytest"):
    assert command in readme and f"\n{command}\n" in ci, command


# ---------------------------------------------------------------------------
# Links and the generated reference: cheap.

LINK = re.compile(r"\]\(([^)\s]+)\)")


def slugs(md: Path) -> set[str]:
  """GitHub's anchors of a markdown file's headings."""
  out = set()
  for line in md.read_text().splitlines():
    if line.startswith("#"):
      title = line.lstrip("#").strip().lower().replace("`", "")
      out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
  return out


def test_every_relative_link_resolves():
  bad = []
  for path in doc_files():
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in LINK.findall(text):
      if re.match(r"[a-z]+:", target):
        continue
      file, _, anchor = target.partition("#")
      dest = (path.parent / file).resolve() if file else path
      if not dest.exists():
        if dest.parent == ROOT / "docs" and dest.name in EXPECTED_GUIDES:
          continue
        bad.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
      elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
        bad.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
  assert bad == []


def test_configuration_reference_is_the_generators_output():
  from configs import base
  from mamba_train.tools import config_reference
  want = config_reference.markdown(base.get_config(), Path(base.__file__).read_text())
  got = (ROOT / "docs" / "configuration.md").read_text()
  assert got == want, "docs/configuration.md is out of date: run python scripts/gen_config_reference.py"
  # Every key, at its default, is in it: the generator walks the config itself.
  for key, value in base.get_config().items():
    for sub in (value.keys() if hasattr(value, "keys") else [None]):
      assert f"| `{key}{'.' + sub if sub else ''}` |" in got, (key, sub)


def _train_commands():
  """(file, line, config file, [--config.* keys]) of every `python train.py` command in a
  shell block, marked or not."""
  for b in BLOCKS:
    if b["lang"] != "bash":
      continue
    for command in b["code"].replace("\\\n", " ").splitlines():
      words = shlex.split(command, comments=True)
      if "train.py" not in words:
        continue
      args = words[words.index("train.py") + 1:]
      args = args[:next((i for i, w in enumerate(args) if w in ("&", ";", "&&", "done")), len(args))]
      config = "configs/tiny.py"
      for i, w in enumerate(args):
        if w == "--config":
          config = args[i + 1]
        elif w.startswith("--config="):
          config = w.split("=", 1)[1]
      keys = [w.split("=", 1)[0][len("--config."):] for w in args if w.startswith("--config.")]
      yield b["file"], b["line"], config, keys


def test_train_commands_name_real_configs_and_keys():
  commands = list(_train_commands())
  assert len(commands) >= 15
  loaded, bad = {}, []
  for file, line, config, keys in commands:
    if config not in loaded:
      if not (config.startswith("configs/") and (ROOT / config).exists()):
        bad.append(f"{file}:{line}: no run config {config}")
        continue
      spec = importlib.util.spec_from_file_location(f"docs_config_{len(loaded)}", ROOT / "configs" / Path(config).name)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      loaded[config] = module.get_config()
    for key in keys:
      node = loaded[config]
      for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
          bad.append(f"{file}:{line}: {config} has no key {key}")
          break
        node = node[part]
  assert bad == []


def test_scripts_the_docs_name_exist():
  named = {m for b in BLOCKS for m in re.findall(r"\bscripts/[\w.]+", b["code"])}
  assert named and [s for s in named if not (ROOT / s).exists()] == []


# ---------------------------------------------------------------------------
# The blocks themselves.

SHIM = """#!{python}
# `python` for the documentation's blocks: train.py gets tiny shapes (tests/test_docs.py).
import os, sys
args = sys.argv[1:]
if args and os.path.basename(args[0]) == "train.py":
  given = {{a.split("=", 1)[0] for a in args}}
  extra = {tiny!r} + ([] if any(a.startswith("--config.init_from") for a in args) else {small!r})
  args += [f for f in extra if f.split("=", 1)[0] not in given]
os.execv({python!r}, [{python!r}, *args])
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
  """A scratch directory that looks like the repository root to the docs' commands."""
  ws = tmp_path_factory.mktemp("docs")
  for name in ("train.py", "configs", "scripts", "mamba_train", "benchmarks", "tests"):
    (ws / name).symlink_to(ROOT / name)
  (ws / "bin").mkdir()
  shim = ws / "bin" / "python"
  shim.write_text(SHIM.format(python=sys.executable, tiny=TINY, small=SMALL_MODEL))
  shim.chmod(0o755)
  # docs/data.md prepares corpus/*.jsonl: a few documents of text.
  (ws / "corpus").mkdir()
  import json
  text = (ROOT / "mamba_train" / "model" / "config.py").read_text()
  for part in range(2):
    with open(ws / "corpus" / f"part-{part}.jsonl", "w") as f:
      for i in range(20):
        f.write(json.dumps({"text": text[(part * 20 + i) * 300:(part * 20 + i + 1) * 300]}) + "\n")
  return ws


NAMESPACES: dict[str, dict] = {}


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{b['file']}:{b['line']}" for b in RUNNABLE])
def test_block_runs(block, workspace, monkeypatch):
  if block["lang"] == "bash":
    env = dict(os.environ, PATH=f"{workspace / 'bin'}:{os.environ['PATH']}", PYTHONPATH=str(ROOT),
               JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    r = subprocess.run(["bash", "-e", "-c", block["code"]], cwd=workspace, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{block['file']}:{block['line']}\n{log_tail(r.stdout + r.stderr)}"
  else:
    monkeypatch.chdir(workspace)
    namespace = NAMESPACES.setdefault(block["file"], {"__name__": "__docs__"})
    exec(compile(block["code"], f"{block['file']}:{block['line']}", "exec"), namespace)  # noqa: S102
