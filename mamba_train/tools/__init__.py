"""Programs over the library that measure or search, above the trainer: the train
step compiled ahead of time for a TPU slice or GPU hosts and whether it fits
(`aot`), what a compiled program's HLO says it moves and computes (`hlo`), and the
SSD window a trained model can run with (`window_search`). Nothing of the library
below imports them; scripts/ and benchmarks/ do."""
