"""Export a model to the transformers or mamba_ssm layout, or to llama.cpp's GGUF. A hybrid
(`layer_pattern`) exports as transformers' NemotronHForCausalLM (--format hf) or
mamba_ssm's hybrid layout (when its pattern fits mamba_ssm's blocks). A LoRA run
exports with its adapters merged into the weights, or, with --peft, its adapters
alone in peft's format (adapter_config.json, adapter_model.safetensors) for
`peft.PeftModel.from_pretrained` on the base.

  python scripts/export.py --model runs/tiny --out exported/tiny
  python scripts/export.py --model runs/tiny/checkpoints/100 --out exported/tiny-ssm --format mamba_ssm
  python scripts/export.py --model runs/tiny --out exported/tiny-bf16 --dtype bfloat16
  python scripts/export.py --model runs/lora --out exported/lora-adapters --peft
  python scripts/export.py --model runs/tiny --out exported/tiny.gguf --format gguf --dtype q8_0

--model (alias --checkpoint) takes anything `mamba_train.load_model` reads: a training
workdir or one of its checkpoint steps, a transformers directory or a mamba_ssm directory.
The tokenizer (tokenizer.json) is shipped when one is found beside the checkpoint,
in the workdir, or given with --tokenizer. --format gguf writes one file (NAME.gguf)
for llama.cpp, tokenizer included (it needs one), in float32, bfloat16 or q8_0
(docs/gguf.md; the `gguf` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend

from absl import flags  # noqa: E402

from mamba_train import cli  # noqa: E402

_CKPT = flags.DEFINE_string("model", None, "Workdir, checkpoint step, transformers or mamba_ssm dir.")
flags.DEFINE_alias("checkpoint", "model")
_OUT = flags.DEFINE_string("out", None, "Output directory (must not exist or be empty).")
_FORMAT = flags.DEFINE_enum("format", "hf", ["hf", "mamba_ssm", "gguf"], "Output layout (gguf: one file, NAME.gguf).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "q8_0"],
                           "Weight dtype on disk (q8_0: llama.cpp's 8-bit blocks, --format gguf only).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.json to ship (default: found beside the checkpoint).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an --out that holds a previous export.")
_PEFT = flags.DEFINE_bool("peft", False, "Write a LoRA run's adapters alone, in peft's format.")

def find_tokenizer(ckpt) -> Path | None:
  """tokenizer.json in `ckpt` or up to three directories above (a workdir holds one);
  one on a bucket is copied to a local temporary file."""
  from mamba_train.workdir import storage
  ckpt = storage.path(ckpt)
  for d in [ckpt, *ckpt.parents][:4]:
    if (d / "tokenizer.json").exists():
      return Path(storage.local_copy(d / "tokenizer.json"))
  return None


def eos_of(tokenizer_file: Path) -> tuple[str | None, int | None]:
  """The tokenizer's end-of-text token and id, found as data preparation finds it."""
  from mamba_train.data.tokenizer import load_tokenizer
  try:
    info = load_tokenizer(str(tokenizer_file))
  except ValueError:  # no end-of-text token: the export has none either
    return None, None
  return info.tokenizer.id_to_token(info.eos_id), info.eos_id


def main(argv):
  del argv
  if not _CKPT.value or not _OUT.value:
    _fail("export.py needs --model and --out (see --help)")
  if _DTYPE.value == "q8_0" and _FORMAT.value != "gguf":
    _fail(f"--dtype q8_0 is llama.cpp's quantization: it needs --format gguf (--format {_FORMAT.value} "
          "takes float32 or bfloat16)")
  from mamba_train.interop import export
  try:
    export.check_out(_OUT.value, _CKPT.value)
    if _FORMAT.value == "gguf" and not _PEFT.value:
      _export_gguf()
    else:
      _export(export)
  except (FileExistsError, FileNotFoundError, ValueError) as e:
    # The --out checks, a wrong path, not a model, a damaged checkpoint step: the message says.
    _fail(str(e))


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _tokenizer() -> Path | None:
  tok = Path(_TOKENIZER.value) if _TOKENIZER.value else find_tokenizer(_CKPT.value)
  if tok is not None and not tok.exists():
    _fail(f"--tokenizer {tok} does not exist")
  return tok


def _export_gguf() -> None:
  try:
    from mamba_train.interop import gguf as gguf_export
  except ImportError as e:
    if e.name != "gguf":
      raise
    _fail("--format gguf needs the gguf package (llama.cpp's writer): pip install -e '.[gguf]'")
  import logging
  logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs each file's size at INFO
  from mamba_train.interop.load import load_config, load_model
  # Everything that can refuse does so before the weights are read.
  gguf_export.architecture(load_config(_CKPT.value))
  gguf_export.check_out(_OUT.value, _OVERWRITE.value)
  tok = _tokenizer()
  if tok is None:
    _fail(f"--format gguf needs the model's tokenizer: none found beside {_CKPT.value}; "
          "pass --tokenizer PATH/tokenizer.json")
  _, eos_id = eos_of(tok)
  model = load_model(_CKPT.value).merged()  # a LoRA run's adapters go into the weights
  out = gguf_export.save_gguf(model, _OUT.value, tokenizer_file=tok, eos_token_id=eos_id,
                              dtype=_DTYPE.value, overwrite=_OVERWRITE.value)
  arch = "mamba2" if model.config.pattern == "M" * model.config.n_layer else "nemotron_h"
  print(f"wrote GGUF ({arch}, {_DTYPE.value}) to {out} with tokenizer {tok}")


def _export(export) -> None:
  from mamba_train.interop.load import load_model

  ckpt = _CKPT.value
  model = load_model(ckpt)
  out = Path(_OUT.value)
  if _PEFT.value:
    from mamba_train.interop.peft import save_peft
    from mamba_train.workdir import checkpoint
    step_dir = checkpoint.find_step_dir(ckpt)
    base = checkpoint.saved_config(step_dir).get("init_from", "") if step_dir else ""
    save_peft(model, out, base=base, overwrite=_OVERWRITE.value)
    print(f"wrote peft LoRA adapters (rank {model.lora.rank}) to {out}; their base: {base or 'the random init'}")
    return
  model = model.merged()  # a LoRA run's adapters go into the weights
  if _FORMAT.value == "hf":
    tok = _tokenizer()
    eos, eos_id = eos_of(tok) if tok else (None, None)
    export.save_hf(model, out, dtype=_DTYPE.value, tokenizer_file=tok, eos_token=eos,
                   eos_token_id=eos_id, overwrite=_OVERWRITE.value)
    arch = "Mamba2" if model.config.pattern == "M" * model.config.n_layer else "NemotronH"
    print(f"wrote transformers {arch} to {out}" + (f" with tokenizer {tok}" if tok else " (no tokenizer found)"))
  else:
    export.save_mamba_ssm(model, out, dtype=_DTYPE.value, overwrite=_OVERWRITE.value)
    print(f"wrote mamba_ssm layout to {out}")


if __name__ == "__main__":
  cli.run(main)
