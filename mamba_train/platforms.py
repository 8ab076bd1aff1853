"""Which of JAX's backends to start: the CPU and the accelerators this machine has.

With no choice made, JAX starts every installed plugin at its first computation, and a
plugin whose hardware is absent fails loudly: jax's CUDA plugin logs two chained
tracebacks (`Unable to load cuDNN. Is it installed?`) and libtpu prints warnings about
TPU hostnames and accelerator types, all before a CPU run's first line of its own.
JAX's own answer is a platform list: with `JAX_PLATFORMS` naming what to start, the CUDA
plugin skips its library checks (jax-ml/jax#35384) and no TPU client is made. So the
entry points (through `xla_flags.apply_cpu_defaults`) and the public API's first use
(`mamba_train.load_model`, `mamba_train.generate`) call `choose` before JAX starts a
backend: it looks for the hardware the way JAX itself does (device nodes and PCI ids,
`jax._src.hardware_utils`; read here so that nothing of JAX is imported or started) and
sets the list to the accelerators found, then the CPU. A choice already made
(`JAX_PLATFORMS`, even empty, or `jax.config.update("jax_platforms", ...)`, which libtpu
makes on a Cloud TPU VM) is kept.

A machine with an accelerator whose plugin fails says so in one line and stops, as JAX
does on a TPU VM, rather than training on the CPU by accident: the plugin's traceback is
held back (`_PluginErrors`) and JAX's `Unable to initialize backend` error is printed
as one line with the plugin's reason and the fix (`_one_line_backend_error`).
"""

from __future__ import annotations

import glob
import logging
import os
import sys

# What JAX's hardware_utils reads: NVIDIA device nodes (Linux, Docker/Kubernetes, WSL2),
# AMD's kernel driver, Google's PCI vendor id with a TPU device id. /dev/accel* (TPU v2-v4)
# and /dev/vfio/<n> (v5e and later) also mark a TPU where /sys is not mounted.
_NVIDIA = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_AMD = ("/dev/kfd",)
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
_FIX = {"cuda": "pip install -U 'jax[cuda12]'", "rocm": "pip install -U 'jax[rocm]'",
        "tpu": "pip install -U 'jax[tpu]'"}
_NAMES = {"cuda": "an NVIDIA GPU", "rocm": "an AMD GPU", "tpu": "a TPU"}


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


def _tpu_on_pci() -> bool:
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    if _read(vendor) == _GOOGLE_PCI_VENDOR and _read(os.path.join(os.path.dirname(vendor), "device")) in \
        _TPU_PCI_DEVICES:
      return True
  return False


def accelerators() -> list[str]:
  """JAX's platform names for the accelerators this machine has, in JAX's priority order."""
  found = []
  if any(os.path.exists(p) for p in _NVIDIA):
    found.append("cuda")
  if any(os.path.exists(p) for p in _AMD):
    found.append("rocm")
  if _tpu_on_pci() or glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
    found.append("tpu")
  return found


def _chosen_in_jax() -> bool:
  """A list set through JAX's config, or backends already started (too late to choose)."""
  jax = sys.modules.get("jax")
  if jax is None:
    return False
  if jax.config.jax_platforms is not None:
    return True
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    return xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):  # moved in a later jax: choosing is then harmless
    return False


def choose(environ=os.environ, *, one_line_failures: bool = True) -> str | None:
  """Set the platforms JAX starts to this machine's accelerators and the CPU, unless a
  choice was made; the list set, or None. Call before JAX's first computation.
  `one_line_failures`: an accelerator's plugin that fails is reported in one line at exit
  (entry points); the library's first use leaves JAX's exception to its caller."""
  if "JAX_PLATFORMS" in environ or (environ is os.environ and _chosen_in_jax()):
    return None
  platforms = ",".join(accelerators() + ["cpu"])
  environ["JAX_PLATFORMS"] = platforms  # child processes (data workers, launched ranks) alike
  if environ is os.environ:
    if "jax" in sys.modules:  # JAX reads the variable when imported: tell its config too
      sys.modules["jax"].config.update("jax_platforms", platforms)
    if platforms != "cpu" and one_line_failures:
      _hold_plugin_errors()
  return platforms


class _PluginErrors(logging.Filter):
  """Holds back JAX's `Jax plugin configuration error` record (its traceback) and keeps
  the last line of its exception, for the one-line report of the backend it failed."""

  def __init__(self):
    super().__init__()
    self.reasons: dict[str, str] = {}

  def filter(self, record: logging.LogRecord) -> bool:
    if not str(record.msg).startswith("Jax plugin configuration error") or not record.exc_info:
      return True
    err = record.exc_info[1]
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    name = str(record.getMessage())
    platform = next((p for p in _FIX if p in name), "plugin")
    self.reasons[platform] = text
    return False


_HELD = _PluginErrors()


def _hold_plugin_errors() -> None:
  if _HELD not in logging.getLogger("jax._src.xla_bridge").filters:
    logging.getLogger("jax._src.xla_bridge").addFilter(_HELD)
    previous = sys.excepthook

    def hook(kind, value, tb):
      line = _one_line_backend_error(value)
      if line is None:
        previous(kind, value, tb)
      else:
        print(f"error: {line}", file=sys.stderr)
    sys.excepthook = hook


def _one_line_backend_error(err: BaseException) -> str | None:
  """JAX's `Unable to initialize backend 'x'` as one line with the plugin's own reason
  (held back above) and the fix; None for any other error."""
  text = str(err)
  if not isinstance(err, RuntimeError) or "Unable to initialize backend '" not in text:
    return None
  platform = text.split("Unable to initialize backend '", 1)[1].split("'", 1)[0]
  reason = _HELD.reasons.get(platform) or text.split(": ", 1)[-1].split(" (set JAX_PLATFORMS")[0]
  return (f"this machine has {_NAMES.get(platform, platform)} but JAX could not start it: {reason} "
          f"({_FIX.get(platform, 'reinstall its JAX plugin')}; or JAX_PLATFORMS=cpu runs on the CPU)")
