"""Training: the loop (`loop.train`) and its inputs, the run config's checks and the
plan they resolve it into, the train state and its shardings, the loss and the jitted
steps, the hooks periodic work hangs on, and the optimizer. (The train step compiled
ahead of time for a TPU slice is a tool over the trainer: `mamba_train.tools.aot`.)"""
