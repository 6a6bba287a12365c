"""Breaking a gloo process group's connections, so that every peer blocked on this member
fails at once instead of waiting out the collective timeout.

Why: when a member dies inside an all-reduce, the survivors do not all fail. In a ring, a
survivor can stay blocked receiving from *another survivor* that already failed and moved on;
it waits for the group's timeout (30 minutes by default). torch 2.13's ways to end a gloo group
(``ProcessGroup.abort()``, the backend's ``abort()`` and ``shutdown()``,
``destroy_process_group()``) return at once but close no connection: measured, a peer blocked
in ``recv`` from the aborting member stayed blocked until that member's *process* exited. So a
member whose operation failed shuts down the TCP connections its group opened (``shutdown(2)``
on each socket, found as the sockets that appeared while the group was built); every peer
waiting on it gets "Connection closed by peer" within milliseconds, votes, and the members move
on together. The group is discarded anyway. Linux only (``/proc/self/fd``); elsewhere a no-op,
and a failure then costs the collective timeout.
"""

from __future__ import annotations

import os
import socket

_FD_DIR = "/proc/self/fd"


def socket_inodes() -> dict[int, str]:
    """This process's open sockets: ``{fd: "socket:[inode]"}`` (empty where /proc is absent)."""
    found = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def new_sockets(before: dict[int, str]) -> dict[int, str]:
    """The sockets opened since ``before`` (a :func:`socket_inodes` snapshot)."""
    return {fd: ino for fd, ino in socket_inodes().items() if before.get(fd) != ino}


def shut_down(sockets: dict[int, str]) -> int:
    """``shutdown(SHUT_RDWR)`` every socket of ``sockets`` still open as recorded (an fd that
    was closed and reused for another socket is left alone); returns how many."""
    now = socket_inodes()
    count = 0
    for fd, inode in sockets.items():
        if now.get(fd) != inode:
            continue
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if not dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # gloo's listener
                dup.shutdown(socket.SHUT_RDWR)  # stays: shutting it down aborts gloo's loop
                count += 1
        except OSError:  # not connected, or already shut
            pass
        finally:
            dup.close()
    return count
