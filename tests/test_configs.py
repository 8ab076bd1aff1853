"""Run configs: every file loads and validates, the size recipes are as documented,
and each config mistake gives its message before anything compiles."""

import importlib.util
import os
import subprocess
import sys

import ml_collections
import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT))

from configs import base  # noqa: E402
from mamba_train import SIZES  # noqa: E402
from mamba_train.train.run_config import ConfigError, validate  # noqa: E402

CONFIGS = ["base", "tiny", "130m", "370m", "780m", "1.3b", "2.7b", "finetune", "long_context",
           "window", "tiny-hybrid", "1.3b-hybrid", "2.7b-hybrid", "tiny-mamba3", "mamba3-1.5b"]
CONTRACT = ["steps", "batch_size", "seq_len", "seed", "log_every", "eval_every", "checkpoint_every",
            "model", "optim", "data", "mesh", "wandb", "init_from"]


def load(name) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_validates(name):
  c = load(name)
  assert all(k in c for k in CONTRACT)
  plan = validate(c, num_devices=8, reference=base.get_config())
  m = plan.mesh_shape
  assert m["data"] * m["fsdp"] * m["sequence"] * m["tensor"] == 8
  assert c.wandb.mode == "offline"


@pytest.mark.parametrize("size", ["130m", "370m", "780m", "1.3b", "2.7b"])
def test_size_recipes(size):
  c = load(size)
  plan = validate(c, num_devices=1, reference=base.get_config())
  m = plan.model
  assert {k: getattr(m, k) for k in SIZES[size]} == SIZES[size]
  assert (m.d_state, m.headdim, m.expand, m.chunk_size, m.padded_vocab_size) == (128, 64, 2, 256, 50288)
  assert plan.runtime.compute_dtype == "bfloat16"
  o = c.optim
  assert (o.b1, o.b2, o.weight_decay, o.clip_norm, o.schedule, o.final_lr_frac) == (
      0.9, 0.95, 0.1, 1.0, "cosine", 0.1)
  gpt3 = {"130m": 6e-4, "370m": 3e-4, "780m": 2.5e-4, "1.3b": 2e-4, "2.7b": 1.6e-4}[size]
  assert o.lr == pytest.approx(5 * gpt3)
  assert c.seq_len == 2048 and c.batch_size * c.seq_len == 2**19  # 0.5M tokens per step


