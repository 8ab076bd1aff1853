"""Continues a prompt with a Mamba-2 model and reports tokens/s.

  # Text, with the tokenizer.json saved next to the model (offline):
  python scripts/generate.py --model=/path/to/model --prompt="The capital of France is"
  # Token ids, any model directory:
  python scripts/generate.py --model=/path/to/model --ids=1,2,3 --max_new_tokens=32
  # INT8 decoding (weights quantized once per call; state and recurrence float32):
  python scripts/generate.py --model=... --prompt=... --matmul_precision=int8
  # Sampling:
  python scripts/generate.py --model=... --prompt=... --temperature=0.8 --top_p=0.95 --seed=1

--model is anything `mamba_train.load_model` accepts. The prefill and the whole
decode loop run as one compiled program; tokens/s counts new tokens over that
program's run time (prefill included), and the compile time is reported apart.
"""

import os
import sys

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend

from absl import app, flags  # noqa: E402

import mamba_train  # noqa: E402
from mamba_train import cli  # noqa: E402
from mamba_train.generation import MAX_PROMPT_LEN, generate_with_stats  # noqa: E402
from mamba_train.metrics import Timer  # noqa: E402
from mamba_train.workdir import storage  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "Model directory (transformers, mamba_ssm, ...).",
                             required=True)
flags.DEFINE_alias("checkpoint", "model")  # the name scripts/export.py once took
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (needs a tokenizer).")
_IDS = flags.DEFINE_list("ids", None, "Prompt token ids, comma separated.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "'byte', a tokenizer.json path or a transformers name; default: "
    "the model directory's tokenizer.json.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Most tokens to generate.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sample.", lower_bound=0.0)
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).", lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1].")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_EOS = flags.DEFINE_integer("eos_id", None, "Stop at this id (default: the tokenizer's EOS).")
_IGNORE_EOS = flags.DEFINE_boolean("ignore_eos", False, "Always generate max_new_tokens.")
_PRECISION = flags.DEFINE_enum(
    "matmul_precision", None, ["default", "fp8", "int8"],
    "Run the matmuls in this format (runtime.matmul_precision; default: the model's own). "
    "int8: weights quantized once per generate call, the state and recurrence float32.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_len", MAX_PROMPT_LEN, "Longest prompt accepted.", lower_bound=1)
flags.register_validator("top_p", lambda p: 0.0 < p <= 1.0, "--top_p must be in (0, 1]")


def _tokenizer():
  from mamba_train.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  spec = _TOKENIZER.value
  if spec is None:
    spec = os.path.join(_MODEL.value, "tokenizer.json")
    if not storage.path(spec).is_file():
      raise app.UsageError(f"{_MODEL.value} holds no tokenizer.json: pass --tokenizer or --ids")
  if storage.is_remote(spec):  # the tokenizers library reads local files
    spec = storage.local_copy(spec)
  return load_tokenizer(spec)


def main(argv):
  del argv
  if (_PROMPT.value is None) == (_IDS.value is None):
    raise app.UsageError("give exactly one of --prompt and --ids")
  cli.must_exist(_MODEL.value, "--model")
  tok = None
  if _PROMPT.value is not None:
    tok = _tokenizer()
    ids = tok.tokenizer.encode(_PROMPT.value).ids
  else:
    try:
      ids = [int(t) for t in _IDS.value]
    except ValueError as e:
      raise app.UsageError(f"--ids must be integers separated by commas: {e}") from e
  eos = _EOS.value if _EOS.value is not None else (tok.eos_id if tok else None)
  if _IGNORE_EOS.value:
    eos = None

  with Timer() as t:
    try:
      kw = {} if _PRECISION.value is None else {"matmul_precision": _PRECISION.value}
      # The matmul weights cast to the compute dtype once, not in every forward: the same tokens.
      model = mamba_train.load_model(_MODEL.value, **kw).for_inference()
    except (FileNotFoundError, ValueError) as e:  # a wrong path, not a model, a damaged step
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
  print(f"loaded {_MODEL.value} in {t.seconds:.1f}s: {model.config}, {model.runtime}")
  try:
    out, stats = generate_with_stats(
        model, ids, _MAX_NEW.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
        top_p=_TOP_P.value, seed=_SEED.value, eos_id=eos, max_prompt_len=_MAX_PROMPT.value)
  except ValueError as e:  # bad prompt or settings: say so without a traceback
    raise app.UsageError(str(e)) from e
  new = [int(t) for t in out[len(ids):]]
  if eos is not None and eos in new:
    new = new[:new.index(eos)]  # the EOS itself and the padding after it are not text
  if tok is not None:
    print(_PROMPT.value + tok.tokenizer.decode(new))
  else:
    print(",".join(str(t) for t in new))
  print(f"{stats.new_tokens} new tokens from a {stats.prompt_tokens}-token prompt in "
        f"{stats.run_s:.3f}s: {stats.tokens_per_s:.1f} tokens/s (prefill included); "
        f"compile {stats.compile_s:.1f}s, not counted")


if __name__ == "__main__":
  cli.run(main)
