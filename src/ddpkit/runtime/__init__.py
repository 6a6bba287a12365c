"""ddpkit.runtime: the process group, rendezvous, collectives and the agreed stop."""
