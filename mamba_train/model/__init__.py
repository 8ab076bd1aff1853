"""The model: its architecture config, how it runs (runtime), the SSD math, the
Mamba-2 layers and LM, and the decoding cache. It knows no trainer, data,
checkpoint or logger."""
