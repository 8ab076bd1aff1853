"""The layout's dependency rules (docs: "Which way dependencies run"), read from the
source with `ast`: nothing is imported, except by the one test that checks that
importing the package changes nothing.

Each rule names the modules it governs and says what an import of theirs may not
reach; a failure names the module, the line, the import as written and the rule.
Imports are read wherever they are in a module (inside functions too: a lazy
import is still a dependency), and `from pkg import name` counts as importing
`pkg.name` when that is a module of the package.

The checker itself is tested at the bottom on synthetic sources and on a copy of
the package with violating modules written into it, so a rule that could never
fail would show.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGE = "mamba_train"

# Names that belong to the outside layouts (transformers' Mamba2ForCausalLM and
# mamba_ssm's released checkpoints): their weight names, config keys and file
# names. Only mamba_train/interop/ may hold them. (tokenizer.json is our own
# format; `A_log`, `pad_vocab_size_multiple` and the like are our names too, as
# the config follows mamba_ssm's field names on purpose.)
OUTSIDE_NAMES = (
    "backbone.",  # the prefix of every weight in both layouts
    "lm_head.weight",
    "embeddings.weight",
    "mixer.in_proj",
    "mixer.conv1d",
    "model.safetensors",
    "pytorch_model.bin",
    "ssm_cfg",  # mamba_ssm's config.json
    "hidden_size",  # transformers' config keys from here on
    "num_hidden_layers",
    "tie_word_embeddings",
    "state_size",
    "n_groups",
    "layer_norm_epsilon",
    "time_step_limit",
)

# Top-level modules of the repository that are not the library: entry points,
# run recipes, tools and measurements import the library, never the reverse.
ENTRY_POINTS = ("train", "configs", "scripts", "benchmarks")


# ---------------------------------------------------------------------------
# Reading a module: its imports and its string constants.


@dataclasses.dataclass(frozen=True)
class Import:
  target: str  # absolute dotted name: "mamba_train.model.config", "jax", "train"
  line: int
  text: str  # the statement as written


@dataclasses.dataclass(frozen=True)
class Module:
  name: str  # "mamba_train.ops.ssd"; a package by its own name ("mamba_train.model")
  path: str  # as shown in messages: "mamba_train/ops/ssd.py"
  imports: tuple[Import, ...]
  strings: tuple[tuple[int, str], ...]  # (line, value) of every string constant but docstrings


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
  """The absolute name of `from <level dots><name> import ...` in `module`."""
  parts = module.split(".") if is_package else module.split(".")[:-1]
  if level - 1 >= len(parts):
    # Leaves the top-level package: can only mean a module outside the library.
    return f"<relative import above {PACKAGE}>" + (f".{name}" if name else "")
  base = parts[:len(parts) - (level - 1)]
  return ".".join(base + ([name] if name else []))


def _import_module_call(node: ast.Call) -> str | None:
  """The literal name given to importlib.import_module(...) or __import__(...)."""
  func = node.func
  called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
  if called not in ("import_module", "__import__") or not node.args:
    return None
  arg = node.args[0]
  return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _docstring_nodes(tree: ast.AST) -> set[int]:
  ids = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
          and isinstance(body[0].value.value, str):
        ids.add(id(body[0].value))
  return ids


def read_module(name: str, source: str, *, path: str = "<source>", is_package: bool = False,
                package_modules: frozenset[str] = frozenset()) -> Module:
  """Parse `source` as the module `name`. `package_modules` (every module name of the
  package) tells `from pkg import sub` (a module) from `from pkg import attr`."""
  tree = ast.parse(source, filename=path)
  lines = source.splitlines()
  imports = []

  def add(target, node):
    text = lines[node.lineno - 1].strip() if 0 < node.lineno <= len(lines) else ""
    imports.append(Import(target, node.lineno, text))

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name, node)
    elif isinstance(node, ast.ImportFrom):
      base = (_resolve_relative(name, is_package, node.level, node.module) if node.level
              else node.module)
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        add(sub if sub in package_modules else base, node)
    elif isinstance(node, ast.Call):
      target = _import_module_call(node)
      if target is not None:
        if target.startswith("."):
          level = len(target) - len(target.lstrip("."))
          target = _resolve_relative(name, is_package, level, target.lstrip(".") or None)
        add(target, node)

  docstrings = _docstring_nodes(tree)
  strings = sorted((node.lineno, node.value) for node in ast.walk(tree)
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)
                   and id(node) not in docstrings)
  return Module(name, path, tuple(sorted(imports, key=lambda i: i.line)), tuple(strings))


def read_package(root: Path) -> dict[str, Module]:
  """Every module of the package under `root` (the directory holding mamba_train/)."""
  files = sorted((root / PACKAGE).rglob("*.py"))

  def dotted(f: Path) -> str:
    parts = f.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

  names = frozenset(dotted(f) for f in files)
  return {dotted(f): read_module(dotted(f), f.read_text(), path=str(f.relative_to(root)),
                                 is_package=f.name == "__init__.py", package_modules=names)
          for f in files}


# ---------------------------------------------------------------------------
# The rules.


def within(name: str, prefix: str) -> bool:
  """`name` is the module or package `prefix` or lies inside it."""
  return name == prefix or name.startswith(prefix + ".")


def ours(target: str) -> bool:
  return within(target, PACKAGE)


@dataclasses.dataclass(frozen=True)
class Rule:
  name: str
  says: str  # the rule, as a failure message quotes it
  governs: Callable[[str], bool]  # which modules it applies to, by name
  broken_by: Callable[[str], bool]  # which import targets break it

  def violations(self, module: Module) -> list[str]:
    if not self.governs(module.name):
      return []
    return [f"{module.name} ({module.path}:{imp.line}) imports {imp.target} "
            f"(`{imp.text}`): {self.says}"
            for imp in module.imports if self.broken_by(imp.target)]


# Imports nothing and every layer may raise its errors.
ERRORS_MODULE = f"{PACKAGE}.errors"
_MODEL_MAY_IMPORT = ("mamba_train.model", "mamba_train.ops", "mamba_train.parallel.sharding")
_PARALLEL_KNOWS_NO = tuple(f"{PACKAGE}.{p}" for p in ("model", "train", "data", "interop", "workdir"))

# The plain forms the kernels stand beside (mamba_train/ops/): the SSD's (Mamba-2's and
# Mamba-3's), the layer's elementwise chain, the experts' grouped matmuls, attention.
_MATH = ("mamba_train.ops.ssd", "mamba_train.ops.ssd3", "mamba_train.ops.layer_math",
         "mamba_train.ops.experts", "mamba_train.ops.dispatch", "mamba_train.ops.attention")
# The kernels: what runs in Pallas (or tokamax) instead of XLA's own ops.
_KERNEL_MODULES = ("mamba_train.ops.ssd_tpu", "mamba_train.ops.ssd_gpu", "mamba_train.ops.layer_tpu",
                   "mamba_train.ops.layer_gpu", "mamba_train.ops.decode_tpu", "mamba_train.ops.experts_tpu",
                   "mamba_train.ops.experts_gpu", "mamba_train.ops.attention_tpu", "mamba_train.ops.attention_gpu",
                   "mamba_train.ops.layer_fused_tpu", "mamba_train.ops.layer_fused_gpu",
                   "mamba_train.ops.layer_fused_fwd_tpu", "mamba_train.ops.layer_fused_bwd_tpu",
                   "mamba_train.ops.ssd3_tpu")
# The one place that chooses among them, and the one that defines the runtime's knobs.
TABLE_MODULE = "mamba_train.ops.table"
RUNTIME_MODULE = "mamba_train.model.runtime"

SSD_IS_PURE = Rule(
    "ssd-is-pure", "the plain forms of the operations (the SSDs, layer_math, experts, attention) import "
    "nothing of the package",
    governs=lambda m: m in _MATH,
    broken_by=lambda t: ours(t) or t.startswith("<relative"))
KERNELS = Rule(
    "kernels", "the kernels import nothing of the package but the math they stand beside "
    "(mamba_train.ops.ssd, mamba_train.ops.layer_math) and each other (a fused kernel shares "
    "the per-chunk math of the kernels it joins)",
    governs=lambda m: m in _KERNEL_MODULES,
    broken_by=lambda t: (ours(t) and t not in _MATH and t not in _KERNEL_MODULES) or t.startswith("<relative"))
TABLE = Rule(
    "table", "the selection table imports nothing of the package but the operations",
    governs=lambda m: m == TABLE_MODULE,
    broken_by=lambda t: (ours(t) and not within(t, "mamba_train.ops")) or t.startswith("<relative"))
ONLY_TABLE_IMPORTS_KERNELS = Rule(
    "only-the-table-imports-kernels", "only the selection table (mamba_train.ops.table) imports a kernel "
    "module: the model calls what it chose",
    governs=lambda m: ours(m) and m not in _KERNEL_MODULES and m != TABLE_MODULE,
    broken_by=lambda t: t in _KERNEL_MODULES)
MODEL = Rule(
    "model", "the model knows no trainer, data, workdir, metrics, generation or interop: it "
    "imports only mamba_train.model.*, mamba_train.ops.* and mamba_train.parallel.sharding",
    governs=lambda m: within(m, "mamba_train.model"),
    broken_by=lambda t: ours(t) and not any(within(t, p) for p in _MODEL_MAY_IMPORT))
DATA = Rule(
    "data", "the data pipeline knows no model: it imports only mamba_train.data.* and mamba_train.errors",
    governs=lambda m: within(m, "mamba_train.data"),
    broken_by=lambda t: ours(t) and not within(t, "mamba_train.data") and t != ERRORS_MODULE)
NO_ENTRY_POINTS = Rule(
    "no-entry-points", "the library never imports train.py, configs/, scripts/ or benchmarks/",
    governs=lambda m: ours(m),
    broken_by=lambda t: t.split(".")[0] in ENTRY_POINTS or t.startswith("<relative"))
PARALLEL = Rule(
    "parallel", "parallelism knows no model, trainer, data, interop or workdir",
    governs=lambda m: within(m, "mamba_train.parallel"),
    broken_by=lambda t: any(within(t, p) for p in _PARALLEL_KNOWS_NO))
LEAVES = Rule(
    "leaves", "mamba_train.errors and mamba_train.metrics import nothing of the package (the "
    "formulas, the chip table and the timer serve every layer; the record lives in workdir/)",
    governs=lambda m: m in (ERRORS_MODULE, f"{PACKAGE}.metrics"),
    broken_by=lambda t: ours(t) or t.startswith("<relative"))

TOOLS = Rule(
    "tools", "nothing of the library imports mamba_train.tools (programs over the library that "
    "measure or search: scripts/ and benchmarks/ call them)",
    governs=lambda m: ours(m) and not within(m, "mamba_train.tools"),
    broken_by=lambda t: within(t, "mamba_train.tools"))

RULES = (SSD_IS_PURE, KERNELS, TABLE, ONLY_TABLE_IMPORTS_KERNELS, MODEL, DATA, NO_ENTRY_POINTS, PARALLEL, LEAVES,
         TOOLS)


def outside_names(module: Module) -> list[str]:
  """Outside weight names and config keys in a module outside interop/."""
  if within(module.name, "mamba_train.interop"):
    return []
  return [f"{module.path}:{line}: {value!r} holds the outside name {needle!r}; only "
          f"mamba_train/interop/ knows outside weight names, config keys and file names"
          for line, value in module.strings for needle in OUTSIDE_NAMES if needle in value]


# ---------------------------------------------------------------------------
# The rules on the library as it is.

MODULES = read_package(ROOT)


def _governed(rule: Rule) -> list[str]:
  names = sorted(m for m in MODULES if rule.governs(m))
  assert names, f"rule {rule.name} governs no module: has the layout moved?"
  return names


def test_the_layout_is_where_the_rules_expect_it():
  for name in ("mamba_train.ops.ssd", "mamba_train.model", "mamba_train.data",
               "mamba_train.parallel", "mamba_train.interop", "mamba_train.train",
               "mamba_train.tools"):
    assert name in MODULES, f"{name} is missing: update the rules in this file with the layout"


def test_ssd_math_imports_nothing_of_the_package_and_its_kernels_only_the_math():
  for name in _MATH:
    assert SSD_IS_PURE.violations(MODULES[name]) == []
  for name in _KERNEL_MODULES:
    assert KERNELS.violations(MODULES[name]) == []


def test_only_the_table_imports_kernels_and_it_only_the_operations():
  assert TABLE.violations(MODULES[TABLE_MODULE]) == []
  for name in _governed(ONLY_TABLE_IMPORTS_KERNELS):
    assert ONLY_TABLE_IMPORTS_KERNELS.violations(MODULES[name]) == []
  # The kernel list is every module of ops/ but the plain forms and the table.
  ops = {m for m in MODULES if within(m, "mamba_train.ops") and m != "mamba_train.ops"}
  assert ops == set(_MATH) | set(_KERNEL_MODULES) | {TABLE_MODULE}


# The runtime fields that choose an implementation (and Pallas' interpreter).
IMPL_FIELDS = ("ssd_impl", "layer_impl", "moe_impl", "decode_impl", "pallas_interpret")
SHARED_NAMES = ("attention", "interpret")  # read only on a runtime: `rt.attention`, `runtime.interpret`


def implementation_reads(source: str) -> list[int]:
  """Lines that read an implementation field of a runtime."""
  lines = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Attribute):
      continue
    base = ast.unparse(node.value)
    if node.attr in IMPL_FIELDS or (node.attr in SHARED_NAMES and re.search(r"(^|\.)(rt|runtime)$", base)):
      lines.append(node.lineno)
  return lines


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in (TABLE_MODULE, RUNTIME_MODULE)))
def test_only_the_runtime_and_the_table_read_an_implementation_field(module):
  path = ROOT / MODULES[module].path
  assert implementation_reads(path.read_text()) == [], (
      f"{MODULES[module].path} reads a runtime's implementation field: what runs is the selection "
      f"table's choice (mamba_train/ops/table.py), which the model calls through `Ops`")


def test_the_implementation_check_sees_a_read():
  assert implementation_reads("x = rt.ssd_impl\ny = self.runtime.attention\nz = cfg.attention\n") == [1, 2]


@pytest.mark.parametrize("module", _governed(MODEL))
def test_model_imports_only_model_and_sharding(module):
  assert MODEL.violations(MODULES[module]) == []


@pytest.mark.parametrize("module", _governed(DATA))
def test_data_knows_no_model(module):
  assert DATA.violations(MODULES[module]) == []


@pytest.mark.parametrize("module", _governed(NO_ENTRY_POINTS))
def test_library_never_imports_entry_points(module):
  assert NO_ENTRY_POINTS.violations(MODULES[module]) == []


@pytest.mark.parametrize("module", _governed(PARALLEL))
def test_parallel_knows_no_higher_layer(module):
  assert PARALLEL.violations(MODULES[module]) == []


@pytest.mark.parametrize("module", _governed(LEAVES))
def test_errors_and_metrics_import_nothing_of_the_package(module):
  assert LEAVES.violations(MODULES[module]) == []


@pytest.mark.parametrize("module", _governed(TOOLS))
def test_no_library_module_imports_the_tools(module):
  assert TOOLS.violations(MODULES[module]) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_outside_names_live_only_in_interop(module):
  assert outside_names(MODULES[module]) == []


# ---------------------------------------------------------------------------
# Tests import the library, never an entry point: train.py and scripts/ are run as
# programs (in a subprocess), and what a test needs of them lives in the library.

SCRIPT_MODULES = frozenset(f.stem for f in (ROOT / "scripts").glob("*.py"))
# A line of code handed to a subprocess (`python -c`) that imports something.
_CODE_IMPORT = re.compile(r"^\s*(?:import\s+([\w.]+)|from\s+([\w.]+)\s+import\b)")
_LOAD_BY_PATH = ("spec_from_file_location", "run_path", "SourceFileLoader")


def read_test(name: str, source: str, *, path: str = "<source>", code_strings: bool = True) -> Module:
  """`read_module`, plus the imports a test makes out of the checker's usual sight:
  those in the code it hands a subprocess (each line or `;` statement of a string
  constant that begins with import or from; not with code_strings=False), and each
  file it loads by path (importlib.util.spec_from_file_location, runpy.run_path,
  SourceFileLoader), as the target '<file> ' + the string parts of the call's path."""
  module = read_module(name, source, path=path)
  extra = []
  if code_strings:
    for line, value in module.strings:
      for i, text in enumerate(value.splitlines()):
        for statement in text.split(";"):
          m = _CODE_IMPORT.match(statement)
          if m:
            extra.append(Import(m.group(1) or m.group(2), line + i, statement.strip()))
  lines = source.splitlines()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Call):
      func = node.func
      called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
      if called in _LOAD_BY_PATH:
        parts = [c.value for a in node.args for c in ast.walk(a)
                 if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        extra.append(Import("<file> " + "/".join(parts), node.lineno, lines[node.lineno - 1].strip()))
  return dataclasses.replace(module, imports=tuple(sorted(module.imports + tuple(extra),
                                                          key=lambda i: i.line)))


def _entry_point(target: str) -> bool:
  if target.startswith("<file> "):  # only a run recipe (configs/) may be loaded by its path
    return "configs" not in target[len("<file> "):].split("/")
  head = target.split(".")[0]
  return head in ("train", "scripts") or head in SCRIPT_MODULES


TESTS = Rule(
    "tests", "no test imports train.py or scripts/ (run them as programs; import the library)",
    governs=lambda m: within(m, "tests"),
    broken_by=_entry_point)

# This file's own strings are the checker's synthetic sources: their imports are not its.
TEST_MODULES = {f"tests.{f.stem}": read_test(f"tests.{f.stem}", f.read_text(), path=f"tests/{f.name}",
                                             code_strings=f.name != "test_layout.py")
                for f in sorted((ROOT / "tests").glob("*.py"))}


@pytest.mark.parametrize("module", sorted(TEST_MODULES))
def test_tests_never_import_entry_points(module):
  assert TESTS.violations(TEST_MODULES[module]) == []


# (source, whether the rule must report it)
_TEST_CASES = [
    ("from mamba_train.train import loop, inputs\nimport jax", False),
    ("from test_data import _random_model\nfrom configs import tiny", False),
    ("subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--config.steps=2'])", False),
    ("spec = importlib.util.spec_from_file_location('c', os.path.join(ROOT, 'configs', 'tiny.py'))",
     False),
    ("import train", True),
    ("def f():\n  from train import make_loaders", True),
    ("import scripts.aot_compile", True),
    ("from scripts import export", True),
    ("import aot_compile as a", True),  # a script by its module name, scripts/ on the path
    ('WORKER = """\nimport sys\nimport train\ntrain.make_loaders()\n"""', True),
    ("code = 'import jax; from train import load_init_params'", True),
    ("SCRIPT = os.path.join(ROOT, 'scripts', 'aot_compile.py')\n"
     "spec = importlib.util.spec_from_file_location('aot_compile', SCRIPT)", True),
    ("runpy.run_path(os.path.join(ROOT, 'train.py'))", True),
]


@pytest.mark.parametrize("case", _TEST_CASES, ids=lambda c: c[0].splitlines()[-1].strip()[:60])
def test_tests_rule_reports_exactly_the_entry_point_imports(case):
  source, breaks = case
  found = TESTS.violations(read_test("tests.test_x", source, path="x.py"))
  if breaks:
    assert found, f"{TESTS.name} missed an entry-point import: {source!r}"
    assert all("tests.test_x (x.py:" in f and TESTS.says in f for f in found), found
  else:
    assert found == [], found
  assert TESTS.violations(read_test("mamba_train.train.loop", source)) == []  # governs tests only


_IMPORT_EVERYTHING = textwrap.dedent("""
    import importlib, json, os, pkgutil, sys
    before = dict(os.environ)
    import mamba_train
    def fail(name):
      raise ImportError(f"cannot import {name}")
    names = [m.name for m in pkgutil.walk_packages(mamba_train.__path__, "mamba_train.", onerror=fail)]
    for name in names:
      importlib.import_module(name)
    after = dict(os.environ)
    from jax._src import xla_bridge
    print(json.dumps({
        "package": mamba_train.__file__,
        "modules": sorted(names),
        "changed": {k: [before.get(k), after.get(k)] for k in sorted(set(before) | set(after))
                    if before.get(k) != after.get(k)},
        "backend_started": xla_bridge.backends_are_initialized()}))
""")


def import_everything(root: Path, xla_flags: str | None) -> dict:
  """In a fresh Python whose first path entry is `root`: import the package and every
  submodule; what changed in os.environ, and whether a JAX backend started."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MAMBA_TRAIN_KEEP_XLA_FLAGS")}
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  r = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING], cwd=root, env=env,
                     capture_output=True, text=True, timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert Path(got["package"]).resolve() == (root / PACKAGE / "__init__.py").resolve(), got["package"]
  assert "mamba_train.ops.ssd" in got["modules"] and "mamba_train.interop.load" in got["modules"]
  return got


@pytest.mark.parametrize("xla_flags", [None, "--xla_cpu_enable_fast_math=false"],
                         ids=["no-XLA_FLAGS", "XLA_FLAGS-set"])
def test_importing_the_package_changes_nothing(xla_flags):
  """`import mamba_train` and every submodule leaves os.environ as it was (XLA_FLAGS
  above all) and starts no JAX backend (after which XLA_FLAGS could no longer be set)."""
  got = import_everything(ROOT, xla_flags)
  assert got["changed"] == {}, f"importing mamba_train changed the environment: {got['changed']}"
  assert not got["backend_started"], "importing mamba_train started a JAX backend"


# ---------------------------------------------------------------------------
# The checker can fail: each rule on synthetic sources, and on a copy of the
# package with violating modules in it.

_PKG_MODULES = frozenset({
    "mamba_train", "mamba_train.model", "mamba_train.ops.ssd", "mamba_train.ops.ssd_tpu",
    "mamba_train.model.mamba2", "mamba_train.model.config", "mamba_train.parallel",
    "mamba_train.parallel.sharding", "mamba_train.parallel.mesh", "mamba_train.train",
    "mamba_train.train.step", "mamba_train.data", "mamba_train.data.loader", "mamba_train.workdir",
    "mamba_train.workdir.checkpoint", "mamba_train.workdir.storage", "mamba_train.metrics",
    "mamba_train.errors", "mamba_train.generation", "mamba_train.interop", "mamba_train.interop.convert",
    "mamba_train.tools", "mamba_train.tools.aot", "mamba_train.tools.hlo"})


def _check(rule: Rule, module: str, source: str, is_package: bool = False) -> list[str]:
  return rule.violations(read_module(module, textwrap.dedent(source), path="x.py",
                                     is_package=is_package, package_modules=_PKG_MODULES))


# (rule, module, source, whether the rule must report it)
_CASES = [
    (SSD_IS_PURE, "mamba_train.ops.ssd", "import jax.numpy as jnp\nimport math", False),
    (SSD_IS_PURE, "mamba_train.ops.ssd", "from mamba_train.model import config", True),
    (SSD_IS_PURE, "mamba_train.ops.ssd", "from . import config", True),
    (SSD_IS_PURE, "mamba_train.ops.ssd", "import mamba_train", True),
    (SSD_IS_PURE, "mamba_train.ops.ssd", "def f():\n  from mamba_train.parallel import sharding", True),
    (SSD_IS_PURE, "mamba_train.ops.ssd", "from .ssd_tpu import ssd_fused", True),
    (KERNELS, "mamba_train.ops.ssd_tpu", "import jax\nfrom jax.experimental import pallas as pl", False),
    (KERNELS, "mamba_train.ops.ssd_tpu", "from mamba_train.ops.ssd import to_chunks", False),
    (KERNELS, "mamba_train.ops.ssd_tpu", "from .ssd import to_chunks, chunk_documents", False),
    (KERNELS, "mamba_train.ops.ssd_tpu", "from mamba_train.ops import ssd", False),
    (KERNELS, "mamba_train.ops.ssd_tpu", "import mamba_train.ops.ssd as ssd", False),
    (KERNELS, "mamba_train.ops.ssd_tpu", "from mamba_train.model import config", True),
    (KERNELS, "mamba_train.ops.ssd_tpu", "from . import mamba2", True),
    (KERNELS, "mamba_train.ops.ssd_tpu", "from mamba_train.model import ssd, config", True),
    (KERNELS, "mamba_train.ops.ssd_tpu", "import mamba_train", True),
    (KERNELS, "mamba_train.ops.ssd_tpu", "def f():\n  from mamba_train.parallel import sharding", True),
    (KERNELS, "mamba_train.ops.layer_gpu", "from mamba_train.ops.layer_math import causal_conv_silu", False),
    (KERNELS, "mamba_train.ops.layer_gpu", "from mamba_train.model import mamba2", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.model.config import Mamba2Config", False),
    (MODEL, "mamba_train.model.mamba2", "from .ssd import ssd_chunked\nfrom . import config", False),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.parallel import sharding", False),
    (MODEL, "mamba_train.model.mamba2", "import mamba_train.parallel.sharding as s", False),
    (MODEL, "mamba_train.model.mamba2", "from ..parallel.sharding import constrain", False),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.parallel import mesh", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.parallel import sharding, mesh", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.train import step", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.workdir import checkpoint", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.metrics import Timer", True),
    (MODEL, "mamba_train.model.mamba2", "from ..generation import generate", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.errors import UserError", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.interop import convert", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train.data import loader", True),
    (MODEL, "mamba_train.model.mamba2", "from mamba_train import Mamba2Config", True),
    (MODEL, "mamba_train.model", "from .. import metrics", True, True),
    (MODEL, "mamba_train.model.mamba2",
     "import importlib\nimportlib.import_module('mamba_train.metrics')", True),
    (DATA, "mamba_train.data.loader", "from mamba_train.data import prepare\nfrom . import tokenizer", False),
    (DATA, "mamba_train.data.loader", "import grain\nfrom absl import flags", False),
    (DATA, "mamba_train.data.loader", "from mamba_train.model.config import Mamba2Config", True),
    (DATA, "mamba_train.data.loader", "from ..model import config", True),
    (DATA, "mamba_train.data", "from .loader import x\nfrom ..train import step", True, True),
    (DATA, "mamba_train.data.prepare", "from mamba_train.errors import UserError", False),
    (DATA, "mamba_train.data.prepare", "from mamba_train.workdir import storage", True),
    (LEAVES, "mamba_train.metrics", "import time\nimport jax", False),
    (LEAVES, "mamba_train.metrics", "from mamba_train.workdir import storage", True),
    (LEAVES, "mamba_train.metrics", "from mamba_train.model.config import Mamba2Config", True),
    (LEAVES, "mamba_train.metrics", "from . import errors", True),
    (LEAVES, "mamba_train.errors", "import mamba_train", True),
    (NO_ENTRY_POINTS, "mamba_train.train.step", "from mamba_train.train import run_config", False),
    (NO_ENTRY_POINTS, "mamba_train.train.step", "from . import run_config", False),
    (NO_ENTRY_POINTS, "mamba_train.train.step", "import mamba_train.train.optim", False),
    (NO_ENTRY_POINTS, "mamba_train.train.step", "import train", True),
    (NO_ENTRY_POINTS, "mamba_train.train.step", "from train import make_loaders", True),
    (NO_ENTRY_POINTS, "mamba_train.metrics", "from configs import base", True),
    (NO_ENTRY_POINTS, "mamba_train.metrics", "import configs.tiny", True),
    (NO_ENTRY_POINTS, "mamba_train.metrics", "from scripts.export import main", True),
    (NO_ENTRY_POINTS, "mamba_train.metrics", "def f():\n  import benchmarks.run", True),
    (NO_ENTRY_POINTS, "mamba_train.metrics", "__import__('benchmarks')", True),
    (NO_ENTRY_POINTS, "mamba_train.train.step", "from ... import train", True),  # above the package
    (PARALLEL, "mamba_train.parallel.mesh", "from mamba_train.parallel.sharding import MESH_AXES", False),
    (PARALLEL, "mamba_train.parallel.mesh", "from .sharding import MESH_AXES", False),
    (PARALLEL, "mamba_train.parallel.mesh", "from mamba_train.model.config import Mamba2Config", True),
    (PARALLEL, "mamba_train.parallel.mesh", "from mamba_train.train import step", True),
    (PARALLEL, "mamba_train.parallel.mesh", "from mamba_train import data", True),
    (PARALLEL, "mamba_train.parallel.mesh", "from ..interop import convert", True),
    (PARALLEL, "mamba_train.parallel.mesh", "import mamba_train.workdir.checkpoint", True),
    (PARALLEL, "mamba_train.parallel.distributed", "from mamba_train.errors import RunFailure", False),
    (TOOLS, "mamba_train.tools.aot", "from mamba_train.train.step import build\nfrom . import hlo", False),
    (TOOLS, "mamba_train.tools.aot", "from mamba_train.model.config import Mamba2Config", False),
    (TOOLS, "mamba_train.tools.aot", "from mamba_train.parallel.mesh import make_mesh", False),
    (TOOLS, "mamba_train.train.step", "from mamba_train.train import run_config", False),
    (TOOLS, "mamba_train.train.step", "from mamba_train.tools import aot", True),
    (TOOLS, "mamba_train.train.step", "def f():\n  from ..tools.hlo import xla_cost", True),
    (TOOLS, "mamba_train.model.mamba2", "import mamba_train.tools.hlo", True),
    (TOOLS, "mamba_train.workdir.checkpoint", "from mamba_train import tools", True),
    (TOOLS, "mamba_train.interop", "from ..tools import aot", True, True),
    (TOOLS, "mamba_train.generation", "importlib.import_module('mamba_train.tools.aot')", True),
]


@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"{c[0].name}:{c[2].splitlines()[-1].strip()}")
def test_rule_reports_exactly_the_breaking_imports(case):
  rule, module, source, breaks, *package = case
  found = _check(rule, module, source, is_package=bool(package))
  if breaks:
    assert found, f"{rule.name} missed a breaking import in {module}: {source!r}"
    assert all(module in f and rule.says in f and "x.py:" in f for f in found), found
  else:
    assert found == [], found


def test_rules_govern_only_their_modules():
  src = "from mamba_train.train import step\nfrom mamba_train.model import config"
  assert _check(MODEL, "mamba_train.train.step", src) == []
  assert _check(DATA, "mamba_train.metrics", src) == []
  assert _check(PARALLEL, "mamba_train.generation", src) == []
  assert _check(SSD_IS_PURE, "mamba_train.model.mamba2", src) == []
  assert _check(KERNELS, "mamba_train.model.mamba2", src) == []
  assert _check(KERNELS, "mamba_train.ops.ssd", "from mamba_train.model import config") == []
  assert _check(TOOLS, "mamba_train.tools.window_search", "from mamba_train.tools import hlo") == []
  # `train` the top-level script is not the library's mamba_train.train.
  assert _check(NO_ENTRY_POINTS, "mamba_train.generation", src) == []


def test_outside_name_scan_reports_file_and_line_and_skips_docstrings():
  src = textwrap.dedent('''
      """Converts to transformers' hidden_size and backbone.layers (a docstring: prose)."""
      def f(i):
        """lm_head.weight, in a docstring."""
        ok = {"d_model": 1, "tokenizer.json": 2, "A_log": 3}
        return {f"backbone.layers.{i}.mixer": 1,
                "hidden_size": ok}
  ''')
  found = outside_names(read_module("mamba_train.metrics", src, path="mamba_train/metrics.py"))
  assert len(found) == 2, found
  assert found[0].startswith("mamba_train/metrics.py:6: ") and "'backbone.'" in found[0]
  assert found[1].startswith("mamba_train/metrics.py:7: ") and "'hidden_size'" in found[1]
  assert outside_names(read_module("mamba_train.interop.convert", src)) == []  # interop may


def test_rules_catch_violations_written_into_a_copy_of_the_package(tmp_path):
  shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE,
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  pkg = tmp_path / PACKAGE
  bad = {
      "ops/ssd.py": ("from mamba_train.model.config import Mamba2Config", SSD_IS_PURE),
      "ops/ssd_tpu.py": ("from mamba_train.model.mamba2 import Mamba2LM", KERNELS),
      "model/bad_layer.py": ("from mamba_train.train.step import build", MODEL),
      "data/bad_source.py": ("from ..model.mamba2 import Mamba2LM", DATA),
      "train/bad_hook.py": ("def f():\n  import train", NO_ENTRY_POINTS),
      "parallel/bad_rules.py": ("from mamba_train.workdir.checkpoint import Checkpointer", PARALLEL),
      "metrics.py": ("from mamba_train.workdir import record", LEAVES),
      "train/loop.py": ("def f():\n  from mamba_train.tools import aot", TOOLS),
  }
  for rel, (line, _) in bad.items():
    with open(pkg / rel, "a") as f:
      f.write("\n" + line + "\n")
  (pkg / "metrics.py").write_text((pkg / "metrics.py").read_text() + '\nHF = "pytorch_model.bin"\n')
  modules = read_package(tmp_path)
  for rel, (_, rule) in bad.items():
    name = f"{PACKAGE}." + rel[:-3].replace("/", ".")
    found = rule.violations(modules[name])
    assert len(found) == 1 and found[0].startswith(f"{name} ({PACKAGE}/{rel}:"), (rule.name, found)
  assert sorted(m for m in modules if any(r.violations(modules[m]) for r in RULES)) == sorted(
      f"{PACKAGE}." + rel[:-3].replace("/", ".") for rel in bad)
  found = outside_names(modules["mamba_train.metrics"])
  assert len(found) == 1 and found[0].startswith(f"{PACKAGE}/metrics.py:") and "pytorch_model.bin" in found[0]


# What `import mamba_train` and `import mamba_train.model` may not load: the workdir stack
# (Orbax, tensorstore, the bucket clients), generation, interop's file readers, the trainer.
# (etils is not on the list: JAX itself imports etils.epath.)
_HEAVY = ("mamba_train.workdir", "mamba_train.generation", "mamba_train.interop", "mamba_train.train",
          "mamba_train.data", "mamba_train.metrics", "orbax", "tensorstore", "safetensors", "grain",
          "gcsfs", "wandb") + _KERNEL_MODULES  # kernels load when the table chooses them


_MODEL_IMPORTS = ("mamba_train", "mamba_train.ops.ssd", "mamba_train.model.mamba2", "mamba_train.model.lm")


def test_importing_the_model_loads_no_workdir_generation_or_trainer():
  # One fresh interpreter imports each module in turn and lists what is loaded after each:
  # what one import loads alone is within what it and those before it load together, so
  # this holds each of them as a process of its own would (one start instead of four).
  code = ("import importlib, json, sys\nseen = {}\n"
          f"for what in {list(_MODEL_IMPORTS)!r}:\n"
          "  importlib.import_module(what)\n"
          "  seen[what] = sorted(sys.modules)\n"
          "print(json.dumps(seen))")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  seen = json.loads(r.stdout.strip().splitlines()[-1])
  assert list(seen) == list(_MODEL_IMPORTS)
  assert "mamba_train.model.lm" in seen["mamba_train.model.lm"]
  for what, loaded in seen.items():
    heavy = sorted(m for m in loaded if any(within(m, h) for h in _HEAVY))
    assert heavy == [], f"import {what} loaded {heavy}"


def test_import_probe_sees_a_module_that_sets_xla_flags(tmp_path):
  """The environment check fails on a module that sets XLA_FLAGS or starts a backend at
  import (written into a copy of the package, which the probe imports instead)."""
  shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE,
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  with open(tmp_path / PACKAGE / "parallel" / "topology.py", "a") as f:
    f.write("\nimport os\n"
            "os.environ['XLA_FLAGS'] += ' --xla_llvm_disable_expensive_passes=true'\n"
            "import jax\n"
            "jax.devices()\n")
  mine = "--xla_cpu_enable_fast_math=false"
  got = import_everything(tmp_path, mine)
  assert got["changed"] == {"XLA_FLAGS": [mine, mine + " --xla_llvm_disable_expensive_passes=true"]}
  assert got["backend_started"]
