"""ddpkit.testing."""
