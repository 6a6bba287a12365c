"""ddpkit.app: the applications built on the library (``ddpkit train`` is ``app.mnist``)."""
