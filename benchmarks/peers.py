"""The models --compare times beside ours, on the same shapes with random weights:
transformers' PyTorch Mamba2 (its CPU path) and the pure-JAX mamba2-jax. Both are
optional (`pip install -e '.[bench]'`); without them the benchmarks run ours only.

Both are built from `mamba_train.interop.hf_mamba2.ours_to_hf_config`, the one
place that knows transformers' config keys (mamba2-jax takes the same names), at
the chunk our model runs with (`Runtime.ssd_plan`: 64 on CPU), which is also
their fastest forward+backward on a CPU (see the ssd chunk sweep).
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from benchmarks.common import CORES, log, median_time
from mamba_train.interop.hf_mamba2 import ours_to_hf_config


def have_torch() -> bool:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    return True
  except ImportError:
    return False


def have_mamba2_jax() -> bool:
  try:
    import mamba2_jax  # noqa: F401
    return True
  except ImportError:
    return False


def available(args) -> list[str]:
  """The peers to time: none without --compare, else those installed (torch
  threads set to this machine's cores)."""
  if not args.compare:
    return []
  out = []
  if have_torch():
    import torch
    torch.set_num_threads(CORES)
    out.append("torch")
  else:
    log("peer missing: transformers + torch (pip install -e '.[bench]'); running ours only")
  if have_mamba2_jax():
    out.append("mamba2-jax")
  else:
    log("peer missing: mamba2-jax (pip install mamba2-jax); running ours only")
  return out


def torch_time(fn, repeats: int) -> float:
  """Median seconds of a torch call (it returns when done on CPU) after a warm-up."""
  return median_time(fn, repeats, block=None)


def torch_matmul_rate(dtype: str, n: int, repeats: int, threads: int) -> float:
  """FLOP/s of an n x n x n torch matmul in `dtype` on CPU: the peer's own peak."""
  import torch
  torch.set_num_threads(threads)
  td = getattr(torch, dtype)
  a, b = torch.randn(n, n, dtype=td), torch.randn(n, n, dtype=td)
  return 2 * n**3 / torch_time(lambda: a @ b, repeats)


def _hf_config(cfg, chunk: int) -> dict:
  """transformers' config of our architecture at `chunk`, as Python values."""
  return ours_to_hf_config(cfg, for_json=False) | {"chunk_size": chunk}


def torch_model(cfg, chunk: int, dtype: str):
  """transformers.Mamba2ForCausalLM of `cfg`, random weights (seed 0), in `dtype`."""
  import torch
  import transformers
  tcfg = transformers.Mamba2Config(**_hf_config(cfg, chunk), use_cache=True)
  torch.manual_seed(0)
  model = transformers.Mamba2ForCausalLM(tcfg)
  if dtype == "bfloat16":
    model = model.to(torch.bfloat16)
  return model


def m2jax_model(cfg, chunk: int):
  """(mamba2_jax config, Mamba2ForCausalLM) of `cfg`, random weights. Its config
  takes transformers' names; the keys it has no field for (and unset token ids)
  are left out."""
  import mamba2_jax
  fields = {f.name for f in dataclasses.fields(mamba2_jax.Mamba2Config)}
  mcfg = mamba2_jax.Mamba2Config(**{k: v for k, v in _hf_config(cfg, chunk).items()
                                    if k in fields and v is not None})
  return mcfg, mamba2_jax.Mamba2ForCausalLM(mcfg, rngs=nnx.Rngs(0))
