"""Training: the train state and its shardings, the loss and the jitted steps,
the hooks periodic work hangs on, the optimizer, and checks on a run config."""
