"""ddpkit.examples."""
