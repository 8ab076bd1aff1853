"""Evaluate a model with lm-evaluation-harness (pip install -e ".[eval]").

  # Standard tasks (their data comes from the Hugging Face hub: needs the network once):
  python scripts/eval.py --model PATH/TO/mamba2-130m --tokenizer EleutherAI/gpt-neox-20b \
      --tasks lambada_openai,hellaswag,piqa,arc_easy --batch_size auto --output_path results/
  # A training run's checkpoint (its tokenizer.json is in the workdir), a local task, offline:
  HF_DATASETS_OFFLINE=1 python scripts/eval.py --model runs/tiny --step 100 \
      --include_path tests/data/harness --tasks tiny_mc --limit 5 --log_samples --output_path out/

--model is anything `mamba_train.load_model` accepts: a workdir (its newest
checkpoint, or --step), a transformers or a mamba_ssm directory. The flags
--tasks, --include_path, --limit, --num_fewshot, --batch_size (an int, auto or
auto:N), --max_batch_size, --output_path and --log_samples mean what they mean to
`lm_eval` (also its default batch size, 1), which writes its results and samples
files under --output_path.

On several devices or processes the weights are replicated on every device and
each scoring forward splits its rows over them (mamba_train/interop/eval_harness.py):
--batch_size is then per device, as in lm-eval's data-parallel runs. Start every
process of a job alike, with --coordinator_address, --num_processes and
--process_id as train.py takes them (detected on a TPU pod, SLURM or Open MPI);
process 0 prints the table and writes the files:

  python scripts/eval.py --model runs/tiny --tasks tiny_mc ... \
      --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0   # and =1
"""

from mamba_train.xla_flags import apply_cpu_defaults

apply_cpu_defaults()  # before JAX starts its CPU backend

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402

from absl import app, flags  # noqa: E402

from mamba_train import cli  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "Workdir, checkpoint, transformers or mamba_ssm dir.",
                             required=True)
flags.DEFINE_alias("checkpoint", "model")  # the name scripts/export.py once took
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a workdir (default: the newest).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "'byte', a tokenizer.json path or a "
                                 "transformers name; default: the model directory's tokenizer.json.")
_TASKS = flags.DEFINE_list("tasks", None, "lm-eval task names.", required=True)
_INCLUDE = flags.DEFINE_string("include_path", None, "Directory of extra task yamls.")
_LIMIT = flags.DEFINE_float("limit", None, "Examples per task (< 1: a fraction).")
_FEWSHOT = flags.DEFINE_integer("num_fewshot", None, "Few-shot examples (default: the task's).")
_BATCH = flags.DEFINE_string("batch_size", "1", "Rows per forward pass / generate call: an int, "
                             "'auto' (the largest that fits the device) or 'auto:N' (detected "
                             "again N times as requests shorten), as lm-eval reads it.")
_MAX_BATCH = flags.DEFINE_integer("max_batch_size", 64, "The largest batch 'auto' tries.")
_MAX_LEN = flags.DEFINE_integer("max_length", 2048, "Longest context scored (lm-eval's default).")
_OUT = flags.DEFINE_string("output_path", None, "Where lm-eval writes results (and samples).")
_SAMPLES = flags.DEFINE_bool("log_samples", False, "Also write per-sample outputs.")
_PRECISION = flags.DEFINE_enum(
    "matmul_precision", None, ["default", "fp8", "int8"],
    "Run the matmuls in this format (runtime.matmul_precision; default: the model's own). "
    "int8: weights quantized once per generate call, the state and recurrence float32.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of few-shot sampling and generation.")
# Multi-process jobs, as train.py takes them (mamba_train/parallel/distributed.py).
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Processes in the job (0 = detect).")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "This process's rank (-1 = detect).")
_INIT_TIMEOUT = flags.DEFINE_integer("init_timeout", 300, "Seconds to wait for all processes to join.")


def main(argv):
  del argv
  cli.must_exist(_MODEL.value, "--model")  # before lm-eval reads its thousands of task files
  from mamba_train.parallel import distributed  # pylint: disable=import-outside-toplevel
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           init_timeout=_INIT_TIMEOUT.value)
  except distributed.DistributedInitError as e:
    raise SystemExit(f"error: {e}") from None
  import jax  # pylint: disable=import-outside-toplevel

  import mamba_train  # pylint: disable=import-outside-toplevel
  from mamba_train.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  from mamba_train.interop import eval_harness  # pylint: disable=import-outside-toplevel
  from mamba_train.workdir import storage  # pylint: disable=import-outside-toplevel
  manager = eval_harness.task_manager(_INCLUDE.value, _TASKS.value)
  try:
    eval_harness.parse_batch_size(_BATCH.value)
    tasks = eval_harness.check_tasks(_TASKS.value, manager)  # before loading any weights
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  path = _MODEL.value
  if _STEP.value is not None:
    path = os.path.join(path, "checkpoints", str(_STEP.value))
  spec = _TOKENIZER.value or os.path.join(_MODEL.value, "tokenizer.json")  # a workdir may be gs://
  if not _TOKENIZER.value and not storage.path(spec).is_file():
    raise app.UsageError(f"{_MODEL.value} holds no tokenizer.json: pass --tokenizer")
  if storage.is_remote(spec):  # the tokenizers library reads local files
    spec = storage.local_copy(spec)
  kw = {} if _PRECISION.value is None else {"matmul_precision": _PRECISION.value}
  # The matmul weights cast to the compute dtype once, not in every forward: the same scores.
  model, mesh = mamba_train.load_model(path, **kw).for_inference(), None
  if jax.device_count() > 1:  # data-parallel: the weights on every device, the rows split
    from mamba_train.parallel.mesh import make_mesh  # pylint: disable=import-outside-toplevel
    mesh = make_mesh({"data": -1})
    model = eval_harness.on_mesh(model, mesh)
  main_process = jax.process_index() == 0
  if not main_process:  # the same tables and progress bars as process 0's
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
  lm = eval_harness.HarnessLM(model, load_tokenizer(spec),
                              batch_size=_BATCH.value, max_batch_size=_MAX_BATCH.value,
                              max_length=_MAX_LEN.value, mesh=mesh)
  results = eval_harness.run_tasks(lm, tasks, manager=manager, limit=_LIMIT.value,
                                   num_fewshot=_FEWSHOT.value, log_samples=_SAMPLES.value,
                                   seed=_SEED.value, env_info=main_process)
  if not main_process:
    return
  from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel
  print(make_table(results))
  if _OUT.value:
    from lm_eval.loggers import EvaluationTracker  # pylint: disable=import-outside-toplevel
    tracker = EvaluationTracker(output_path=_OUT.value)
    # As lm_eval's command line: files go under a directory named after the model.
    tracker.general_config_tracker.log_experiment_args(
        model_source="mamba_train",
        model_args=f"pretrained={path if storage.is_remote(path) else os.path.abspath(path)}",
        system_instruction=None, chat_template=None, fewshot_as_multiturn=False)
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    if _SAMPLES.value and samples:
      for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
  else:
    print(json.dumps(eval_harness.flat_metrics(results), indent=2))


if __name__ == "__main__":
  cli.run(main)
