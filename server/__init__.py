"""ServerApp, run configuration, proxy set, checkpoints, metrics and the simulation launcher."""
