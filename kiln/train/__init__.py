"""Training: config, optimizers, lr schedules, the loop, checkpoints with exact resume, metrics."""
