"""ddpkit.launch."""
