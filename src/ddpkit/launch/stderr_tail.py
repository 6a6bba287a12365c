"""Keep the last bytes a worker wrote to stderr, for the launcher's summary of a native crash.

A rank that gloo aborts (``std::terminate`` in its network thread: a collective mismatch) dies
from SIGABRT without a Python exception: the only account of what happened is what the C++
runtime and Python's ``faulthandler`` wrote to its stderr just before. ``ddpkit run``'s worker
bootstrap therefore sends its stderr through a small child process (:func:`tee_stderr`) that
copies every byte to the console in whole lines (a line is held until its newline, and a last
line without one gets one, so two ranks' lines never join mid-line) and, when stderr closes
(the worker ended, however), writes the last ``keep_bytes`` to a file in the run folder.
:func:`read_tail` returns it to the launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

KEEP_BYTES = 16384
_copiers: list[subprocess.Popen] = []  # referenced, so no ResourceWarning when it outlives us
_COPY = r"""
import os, signal, sys
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):  # ended by EOF only
    signal.signal(getattr(signal, name), signal.SIG_IGN)
path, keep = sys.argv[1], int(sys.argv[2])
tail = bytearray()
pending = b""  # the start of a line not finished yet: held until its end (or EOF)

def write(data):
    while data:
        try:
            data = data[os.write(1, data) :]
        except BrokenPipeError:
            return

while True:
    try:
        chunk = os.read(0, 65536)
    except InterruptedError:
        continue
    if not chunk:
        break
    tail += chunk
    del tail[:-keep]
    chunk, pending = pending + chunk, b""
    end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1  # "\r": a progress bar's redraw
    chunk, pending = chunk[:end], chunk[end:]
    if len(pending) > 4096:  # a very long line: pass it on rather than hold it
        chunk, pending = chunk + pending, b""
    while chunk:  # whole lines of at most PIPE_BUF bytes: atomic on the shared console pipe
        cut = chunk.rfind(b"\n", 0, 4096) + 1 if len(chunk) > 4096 else len(chunk)
        piece, chunk = chunk[: cut or 4096], chunk[cut or 4096 :]
        write(piece)
if pending:  # the last line lacked its newline: end it, so the next rank's line starts afresh
    write(pending + b"\n")
with open(path + ".tmp", "wb") as handle:
    handle.write(tail)
os.replace(path + ".tmp", path)
"""


def tail_path(run_dir: str | os.PathLike[str], restart: int, rank: int) -> Path:
    return Path(run_dir) / f"stderr-r{restart}-rank{rank}.txt"


def tee_stderr(path: str | os.PathLike[str], keep_bytes: int = KEEP_BYTES) -> None:
    """Route this process's fd 2 through a copier that keeps its last ``keep_bytes`` in ``path``.

    Everything still reaches the original stderr, in order. Call once, early, before threads
    start. A no-op off Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    read_fd, write_fd = os.pipe()
    try:
        copier = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _COPY, str(path), str(keep_bytes)],
            stdin=read_fd,
            stdout=2,  # the original stderr
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError:  # cannot start it: keep the plain stderr
        os.close(write_fd)
        return
    finally:
        os.close(read_fd)
    _copiers.append(copier)
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)


def read_tail(path: str | os.PathLike[str], wait_s: float = 0.0) -> str:
    """The kept stderr tail (waiting up to ``wait_s`` for its copier to finish), or ``""``."""
    deadline = time.monotonic() + wait_s
    path = Path(path)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:
        return ""
