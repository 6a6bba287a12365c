"""ddpkit.guards: cross-rank checks that fail fast and name the rank."""
