"""ddpkit.watchdog: where each rank's thread is, and the hang report built from it."""
