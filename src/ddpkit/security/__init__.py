"""ddpkit.security: bound listeners, the job token handshake, limits."""
