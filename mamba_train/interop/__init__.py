"""Interop: the outside layouts (transformers' Mamba2ForCausalLM and mamba_ssm's
released checkpoints). Only this package knows their weight names, config keys
and file names."""
