"""Checks on a run config, made before anything is traced or compiled, so a
mistake costs a clear message rather than a compile and a stack trace, and the
`Plan` they resolve it into: what the trainer, the step builder, the loaders, the
harness and the resume check take, so that none of them parses the config again.

The keys themselves are defined (and documented) by configs/base.py; the entry
point passes that config here as the reference for unknown-key checks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Collection, Mapping

import ml_collections

from mamba_train.data import mixture
from mamba_train.errors import UserError
from mamba_train.model import lora as lora_lib
from mamba_train.model.config import FINETUNE_MAY_CHANGE, MOE, Mamba2Config
from mamba_train.model.params import param_shapes, weight_names
from mamba_train.model.runtime import Runtime
from mamba_train.parallel import sharding
from mamba_train.parallel.mesh import TPU_MIN_GATHER_PIECE, gathered_weights, resolve_mesh_shape
from mamba_train.train.balance import MoeSpec, spec_problems as moe_problems
from mamba_train.train.dpo import DpoSpec
from mamba_train.train.grpo import GrpoSpec
from mamba_train.train.optim import SCHEDULES, STATE_DTYPES

WANDB_MODES = ("online", "offline", "disabled")
OBJECTIVES = ("lm", "dpo", "grpo")
DATA_SOURCES = ("synthetic", "corpus")


class ConfigError(UserError, ValueError):
  pass


def _to_dict(c) -> dict:
  return c.to_dict() if hasattr(c, "to_dict") else dict(c)


@dataclasses.dataclass(frozen=True)
class GrpoPlan:
  """config.grpo resolved (objective 'grpo'): the loss's settings, the rollout's, the
  prompts file and the reward functions, loaded and checked against its fields."""
  spec: GrpoSpec
  prompts: str
  eval_fraction: float
  tokenizer: str
  reward_funcs: tuple  # rewards.RewardFunc, loaded
  num_generations: int
  prompts_per_step: int
  max_new_tokens: int
  temperature: float
  top_p: float
  top_k: int
  stop: tuple[str, ...]
  num_iterations: int
  eval_temperature: float

  @property
  def completions(self) -> int:
    """Completions a rollout makes: the rows of a GRPO step's batch."""
    return self.prompts_per_step * self.num_generations


def _unknown_keys(config: Mapping, reference: Mapping, prefix: str = "") -> list[str]:
  out = []
  for key, value in config.items():
    if key not in reference:
      out.append(prefix + key)
    elif key not in ("model", "runtime") and isinstance(value, Mapping) and isinstance(reference[key], Mapping):
      out += _unknown_keys(value, reference[key], f"{prefix}{key}.")
  return out


def model_config(config) -> Mamba2Config:
  """The model's frozen config from `config.model` (mamba_ssm field names)."""
  try:
    return Mamba2Config.from_dict(_to_dict(config["model"]))
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.model: {e}") from None


