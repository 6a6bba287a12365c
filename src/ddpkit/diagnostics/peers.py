"""gloo's words for a collective that a peer broke: the one list every part of ddpkit reads."""

from __future__ import annotations

#: the peer's socket closed: it ended (raised, crashed, was killed)
PEER_ENDED = ("Connection closed by peer", "Connection reset by peer")
#: the peer is gone or silent (its socket closed, or nothing arrived within the timeout)
LOST_PEER = (*PEER_ENDED, "Broken pipe", "Timed out waiting")
#: ... and while a group is built or torn down (live fault tolerance reads these too)
LOST_PEER_ANY = (
    *LOST_PEER,
    "Read error",
    "Write error",
    "Socket closed",
    "connectFullMesh",
    "Connection refused",
)
#: ddpkit's own words for them (``Runtime.watch``'s DistributedError): a peer ended, went silent
TOLD_ENDED, TOLD_SILENT = "a peer's process ended", "a peer stopped answering"


def mentions(text: str, markers: tuple[str, ...] = LOST_PEER) -> bool:
    """Whether ``text`` (an exception's message) holds one of ``markers``."""
    return any(marker in text for marker in markers)
