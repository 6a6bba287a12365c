"""ddpkit.checkpoint: atomic checksummed checkpoints and exact resume."""
