"""Interop: the outside layouts (transformers' Mamba2ForCausalLM, NemotronH and
GraniteMoeHybrid, mamba_ssm's released checkpoints), one module each; llama.cpp's
GGUF (gguf.py, written only); and lm-evaluation-harness's model interface. Only this
package knows their weight names, config keys and file names. Importing it imports
none of them (nor lm_eval, nor gguf)."""
