"""ddpkit.distributed."""