def test_recipe_mesh_keeps_tpu_gathers_whole():
  """data = fsdp = -1 (the size recipes): fsdp as large as keeps the large weights' bf16
  pieces at 128 KiB a device or more, on TPU only. Checked against the pieces by hand:
  1.3b's out_proj (4096, 2048) is 64 KiB a device at fsdp 256 (decomposed), 128 KiB at
  128; 2.7b's (5120, 2560) 100 KiB at 256 (gathered whole, but the step counts more), 200 at 128."""
  from mamba_train.parallel.mesh import gathered_weights
  c = load("1.3b")
  c.batch_size = 512
  tpu = dict(reference=base.get_config(), platform="tpu", device_kind="TPU v6 lite")
  shape = lambda cfg, n, **kw: {a: s for a, s in validate(cfg, num_devices=n, **kw).mesh_shape.items()
                                if a in ("data", "fsdp")}
  assert 2 * 4096 * 2048 / 256 == 64 * 1024
  assert shape(c, 256, **tpu) == {"data": 2, "fsdp": 128}  # v6e-256
  assert shape(c, 512, **tpu) == {"data": 4, "fsdp": 128}  # tpu7x-512 (a device a TensorCore)
  assert shape(c, 64, **tpu) == {"data": 1, "fsdp": 64}  # v5p-128: unchanged
  gpu = dict(reference=base.get_config(), platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  assert shape(c, 256, **gpu) == {"data": 1, "fsdp": 256}  # no such rewrite known on GPUs
  c.mesh.fsdp = 256  # one axis given: the other fills, as before
  assert shape(c, 256, **tpu) == {"data": 1, "fsdp": 256}
  # The weights it keeps whole: the embedding, z|x and out_proj (97% of the bytes), not B|C or dt.
  shapes = {"embedding": (50288, 2048), "layers/in_proj_zx": (48, 2048, 2, 4096),
            "layers/out_proj": (48, 4096, 2048), "layers/in_proj_bc": (48, 2048, 2, 128),
            "layers/in_proj_dt": (48, 2048, 64), "layers/norm": (48, 2048), "norm_f": (2048,)}
  assert gathered_weights(shapes) == [2 * 50288 * 2048, 2 * 2048 * 2 * 4096, 2 * 4096 * 2048]
  c27 = load("2.7b")
  c27.batch_size = 512
  assert shape(c27, 256, **tpu) == {"data": 2, "fsdp": 128}


def _errors(config, **kw):
  with pytest.raises(ConfigError) as e:
    validate(config, reference=base.get_config(), **kw)
  return str(e.value)


def test_unknown_keys_error():
  c = base.get_config()
  c.unlock()
  c.stpes = 10
  c.optim.learning_rate = 1.0
  msg = _errors(c, num_devices=1)
  assert "unknown config keys ['optim.learning_rate', 'stpes']" in msg
  c = base.get_config()
  c.model.unlock()
  c.model.d_modle = 5
  assert "Unknown Mamba2Config fields ['d_modle']" in _errors(c, num_devices=1)


def test_locked_config_rejects_new_keys():
  c = load("tiny")
  with pytest.raises(AttributeError):
    c.stpes = 10


def test_batch_not_divisible_error():
  c = base.get_config()
  c.batch_size = 6
  c.mesh.update(data=2, fsdp=2, tensor=2)
  msg = _errors(c, num_devices=8)
  assert "batch_size 6 does not divide over the data-parallel devices: data x fsdp x expert = 2 x 2 x 1 = 4" in msg
  c.batch_size = 4
  c.optim.grad_accum = 2
  assert "times optim.grad_accum 2; use a multiple of 8" in _errors(c, num_devices=8)


def test_mesh_mismatch_errors():
  c = base.get_config()
  c.mesh.update(data=2, fsdp=2, tensor=1)
  assert "spans data*fsdp*expert*sequence*tensor = 4 devices, but 8 devices are present" in _errors(c, num_devices=8)
  c.mesh.update(data=-1, fsdp=3, tensor=1)
  assert "do not divide the 8 devices" in _errors(c, num_devices=8)
  c.mesh.update(data=-1, fsdp=1, sequence=-1, tensor=1)
  assert "only one axis may be -1" in _errors(c, num_devices=8)


def test_seq_len_must_split_over_sequence_axis():
  c = base.get_config()
  c.mesh.update(data=2, fsdp=1, sequence=4, tensor=1)
  c.seq_len = 2050
  assert "seq_len 2050 must split over mesh.sequence = 4 devices" in _errors(c, num_devices=8)
  c.seq_len = 8  # slices of 2 positions: shorter than the conv halo (d_conv - 1 = 3)
  assert "slices of at least d_conv - 1 = 3 positions" in _errors(c, num_devices=8)
  c.seq_len = 2048
  assert validate(c, num_devices=8, reference=base.get_config()).mesh_shape["sequence"] == 4
  c.mesh.update(data=2, sequence=2, dcn_sequence=2)  # across two processes: 2 x 2 per host
  assert validate(c, num_devices=8, process_count=2,
                  reference=base.get_config()).mesh_shape["sequence"] == 4


def test_bad_choices_error():
  c = base.get_config()
  c.optim.schedule = "linear"
  c.wandb.mode = "on"
  msg = _errors(c, num_devices=1)
  assert "optim.schedule must be one of" in msg and "wandb.mode must be one of" in msg


def _train(*args, devices=1):
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
         "JAX_PLATFORMS": "cpu", "WANDB_MODE": "disabled"}
  return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_unknown_command_line_key_errors():
  from absl import flags
  from ml_collections import config_flags
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", os.path.join(ROOT, "configs", "tiny.py"), flag_values=fv)
  for typo in ("--config.stpes=3", "--config.optim.lrr=1e-3"):
    with pytest.raises(flags.UnrecognizedFlagError, match=typo[2:].split("=")[0]):
      fv(["train.py", typo])


