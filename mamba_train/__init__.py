"""mamba_train: pretrain and finetune Mamba-2 (SSD) language models in JAX.

The public API. Importing the package changes nothing global (no environment
variables, no XLA flags); entry points set those (see `xla_flags`). It loads the
model only: generation, loading and the workdir stack come in on first use, which
also chooses the platforms JAX starts unless something has (`platforms`).
"""

from mamba_train.model.config import SIZES, Mamba2Config, config_for
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.runtime import Runtime

__all__ = ["Mamba2Config", "Mamba2LM", "Runtime", "SIZES", "config_for", "generate", "load_model"]


def __getattr__(name):
  # Lazy: `generate` brings the decode loop, `load_model` safetensors and the checkpoint stack.
  # Their first use chooses the platforms JAX starts, if nothing has (`platforms`): a CPU
  # machine with the test extra's plugins then prints no plugin tracebacks.
  if name in ("generate", "load_model"):
    from mamba_train import platforms
    platforms.choose(one_line_failures=False)
  if name == "generate":
    from mamba_train.generation import generate
    return generate
  if name == "load_model":
    from mamba_train.interop.load import load_model
    return load_model
  raise AttributeError(name)
