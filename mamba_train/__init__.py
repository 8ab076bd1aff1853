"""mamba_train: pretrain and finetune Mamba-2 (SSD) language models in JAX."""

from mamba_train import xla_flags as _xla_flags

_xla_flags.apply_cpu_defaults()  # first: it must precede JAX's CPU backend (see the module)

from mamba_train.config import Mamba2Config, SIZES, config_for
from mamba_train.model import Mamba2LM
# Eager, and after the model: importing the submodule mamba_train.generate binds the
# package attribute `generate` to the module; this import rebinds it to the function.
from mamba_train.generate import generate

__all__ = ["Mamba2Config", "Mamba2LM", "SIZES", "config_for", "generate", "load_model"]


def __getattr__(name):
  # Lazy: loading pulls in safetensors and the checkpoint stack only when used.
  if name == "load_model":
    from mamba_train.load import load_model
    return load_model
  raise AttributeError(name)
