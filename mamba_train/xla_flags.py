"""XLA flags that survive releases, and the XLA:CPU default that mamba_train's entry
points apply before JAX starts a backend (train.py, scripts/, benchmarks/ and the test
suite call `apply_cpu_defaults` first; importing the library changes nothing). The same
call chooses the platforms JAX starts (`mamba_train.platforms`: the accelerators this
machine has and the CPU, so absent hardware's plugins print nothing).

XLA aborts the whole process at its first backend when XLA_FLAGS holds a flag it does
not define (`parse_flags_from_env.cc: Unknown flag in XLA_FLAGS`, fatal), and flags come
and go between jaxlib releases: `--xla_cpu_use_fusion_emitters` exists in jaxlib 0.10
and is gone in 0.12. So every flag the project sets is first checked against the
installed XLA (`known`), and a flag the user set that this XLA does not define is named
in one line before anything starts, instead of the runtime's abort.

How a flag is checked without starting XLA (which would abort): XLA registers each flag
by its name as a C string in jaxlib's shared library, so the name appears there between
two NUL bytes exactly when this build defines it (a removed flag survives only inside
protobuf descriptors, length-prefixed, never NUL-delimited). Where jaxlib's library
cannot be found, a child process that starts XLA's CPU backend with the flags answers
instead (about a second).

The default: jaxlib's XLA:CPU hands matmuls and the elementwise and reduction work
around them to YNNPACK fusions. For Mamba-2 turning them off is faster: train steps and
the SSD gain while a plain matmul runs at the same rate either way
(docs/bench/design_notes.md has the figures). The YNN fusions also crashed (SIGSEGV)
running one SSD gradient in testing. The flag only touches the CPU backend; GPUs and
TPUs are unaffected. Not applied when XLA_FLAGS already sets
xla_cpu_experimental_ynn_fusion_type (yours wins), when
MAMBA_TRAIN_KEEP_XLA_FLAGS=1, or where the installed XLA does not define it. It cannot
apply once JAX has created its CPU backend: call it before running any JAX computation.
"""

import functools
import glob
import importlib.util
import mmap
import os
import re
import subprocess
import sys

from mamba_train import platforms

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
_NAME = re.compile(r"--(xla_[A-Za-z0-9_]+)")
# XLA's own library in jaxlib (libjax_common.so in jaxlib 0.10-0.12); the small .so files
# beside it are Python extension stubs.
_MIN_LIBRARY_BYTES = 50 << 20


def names(flags: str) -> list[str]:
  """The flag names (`xla_...`) in an XLA_FLAGS string, in order."""
  return _NAME.findall(flags)


def _libraries() -> tuple[str, ...]:
  spec = importlib.util.find_spec("jaxlib")  # finds the package without loading XLA
  if spec is None or not spec.submodule_search_locations:
    return ()
  found = []
  for where in spec.submodule_search_locations:
    found += [p for p in glob.glob(os.path.join(where, "*.so*")) if os.path.getsize(p) >= _MIN_LIBRARY_BYTES]
  return tuple(sorted(found))


@functools.lru_cache(maxsize=None)
def _defined_in(library: str, name: str) -> bool:
  with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    return m.find(b"\0" + name.encode() + b"\0") >= 0


def probe_unknown(flags: str) -> list[str]:
  """Start XLA's CPU backend in a child with `flags`; the names it rejects (all of them
  when the child fails some other way)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  r = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env, capture_output=True,
                     text=True)
  if r.returncode == 0:
    return []
  line = re.search(r"Unknown flags? in XLA_FLAGS:(.*)", r.stderr)
  return names(line.group(1)) if line else names(flags)


def unknown(flags: str) -> list[str]:
  """The names among `flags` (an XLA_FLAGS string) that the installed XLA does not
  define. `xla_force_host_platform_device_count` and every other flag are checked alike."""
  flag_names = names(flags)
  if not flag_names:
    return []
  libraries = _libraries()
  if not libraries:
    return probe_unknown(flags)
  return [n for n in flag_names if not any(_defined_in(lib, n) for lib in libraries)]


def only_known(flags: str) -> str:
  """`flags` without the ones the installed XLA does not define (for flags the project
  chooses itself, such as the test suite's fast-compile set)."""
  drop = set(unknown(flags))
  return " ".join(f for f in flags.split() if not (_NAME.match(f) and _NAME.match(f).group(1) in drop))


def apply_cpu_defaults(environ=os.environ) -> bool:
  """Check XLA_FLAGS and append the CPU default unless opted out; True when it was added.

  A flag in XLA_FLAGS that the installed XLA does not define ends the process here with
  one line naming it (exit 2), where XLA would abort later with its own fatal log. Then
  the platforms JAX starts are chosen (`platforms.choose`), unless JAX_PLATFORMS is set."""
  flags = environ.get("XLA_FLAGS", "")
  bad = unknown(flags)
  if bad:
    import jaxlib.version  # only the version string: loads no XLA
    sys.stderr.write(f"error: XLA_FLAGS sets {', '.join('--' + n for n in bad)}, which the installed XLA "
                     f"(jaxlib {jaxlib.version.__version__}) does not define: remove it from XLA_FLAGS "
                     "(XLA's flags change between releases)\n")
    raise SystemExit(2)
  platforms.choose(environ)
  if environ.get("MAMBA_TRAIN_KEEP_XLA_FLAGS") == "1" or "xla_cpu_experimental_ynn_fusion_type" in flags:
    return False
  if unknown(YNN_FLAG):
    return False
  environ["XLA_FLAGS"] = (flags + " " + YNN_FLAG).strip()
  return True
