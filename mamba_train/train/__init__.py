"""Training: the loop (`loop.train`) and its inputs, the run config's checks and the
plan they resolve it into, the train state and its shardings, the loss and the jitted
steps, the hooks periodic work hangs on, the optimizer, and the train step compiled
ahead of time for a TPU slice."""
