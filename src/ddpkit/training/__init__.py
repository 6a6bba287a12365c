"""ddpkit.training."""
