"""ddpkit.parallel."""
