"""mamba_train: pretrain and finetune Mamba-2 (SSD) language models in JAX.

The public API. Importing the package changes nothing global (no environment
variables, no XLA flags); entry points set those (see `xla_flags`).
"""

# After the model modules load, `generate` names the function: importing the
# submodule mamba_train.generate binds the package attribute to the module, and
# this import rebinds it.
from mamba_train.generate import generate
from mamba_train.model.config import SIZES, Mamba2Config, config_for
from mamba_train.model.mamba2 import Mamba2LM
from mamba_train.model.runtime import Runtime

__all__ = ["Mamba2Config", "Mamba2LM", "Runtime", "SIZES", "config_for", "generate", "load_model"]


def __getattr__(name):
  # Lazy: loading pulls in safetensors and the checkpoint stack only when used.
  if name == "load_model":
    from mamba_train.interop.load import load_model
    return load_model
  raise AttributeError(name)