def test_command_line_errors_before_compiling(tmp_path):
  proc = _train("--workdir", str(tmp_path), "--config.batch_size=6", devices=4)
  assert proc.returncode != 0
  assert "batch_size 6 does not divide over the data-parallel devices" in proc.stderr
  assert "compiled" not in proc.stderr


def test_runtime_fields_change_no_weights():
  """train.py resumes and finetunes across every Runtime field and the config fields in
  NOT_IN_WEIGHTS: none may change a parameter shape."""
  import dataclasses

  import jax
  from flax import nnx

  from mamba_train import Mamba2LM, Runtime, config_for
  from mamba_train.model.config import NOT_IN_WEIGHTS
  shapes = lambda cfg, rt: jax.tree.map(lambda a: a.shape, nnx.state(
      nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)), nnx.Param))
  cfg, rt = config_for("tiny-hybrid"), Runtime()
  other = {"compute_dtype": "bfloat16", "remat": "full", "ssd_form": "parallel",
           "scan_chunk_size": 16, "parallel_chunk_size": 32, "attention": "dot_product",
           "interpret": True, "ssd_impl": "mosaic", "unroll_layers": True,
           "decode_layers": "scan", "matmul_precision": "int8", "layer_impl": "triton",
           "moe_capacity_factor": 1.25, "moe_impl": "megablox", "decode_impl": "mosaic"}
  assert set(other) == {f.name for f in dataclasses.fields(Runtime)}
  for name, value in other.items():
    assert shapes(cfg, rt.replace(**{name: value})) == shapes(cfg, rt), name
  assert NOT_IN_WEIGHTS == ("chunk_size",)
  assert shapes(cfg.replace(chunk_size=32), rt) == shapes(cfg, rt)


def test_weight_differences_name_each_field_in_the_callers_order():
  """The one check behind the resume refusal and init_from's: NOT_IN_WEIGHTS never
  counts, the initialization-only fields only with init=True; (self, other) order."""
  from mamba_train import config_for
  a = config_for("tiny")
  assert a.weight_differences(a.replace(chunk_size=32)) == {}
  b = a.replace(d_model=128, dt_min=0.01, dt_limit=(0.0, 1.0))
  assert a.weight_differences(b) == {"d_model": (256, 128), "dt_min": (0.001, 0.01),
                                     "dt_limit": ([0.0, float("inf")], [0.0, 1.0])}
  assert b.weight_differences(a, init=False) == {"d_model": (128, 256),
                                                 "dt_limit": ([0.0, 1.0], [0.0, float("inf")])}


@pytest.mark.parametrize("backend, chunk, want", [
    ("cpu", 256, ("scan", 64)), ("cpu", 32, ("scan", 32)),
    ("gpu", 256, ("triton", 128)), ("tpu", 64, ("mosaic", 64))])
def test_ssd_plan_per_backend(monkeypatch, backend, chunk, want):
  """The form and chunk the SSD runs at, resolved for the target backend whatever
  backend Python runs on: the scan form (CPU) capped by scan_chunk_size, the
  Pallas kernels (TPU, GPU) or the parallel form (asked for) by
  parallel_chunk_size. Unresolved, the model resolves for JAX's default backend."""
  import jax
  from flax import nnx

  from mamba_train import Mamba2LM, Runtime, config_for
  rt = Runtime()
  assert rt.resolve(backend).ssd_plan(chunk) == want
  xla = rt.replace(ssd_impl="xla")
  assert xla.replace(ssd_form="parallel").resolve(backend).ssd_plan(chunk) == ("parallel", min(chunk, 128))
  assert xla.replace(ssd_form="scan", scan_chunk_size=16).ssd_plan(chunk) == ("scan", 16)
  assert rt.replace(ssd_impl="interpret").resolve(backend).ssd_plan(chunk) == ("mosaic", min(chunk, 128))
  with pytest.raises(ValueError, match="not resolved"):
    rt.ssd_plan(chunk)
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  model = nnx.eval_shape(lambda: Mamba2LM(config_for("tiny", chunk_size=chunk), rngs=nnx.Rngs(0)))
  assert model.runtime.ssd_plan(chunk) == want


