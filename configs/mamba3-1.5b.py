"""Mamba-3 MIMO 1.5b (the shape of state-spaces/mamba3-mimo-1.5b: 24 blocks of a Mamba-3
MIMO mixer, rank 4, and a gated MLP; model/config.py SIZES["mamba3-mimo-1.5b"]) pretrained
as that model was: 100B tokens at context 2048. The optimizer is the Mamba-2 1.3b
recipe's (base.mamba2_pretrain; the Mamba-3 release publishes none): batches of 0.5M
tokens, AdamW (0.9, 0.95), cosine to 10%, bfloat16 matmuls, FSDP over all devices.
Its vocabulary is Llama-3.1's (128,256): prepare the data with that tokenizer.

  python train.py --config configs/mamba3-1.5b.py --workdir runs/mamba3-1.5b --config.data.dir=data/fineweb-edu
  python scripts/aot_compile.py --config configs/mamba3-1.5b.py --topology v6e-256
  # continue from the released weights (its mamba_ssm directory):
  python train.py --config configs/mamba3-1.5b.py --config.init_from=PATH/TO/mamba3-mimo-1.5b ...
"""

from configs import base
from mamba_train import config_for


def get_config():
  c = base.mamba2_pretrain("1.3b")
  c.name = "mamba3-mimo-1.5b"
  c.model.update(config_for("mamba3-mimo-1.5b").to_dict())
  c.steps = 100_000_000_000 // (c.batch_size * c.seq_len)  # 190,734 steps of 0.5M tokens
  c.runtime.remat = "auto"
  return c
