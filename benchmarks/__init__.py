"""mamba_train's benchmarks, apart from the library: `python -m benchmarks WHAT`
from the repository root (see __main__.py). One module per benchmark family
(ssd, model, decode, compile, loader; tpu_ssd and tpu_ssd_grad: XLA's TPU counts of the
SSD forms, forward and value_and_grad, run alone as `python -m benchmarks.tpu_ssd` and
`python -m benchmarks.tpu_ssd_grad`), the device's measured peaks (roofline),
the peers timed beside ours (peers), shared timing and config plumbing
(common), and the markdown report and plots (report).

Importing the package runs nothing and imports no JAX: the entry point applies
the XLA flags of `mamba_train.xla_flags` before JAX starts a backend.
"""
