"""The default run: a 4-layer, d_model 256 byte-level Mamba-2 that trains in a few
minutes on a CPU, on the default corpus.

  python train.py                      # this config, into runs/tiny-<time>
  python train.py --config configs/tiny.py --workdir runs/tiny --config.steps=200
"""

from configs import base
from mamba_train import config_for


def get_config():
  c = base.get_config()
  c.name = "tiny"
  c.steps = 100
  c.batch_size = 8
  c.seq_len = 256
  c.log_every = 10
  c.eval_every = 50
  c.eval_batches = 2
  c.model.update(config_for("tiny", vocab_size=257).to_dict())  # bytes + EOS
  c.data.source = "corpus"  # '' dir: the default corpus (Python stdlib sources), built offline
  c.optim.lr = 3e-3
  return c