def test_the_configuration_guide_shows_the_selection_table_and_every_old_spelling():
  """docs/configuration.md's table of implementations is the selection table's own
  (`table.markdown`), and it names every old spelling the runtime still reads."""
  from mamba_train.model.runtime import ALIASES, FIELD_ALIASES, Runtime
  from mamba_train.ops import table

  from helpers import ROOT
  readme = (ROOT / "docs" / "configuration.md").read_text()
  assert table.markdown() in readme
  for field, old in ALIASES.items():
    for value, (name, interpret) in old.items():
      assert f"`{value}`" in readme, (field, value)
      rt = Runtime(**{field: value})
      assert (getattr(rt, field), rt.interpret) == (name, interpret)
  for old, new in FIELD_ALIASES.items():
    assert f"`runtime.{old}`" in readme
    assert Runtime.from_dict({old: True}).interpret


def test_old_runtime_spellings_run_from_the_command_line_and_a_saved_config():
  """`--config.runtime.pallas_interpret=true` and old implementation names still build the runtime."""
  from configs import base
  from mamba_train.train import run_config
  c = base.get_config()
  c.runtime.pallas_interpret = True
  c.runtime.ssd_impl = "triton_interpret"
  c.runtime.moe_impl = "ragged"
  rt = run_config.runtime(c)
  assert (rt.interpret, rt.ssd_impl, rt.moe_impl) == (True, "triton", "xla")


def test_init_from_supplies_the_architecture_but_not_what_the_user_set():
  """A recipe's model fields are a default: init_from's replace them (named in the plan,
  which the run's line prints), but for ssd_window (the run's own) and the fields set on the
  command line, which init_from must not contradict where the weights depend on them."""
  from mamba_train import Mamba2Config, config_for
  small = config_for("tiny", vocab_size=257).replace(dt_limit=(0.0, 1.0))
  c = load("window")  # written for 130m, with a window of its own
  c.init_from = "runs/tiny"
  plan = validate(c, num_devices=8, init_model=small)
  assert plan.model == small.replace(ssd_window=1024) == Mamba2Config.from_dict(plan.config.model.to_dict())
  assert plan.model_from_init["d_model"] == (768, 256) and "ssd_window" not in plan.model_from_init
  assert c.model.d_model == 768  # the caller's config stays as given
  for name in ("sft", "finetune"):
    r = load(name)
    r.init_from = "runs/tiny"
    assert validate(r, num_devices=8, init_model=small).model == small
  # Set on the command line: kept, when the weights allow it (chunk_size is in no weight).
  c.model.chunk_size, c.model.d_model = 64, 256
  plan = validate(c, num_devices=8, init_model=small, explicit={"model.chunk_size": 64, "model.d_model": 256})
  assert plan.model == small.replace(ssd_window=1024, chunk_size=64) and "d_model" not in plan.model_from_init
  c.model.d_model, c.model.n_layer = 128, 4
  with pytest.raises(ConfigError, match=r"config.model.d_model=128 on the command line contradicts init_from "
                     r"'runs/tiny', whose model has d_model=256: drop it"):
    validate(c, num_devices=8, init_model=small, explicit={"model.d_model": 128, "model.n_layer": 4})


def test_adapters_take_the_recipes_adapter_rate():
  """With lora.rank > 0 the SFT and DPO recipes train at their lora.lr; a rate the user
  gives (lora.lr, or optim.lr alone, as TRL's one learning_rate) is the one taken."""
  from mamba_train.train.run_config import learning_rate
  dpo, sft, tiny = load("dpo").to_dict(), load("sft").to_dict(), load("tiny").to_dict()
  assert learning_rate(dpo) == 5e-7 and learning_rate(sft) == 2e-5  # full finetunes
  for c in (dpo, sft, tiny):
    c["lora"]["rank"] = 4
  assert learning_rate(dpo) == 5e-5 and learning_rate(sft) == 2e-4 and learning_rate(tiny) == 3e-3
  dpo["optim"]["lr"], dpo["lora"]["lr"] = 1e-5, 1e-4
  assert learning_rate(dpo, {"optim.lr": 1e-5}) == 1e-5
  assert learning_rate(dpo, {"optim.lr": 1e-5, "lora.lr": 1e-4}) == learning_rate(dpo, {"lora.lr": 1e-4}) == 1e-4
