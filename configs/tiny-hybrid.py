"""The tiny default as a hybrid: Mamba-2, attention and MLP layers ('MM*-'), byte
level, on the default corpus; a few minutes on a CPU.

  python train.py --config configs/tiny-hybrid.py --workdir runs/tiny-hybrid
"""

import importlib.util
import os

from mamba_train import config_for

_spec = importlib.util.spec_from_file_location("tiny", os.path.join(os.path.dirname(__file__), "tiny.py"))
_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tiny)


def get_config():
  c = _tiny.get_config()
  c.name = "tiny-hybrid"
  c.model.update(config_for("tiny-hybrid", vocab_size=257).to_dict())  # bytes + EOS
  return c