def runtime(config) -> Runtime:
  """How the model runs, from `config.runtime` (not yet resolved for a backend)."""
  try:
    return Runtime.from_dict(_to_dict(config["runtime"]))
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.runtime: {e}") from None


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# (key, test, what it must be): settings with which a run cannot train.
_OPTIM_RANGES = (
    ("lr", lambda v: v > 0, "a finite number > 0 (a zero or negative rate never learns)"),
    ("warmup_frac", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("decay_frac", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("final_lr_frac", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("eps", lambda v: v > 0, "> 0"),
    ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("clip_norm", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("spike_factor", lambda v: v == 0 or v > 1, "0 (off) or > 1"),
    ("spike_window", lambda v: isinstance(v, int) and v >= 1, "a positive integer"),
    ("weight_guard_factor", lambda v: v == 0 or v > 1, "0 (off) or > 1"),
    ("weight_guard_window", lambda v: isinstance(v, int) and v >= 1, "a positive integer"),
)


def _gather_split(mesh_cfg: Mapping, model: Mamba2Config | None, platform: str) -> dict:
  """`resolve_mesh_shape`'s split of data = fsdp = -1: on TPU, the model's large weights
  and the smallest piece of them XLA:TPU gathers well (`mesh.TPU_MIN_GATHER_PIECE`);
  elsewhere none (fsdp takes every device: no such rewrite is known on GPUs)."""
  if platform != "tpu" or model is None or not (mesh_cfg.get("data") == mesh_cfg.get("fsdp") == -1):
    return {}
  from mamba_train.train.state import param_shapes as abstract_params  # only for a TPU plan
  shapes = param_shapes(abstract_params(model))  # the shapes only: no array is made
  return dict(gathered=gathered_weights(shapes), min_piece=TPU_MIN_GATHER_PIECE)


def data_groups(mesh_cfg: Mapping, process_count: int) -> int:
  """How many sets of rows the processes load (`parallel.sharding.data_group`): the
  processes one sequence or tensor group spans over the network (dcn_sequence x
  dcn_tensor) read the same rows. Without dcn_* the layout is the devices' order,
  and the check assumes one set per process (what it refused before)."""
  shared = int(mesh_cfg.get("dcn_sequence", 1)) * int(mesh_cfg.get("dcn_tensor", 1))
  return process_count // shared if shared > 1 and process_count % shared == 0 else process_count


def _optim_problems(optim: Mapping) -> list[str]:
  out = [f"optim.{key} must be {what}, got {optim.get(key)!r}"
         for key, ok, what in _OPTIM_RANGES if not (_number(optim.get(key)) and ok(optim[key]))]
  n = optim.get("max_nonfinite_steps")
  if not isinstance(n, int) or n < -1:
    out.append(f"optim.max_nonfinite_steps must be -1 (auto), 0 (off) or a positive integer, got {n!r}")
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """A run config validated and resolved once, for the devices a run spans.

  `config` is the run config as given, frozen: the trainer reads its plain settings
  (steps, batch_size, optim, the periods) there and records it (`config_dict`); its
  model, runtime, mesh and data sections are read through the fields below.
  """

  config: ml_collections.FrozenConfigDict
  model: Mamba2Config
  runtime: Runtime  # resolved for `platform`
  platform: str  # of the devices the mesh spans ('cpu', 'gpu', 'tpu')
  mesh_shape: Mapping[str, int]  # {'data', 'fsdp', 'sequence', 'tensor'}: -1 filled, dcn_* multiplied in
  layout: str = "fsdp"  # config.layout resolved: a name of `sharding.LAYOUTS`
  # The datasets a corpus run reads and the mixture's weight schedule [(step, weights)].
  # A corpus run with neither data.dir nor data.mixture reads the default corpus,
  # prepared under `default_corpus` on first use (train/inputs.py); then `sources` is empty.
  sources: tuple[mixture.Source, ...] = ()
  schedule: tuple[tuple[int, tuple[float, ...]], ...] = ()
  default_corpus: str = ""
  lora: lora_lib.LoraSpec | None = None  # config.lora resolved for the model; None when off
  dpo: DpoSpec | None = None  # config.dpo when config.objective is 'dpo'
  grpo: GrpoPlan | None = None  # config.grpo when config.objective is 'grpo'
  moe: MoeSpec | None = None  # config.moe (router load balancing) when the model has 'E' layers
  # The peak learning rate the optimizer runs at (`learning_rate`): optim.lr, or lora.lr
  # with adapters. None: optim.lr (a Plan built by hand).
  lr: float | None = None
  # The config.model fields init_from replaced: {field: (the recipe's value, init_from's)}.
  model_from_init: Mapping[str, tuple] = dataclasses.field(default_factory=dict)

  @property
  def rules(self) -> tuple:
    """The logical-axis rules table of the run's layout."""
    return sharding.LAYOUTS[self.layout]

  def replace(self, **kw) -> "Plan":
    return dataclasses.replace(self, **kw)

  def config_dict(self) -> dict:
    """The run config as a plain dict, as config.json, checkpoints and the run record keep it."""
    return self.config.as_configdict().to_dict()


def validate(config, *, num_devices: int, process_count: int = 1, reference=None,
             platform: str | None = None, data_root: str = "data",
             init_model: Mamba2Config | None = None, explicit: Collection[str] = (),
             device_kind: str | None = None) -> Plan:
  """Raise ConfigError listing every problem found; return the run's `Plan`.

  `platform` is that of the devices the run's mesh spans (default: JAX's default
  backend, this host's), `device_kind` their kind as JAX reports it (default: this
  host's when platform is not given, else unknown); the runtime is resolved for them
  (`Runtime.resolve`). `data_root` is where a
  corpus run without data.dir or data.mixture prepares the default corpus.

  `init_model`: the architecture of config.init_from (`init_architecture`); it replaces
  config.model's fields (`model_from_init`) but those in `explicit`, the dotted keys the
  user set ('model.d_model', 'optim.lr': the command line's overrides), which must agree
  with it. `explicit` also says whether optim.lr was the user's (`learning_rate`)."""
  problems = []
  taken: dict[str, tuple] = {}
  if init_model is not None:
    config, taken, problems = model_from_init(config, init_model, explicit)
  cfg = _to_dict(config)
  # The keys and sizes; the model, its runtime and the mesh, each kept None when it fails.
  problems += _top_level_problems(cfg, reference)
  model = _attempt(problems, lambda: model_config(cfg))
  rt = _attempt(problems, lambda: runtime(cfg))
  if platform is None:
    import jax  # only here: planning for this host is the one case that asks it
    platform = jax.default_backend()
    device_kind = jax.devices()[0].device_kind if device_kind is None else device_kind
  mesh = _attempt(problems, lambda: resolve_mesh_shape(cfg["mesh"], num_devices,
                                                       **_gather_split(cfg["mesh"], model, platform)), ValueError)
  # How the batch and the sequence divide over the devices.
  optim = cfg["optim"]
  accum = optim.get("grad_accum", 1)
  if not isinstance(accum, int) or accum < 1:
    problems.append(f"optim.grad_accum must be a positive integer, got {accum!r}")
    accum = 1
  grpo, grpo_problems = _grpo(cfg)
  if mesh is not None and grpo is not None:  # a GRPO step's rows are its completions
    problems += _layout_problems({**cfg, "batch_size": grpo.completions}, model, mesh, accum, process_count,
                                 rows="grpo.prompts_per_step x num_generations")
    if mesh["sequence"] > 1:
      problems.append("objective='grpo' needs mesh.sequence = 1 (rollouts decode one token at a time)")
  elif mesh is not None and isinstance(cfg.get("batch_size"), int):
    problems += _layout_problems(cfg, model, mesh, accum, process_count)
  layout = None
  if mesh is not None and model is not None:
    layout = _attempt(problems, lambda: sharding.resolve_layout(cfg.get("layout", "auto"), mesh, model.d_model,
                                                               bool(model.count(MOE))), ValueError)
  # The optimizer, the adapters, the periods and the named choices.
  problems += _optim_problems(optim)
  lora_lr = cfg.get("lora", {}).get("lr", 0.0)
  if not (_number(lora_lr) and lora_lr >= 0):
    problems.append(f"lora.lr must be a finite number >= 0 (0 = optim.lr), got {lora_lr!r}")
  lora = None
  if model is not None and "lora" in cfg:
    lora = _attempt(problems, lambda: _lora(cfg["lora"], model), lora_lib.LoraError)
  problems += _period_problems(cfg)
  problems += _profile_problems(cfg.get("profile", {}), process_count)
  problems += _choice_problems(cfg)
  # The objective, the experts' balance, the data mixture and the harness.
  dpo, dpo_problems = _dpo(cfg)
  problems += dpo_problems + grpo_problems
  moe, moe_bad = _moe(cfg, model)
  problems += moe_bad
  if moe is not None:
    # The capacity is how the layers dispatch, so it travels in the runtime the model takes.
    rt = rt and rt.replace(moe_capacity_factor=float(cfg.get("moe", {}).get("capacity_factor") or 0.0))
  mixture_problems, sources, schedule = _mixture(cfg["data"])
  problems += mixture_problems
  harness = cfg.get("harness", {})
  if harness.get("tasks") and harness.get("every", 0) > 0:
    if cfg["data"].get("source") != "corpus":
      problems.append("harness.tasks needs data.source='corpus' (its tokenizer)")
  if problems:
    if len(problems) == 1:  # one line
      raise ConfigError(f"Invalid run config: {problems[0]}")
    raise ConfigError("Invalid run config:\n  - " + "\n  - ".join(problems))

  # Resolved: the data to read, the platform, the runtime for it.
  default_corpus = ""
  if cfg["data"]["source"] == "corpus" and not sources:
    if cfg["data"].get("dir"):
      sources = (mixture.Source(cfg["data"]["dir"], 1.0),)
    else:
      default_corpus = data_root
  rt = rt.resolve(platform, device_kind)
  if lora is not None:  # see LoraSpec.packed_int4 and .frozen_dtype
    lora = lora.replace(packed_int4=platform != "cpu",
                        frozen_dtype="" if rt.compute_dtype == "float32" else rt.compute_dtype)
  return Plan(config=ml_collections.FrozenConfigDict(config), model=model,
              runtime=rt, platform=platform, mesh_shape=mesh, layout=layout,
              sources=sources, schedule=schedule, default_corpus=default_corpus, lora=lora,
              dpo=dpo, grpo=grpo, moe=moe, lr=learning_rate(cfg, explicit), model_from_init=taken)


def learning_rate(cfg: Mapping, explicit: Collection[str] = ()) -> float:
  """The peak learning rate a run's optimizer takes.

  Adapters start at zero and move only themselves, so they take a much higher rate than a
  full finetune: the SFT and DPO recipes set one (lora.lr) beside their full-finetune
  optim.lr, as TRL's and the alignment-handbook's LoRA recipes carry their own
  learning_rate. With lora.rank > 0 the run takes lora.lr, unless it is 0 (then optim.lr)
  or the user set optim.lr and not lora.lr (`explicit`): as TRL's one learning_rate, the
  rate a user gives is the rate the run takes."""
  optim_lr, lora_cfg = float(cfg["optim"]["lr"]), cfg.get("lora", {})
  lora_lr = float(lora_cfg.get("lr", 0.0) or 0.0)
  if not lora_cfg.get("rank") or not lora_lr or ("optim.lr" in explicit and "lora.lr" not in explicit):
    return optim_lr
  return lora_lr


def init_architecture(path: str) -> Mamba2Config | None:
  """The architecture of the weights at `path` (config.init_from: a workdir, a checkpoint
  step, a transformers or mamba_ssm directory), read from its config alone; None for ''."""
  if not path:
    return None
  from mamba_train.interop.load import load_config  # the checkpoint and outside layouts' stack
  try:
    return load_config(path)
  except (OSError, ValueError, KeyError) as e:
    raise ConfigError(f"init_from {path!r}: {e}") from None


def model_from_init(config, init_model: Mamba2Config, explicit: Collection[str] = ()):
  """-> (a copy of `config` whose model is `init_model`'s, {field: (the recipe's value,
  init_model's)} for each field replaced, problems).

  A recipe's model fields are a default, written for the size it names: the weights a run
  starts from say what they are (as transformers', TRL's and Levanter's from_pretrained).
  The fields the user set (`explicit`) stay; one the weights depend on and init_from
  contradicts is a problem (chunk_size and the init-only fields may differ). The
  FINETUNE_MAY_CHANGE fields stay the recipe's: a run may change them from the model it
  starts from (configs/window.py learns a window on an exact model)."""
  plain = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v  # a ConfigDict's tuple, to_dict's list
  recipe = {k: plain(v) for k, v in _to_dict(config["model"]).items()}
  theirs = {k: plain(v) for k, v in init_model.to_dict().items()}
  mine = {k[len("model."):] for k in explicit if k.startswith("model.")}
  new = {k: recipe[k] if (k in mine or k in FINETUNE_MAY_CHANGE) and k in recipe else v for k, v in theirs.items()}
  taken = {k: (recipe.get(k), v) for k, v in new.items() if recipe.get(k) != v}
  try:
    differ = Mamba2Config.from_dict(new).weight_differences(init_model, init=False)
  except (TypeError, ValueError) as e:
    return config, {}, [f"config.model with init_from {config['init_from']!r}'s architecture: {e}"]
  problems = [] if not differ else [
      ", ".join(f"config.model.{k}={ours!r}" for k, (ours, _) in differ.items())
      + f" on the command line contradict{'s' if len(differ) == 1 else ''} init_from {config['init_from']!r}, "
      "whose model has " + ", ".join(f"{k}={theirs!r}" for k, (_, theirs) in differ.items())
      + f": drop {'it' if len(differ) == 1 else 'them'} (the run takes init_from's architecture) or start "
      "from other weights"]
  out = ml_collections.ConfigDict(_to_dict(config))  # a copy: the caller's config stays as given
  for k in taken:
    out.model[k] = new[k]
  return out, taken, problems


def _attempt(problems: list[str], make, errors=ConfigError):
  """`make()`, or None with its error's message added to `problems`."""
  try:
    return make()
  except errors as e:
    problems.append(str(e))
    return None


def _top_level_problems(cfg: Mapping, reference) -> list[str]:
  problems = []
  if reference is not None:
    unknown = _unknown_keys(cfg, _to_dict(reference))
    if unknown:
      problems.append(f"unknown config keys {unknown} (the keys are those of configs/base.py)")
  for key in ("steps", "batch_size", "seq_len"):
    if not isinstance(cfg.get(key), int) or cfg[key] < 1:
      problems.append(f"{key} must be a positive integer, got {cfg.get(key)!r}")
  return problems


def _layout_problems(cfg: Mapping, model: Mamba2Config | None, mesh: Mapping[str, int], accum: int,
                     process_count: int, rows: str = "batch_size") -> list[str]:
  """The batch over the data-parallel devices and the processes' data groups, the
  experts over the expert axis, the length over the sequence axis."""
  problems = []
  dp = mesh["data"] * mesh["fsdp"] * mesh["expert"]
  b = cfg["batch_size"]
  if b % (dp * accum):
    problems.append(
        f"{rows} {b} does not divide over the data-parallel devices: data x fsdp x expert = "
        f"{mesh['data']} x {mesh['fsdp']} x {mesh['expert']} = {dp}"
        + (f" times optim.grad_accum {accum}" if accum > 1 else "") + f"; use a multiple of {dp * accum}")
  if model is not None and mesh["expert"] > 1 and (
      not model.count("E") or model.n_routed_experts % mesh["expert"]):
    problems.append(f"mesh.expert = {mesh['expert']} splits the experts of mixture-of-experts layers: "
                    f"the model needs 'E' layers whose n_routed_experts ({model.n_routed_experts}) "
                    f"it divides")
  sp, l = mesh["sequence"], cfg.get("seq_len")
  if isinstance(l, int) and model is not None and (l % sp or l // sp < model.d_conv - 1):
    problems.append(f"seq_len {l} must split over mesh.sequence = {sp} devices into equal slices "
                    f"of at least d_conv - 1 = {model.d_conv - 1} positions")
  groups = data_groups(cfg["mesh"], process_count)
  if b % groups:
    problems.append(f"{rows} {b} does not divide over the {groups} data groups of the "
                    f"{process_count} processes (processes that dcn_sequence or dcn_tensor "
                    f"spans share rows); use a multiple of {groups}")
  return problems


def _period_problems(cfg: Mapping) -> list[str]:
  """The steps between logs, evaluations and saves, and the checkpoint tiers."""
  problems = []
  if cfg["optim"].get("spike_factor", 0) and cfg.get("checkpoint_every") == 0:
    problems.append("optim.spike_factor needs checkpoint_every > 0 (it rolls back to a checkpoint)")
  for key in ("log_every", "eval_every", "checkpoint_every", "checkpoint_keep", "eval_batches"):
    if not isinstance(cfg.get(key), int) or cfg[key] < 0:
      problems.append(f"{key} must be an integer >= 0 (0 turns it off), got {cfg.get(key)!r}")
  return problems + _tier_problems(cfg.get("checkpoint", {}))


def profile_processes(spec: str, process_count: int) -> tuple[int, ...]:
  """config.profile.processes ('0', '0,3', 'all') as process indices; ValueError when bad."""
  if str(spec).strip() == "all":
    return tuple(range(process_count))
  try:
    ids = tuple(sorted({int(p) for p in str(spec).split(",")}))
  except ValueError:
    raise ValueError(f"profile.processes must be 'all' or process indices separated by commas, "
                     f"got {spec!r}") from None
  if any(not 0 <= i < process_count for i in ids):
    raise ValueError(f"profile.processes {spec!r} names a process the job does not have "
                     f"(it has {process_count}: 0..{process_count - 1})")
  return ids


def _profile_problems(profile: Mapping, process_count: int) -> list[str]:
  problems = [f"profile.{key} must be an integer >= 0, got {profile.get(key)!r}"
              for key in ("start_step", "num_steps")
              if key in profile and (not isinstance(profile[key], int) or profile[key] < 0)]
  if profile.get("num_steps"):
    try:
      profile_processes(profile.get("processes", "0"), process_count)
    except ValueError as e:
      problems.append(str(e))
  return problems


def _choice_problems(cfg: Mapping) -> list[str]:
  """The settings that name one of a few choices."""
  optim = cfg["optim"]
  choices = (("optim.schedule", optim.get("schedule"), SCHEDULES),
             ("optim.state_dtype", optim.get("state_dtype"), STATE_DTYPES),
             ("wandb.mode", cfg["wandb"].get("mode"), WANDB_MODES),
             ("data.source", cfg["data"].get("source"), DATA_SOURCES))
  return [f"{key} must be one of {allowed}, got {value!r}" for key, value, allowed in choices
          if value not in allowed]


def _moe(cfg: Mapping, model: Mamba2Config | None) -> tuple[MoeSpec | None, list[str]]:
  """The experts' load balancing when the model has 'E' layers (None otherwise or on a problem)."""
  if model is None or not model.count("E"):
    return None, []
  moe_cfg = cfg.get("moe", {})
  bad = moe_problems(moe_cfg)
  if bad:
    return None, bad
  # The bias update moves the sigmoid router's e_score_correction_bias; a softmax router
  # (GraniteMoeHybrid) has none, so the rate means nothing there and the default 1e-3
  # must not stop a Granite finetune: its balance comes from aux_loss_coef.
  rate = float(moe_cfg["bias_update_rate"]) if model.moe_router_score_function == "sigmoid" else 0.0
  return MoeSpec(float(moe_cfg["aux_loss_coef"]), rate), []


def _tier_problems(tiers: Mapping) -> list[str]:
  every, where = tiers.get("local_every", 0), tiers.get("local_dir", "")
  if not isinstance(every, int) or isinstance(every, bool) or every < 0:
    return [f"checkpoint.local_every must be an integer >= 0 (0 turns it off), got {every!r}"]
  if not isinstance(where, str):
    return [f"checkpoint.local_dir must be a path, got {where!r}"]
  if bool(every) != bool(where):
    return ["checkpoint.local_dir and checkpoint.local_every go together: set both (a directory on "
            "each host's own disk, and the steps between local saves) or neither"]
  if "://" in where:
    return [f"checkpoint.local_dir {where!r} must be a directory on each host's own disk; a bucket "
            "is the persistent tier (--workdir)"]
  return []


def _dpo(cfg: Mapping) -> tuple[DpoSpec | None, list[str]]:
  objective = cfg.get("objective", "lm")
  if objective not in OBJECTIVES:
    return None, [f"objective must be one of {OBJECTIVES}, got {objective!r}"]
  if objective != "dpo":
    return None, []
  d, data, problems = cfg.get("dpo", {}), cfg["data"], []
  beta, ls = d.get("beta"), d.get("label_smoothing")
  if not (_number(beta) and beta > 0):
    problems.append(f"dpo.beta must be a number > 0, got {beta!r}")
  if not (_number(ls) and 0 <= ls < 0.5):
    problems.append(f"dpo.label_smoothing must be in [0, 0.5), got {ls!r}")
  if data.get("source") != "corpus" or not data.get("dir") or data.get("mixture"):
    problems.append("objective='dpo' reads one preference set: set data.source='corpus' and data.dir "
                    "to a directory from scripts/prepare_data.py --preference (no data.mixture)")
  if not data.get("use_seq_idx", True):
    problems.append("objective='dpo' needs data.use_seq_idx=True: it keeps a row's chosen and "
                    "rejected responses apart")
  return (DpoSpec(float(beta), float(ls)) if not problems else None), problems


def _grpo(cfg: Mapping) -> tuple[GrpoPlan | None, list[str]]:
  """config.grpo for objective 'grpo': the sizes and choices, then the prompts file read
  (every row checked) and the reward functions imported and checked against its fields."""
  if cfg.get("objective") != "grpo":
    return None, []
  from mamba_train.data import prompts as prompts_lib  # only a GRPO run reads them
  from mamba_train.train import rewards
  g, problems = cfg.get("grpo", {}), []
  ints = (("num_generations", 2, "a group needs at least two completions to compare"),
          ("prompts_per_step", 1, ""), ("max_new_tokens", 1, ""), ("num_iterations", 1, ""), ("top_k", 0, "0 = off"))
  for key, least, why in ints:
    v = g.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
      problems.append(f"grpo.{key} must be an integer >= {least}{f' ({why})' if why else ''}, got {v!r}")
  reals = (("temperature", lambda v: v > 0, "> 0 (GRPO samples its completions)"),
           ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"), ("eval_fraction", lambda v: 0 <= v < 1, "in [0, 1)"),
           ("eval_temperature", lambda v: v >= 0, ">= 0 (0 = greedy)"), ("beta", lambda v: v >= 0, ">= 0"),
           ("is_min", lambda v: v >= 0, ">= 0"), ("is_max", lambda v: v > 0, "> 0"))
  for key, ok, what in reals:
    if not (_number(g.get(key)) and ok(g[key])):
      problems.append(f"grpo.{key} must be {what}, got {g.get(key)!r}")
  spec = None
  if not problems:
    try:
      spec = GrpoSpec(loss_type=g["loss_type"], epsilon_low=float(g["epsilon_low"]),
                      epsilon_high=float(g["epsilon_high"]), beta=float(g["beta"]),
                      scale_rewards=g["scale_rewards"], sampler_is=g["sampler_is"],
                      is_min=float(g["is_min"]) or None, is_max=float(g["is_max"]),
                      max_completion_length=int(g["max_new_tokens"]))
    except (TypeError, ValueError) as e:
      problems.append(str(e))
  funcs, fields = (), None
  if not g.get("prompts"):
    problems.append("objective='grpo' needs grpo.prompts: a .jsonl file of {\"prompt\": ...} rows "
                    "(configs/grpo.py shows one)")
  else:
    try:
      fields = sorted({k for row in prompts_lib.read_prompts(g["prompts"]) for k in row.fields})
    except prompts_lib.PromptFormatError as e:
      problems.append(str(e))
  try:
    funcs = tuple(rewards.load_reward_funcs(g.get("reward_funcs", "")))
    if fields is not None:
      rewards.check_fields(funcs, fields)
  except rewards.RewardError as e:
    problems.append(str(e))
  if problems:
    return None, problems
  stop = tuple(s for s in g["stop"].split("|") if s) if g.get("stop") else ()
  return GrpoPlan(spec=spec, prompts=g["prompts"], eval_fraction=float(g["eval_fraction"]),
                  tokenizer=g["tokenizer"], reward_funcs=funcs, num_generations=g["num_generations"],
                  prompts_per_step=g["prompts_per_step"], max_new_tokens=g["max_new_tokens"],
                  temperature=float(g["temperature"]), top_p=float(g["top_p"]), top_k=g["top_k"], stop=stop,
                  num_iterations=g["num_iterations"], eval_temperature=float(g["eval_temperature"])), []


def _lora(c: Mapping, model: Mamba2Config) -> lora_lib.LoraSpec | None:
  return lora_lib.spec_from_config(dict(c), weight_names(model))


def _mixture(data: Mapping) -> tuple[list[str], tuple[mixture.Source, ...], tuple]:
  """(problems, sources, weight schedule) of `data.mixture` (no sources without one)."""
  if not data.get("mixture"):
    return ([f"data.mixture_schedule {data['mixture_schedule']!r} needs a data.mixture"]
            if data.get("mixture_schedule") else []), (), ()
  problems, sources, schedule = [], (), ()
  if data.get("source") != "corpus" or data.get("dir"):
    problems.append("data.mixture needs data.source='corpus' and no data.dir")
  try:
    sources = tuple(mixture.parse_mixture(data["mixture"]))
    schedule = tuple((step, tuple(w)) for step, w in
                     mixture.parse_schedule(data.get("mixture_schedule", ""), len(sources)))
  except mixture.MixtureError as e:
    problems.append(str(e))
  return problems, sources, schedule
