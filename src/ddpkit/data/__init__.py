"""ddpkit.data: sharded samplers and loaders, seeding, and the same-data check."""
