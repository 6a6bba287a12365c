"""torchrun's rendezvous state, read only when it is the job's own: signed, and unpickled safely.

torchrun's c10d rendezvous (``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``)
keeps the membership as a pickle of ``_RendezvousState`` under the store key
``torch.rendezvous.<run_id>``, and every agent ``pickle.loads`` it several times a second. The
store has no access control and lists its keys to any client (``TCPStore.list_keys``), so any
process that reaches its port could write a payload there that runs in the launcher. ddpkit's
launcher therefore uses this backend (registered with torchrun as ``ddpkit``, otherwise
torch's ``C10dRendezvousBackend``), which checks every state it reads before torch unpickles it:

1. **Signed.** Each state the job writes carries ``HMAC-SHA256(key, state)`` (RFC 2104) in
   front of it; a state whose MAC does not match is refused. The key is derived from the job
   token (``DDPKIT_JOB_TOKEN``) when the job has one, so every node holds it; a one-node job
   without a token uses a random key only its launcher holds (its agent is the only reader).
   A several-node job without a token has nothing shared to key a MAC with: no signature there,
   step 2 alone.
2. **Allow-list unpickling.** The state is first unpickled by an unpickler that resolves only
   the classes a rendezvous state is made of (``_RendezvousState``, ``_NodeDesc``,
   ``datetime``); any other global is refused before torch's ``pickle.loads`` sees the bytes.
   Unpickling the same bytes again resolves the same globals, so torch's load then runs no
   code either.

A refused state stops the agent with :class:`RendezvousStateRefused` (a
``RendezvousStateError``): its workers are stopped and ``ddpkit run`` exits 1 with one line
naming the store and what was wrong. Nothing of the refused state is ever unpickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import pickle
import secrets
from collections.abc import Iterator
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

BACKEND_NAME = "ddpkit"
MAC_BYTES = 32  # HMAC-SHA256
_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# Every global a pickled _RendezvousState refers to (torch 2.x: the state, its node descriptors,
# the deadline and heartbeat datetimes and their time zone; sets and dicts are opcodes).
ALLOWED_GLOBALS = frozenset(
    {
        (_DYNAMIC, "_RendezvousState"),
        (_DYNAMIC, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class RendezvousStateRefused(RendezvousStateError):
    """The rendezvous state in the store is not one this job wrote; it was not unpickled."""


class _NotAllowed(pickle.UnpicklingError):
    pass


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise _NotAllowed(f"holds the global {module}.{name}")
        return super().find_class(module, name)


def rendezvous_key(token: bytes | None, *, several_nodes: bool) -> bytes | None:
    """The key that signs this job's rendezvous state.

    Args:
        token: the job token (:func:`ddpkit.security.token.load_token`), or ``None``.
        several_nodes: whether other nodes' launchers read the state too.

    Returns:
        32 bytes: ``HMAC-SHA256(token, "ddpkit rendezvous state")`` with a token; a fresh random
        key for one node without a token; ``None`` (no signature) for several nodes without one.
    """
    if token is not None:
        return hmac.new(token, b"ddpkit rendezvous state", hashlib.sha256).digest()
    return None if several_nodes else secrets.token_bytes(MAC_BYTES)


def check_state(data: bytes, key: bytes | None) -> bytes:
    """The pickled state inside ``data`` (what :meth:`SignedC10dBackend.set_state` stored),
    verified.

    Raises:
        RendezvousStateRefused: the MAC is missing or wrong (``key`` given), or the pickle
            refers to a global outside :data:`ALLOWED_GLOBALS`, is malformed, or is not a
            ``_RendezvousState``. Nothing outside the allow-list is ever resolved.
    """
    state = data
    if key is not None:
        tag, state = data[:MAC_BYTES], data[MAC_BYTES:]
        expected = hmac.new(key, state, hashlib.sha256).digest()
        if len(tag) != MAC_BYTES or not hmac.compare_digest(tag, expected):
            raise RendezvousStateRefused("is not signed with this job's key")
    try:
        loaded = _AllowListUnpickler(io.BytesIO(state)).load()
    except _NotAllowed as exc:
        raise RendezvousStateRefused(str(exc)) from None
    except Exception as exc:  # a malformed pickle raises anything (EOFError, ValueError, ...)
        raise RendezvousStateRefused(f"is not a valid pickle ({type(exc).__name__})") from None
    if type(loaded).__name__ != "_RendezvousState" or type(loaded).__module__ != _DYNAMIC:
        raise RendezvousStateRefused(f"holds a {type(loaded).__name__}, not a rendezvous state")
    return state


class SignedC10dBackend(C10dRendezvousBackend):
    """torch's ``C10dRendezvousBackend`` whose states are signed when written and checked by
    :func:`check_state` when read (before torch's ``pickle.loads``).

    Args:
        store: the rendezvous store (a client of the one node 0's launcher hosts).
        run_id: the rendezvous run id (key ``torch.rendezvous.<run_id>``).
        key: the signing key (:func:`rendezvous_key`); ``None``: no signature, allow-list only.
        endpoint: ``HOST:PORT`` of the store, for the refusal message.

    Raises (from every read):
        RendezvousStateRefused: one line naming the store and what was wrong.
    """

    def __init__(self, store: Any, run_id: str, key: bytes | None, endpoint: str) -> None:
        self._mac_key = key
        self._endpoint = endpoint
        super().__init__(store, run_id)

    @property
    def name(self) -> str:
        """The name torchrun knows this backend by (:data:`BACKEND_NAME`)."""
        return BACKEND_NAME

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        """See torch's base class; ``state`` is stored signed."""
        sealed = state
        if self._mac_key is not None:
            sealed = hmac.new(self._mac_key, state, hashlib.sha256).digest() + state
        result = super().set_state(sealed, token)
        if result is None:
            return None
        new_state, new_token, _ = result  # torch compared new_state with the sealed bytes
        return new_state, new_token, new_state == state

    def _decode_state(self, base64_state: bytes) -> tuple[bytes, Any] | None:
        decoded = super()._decode_state(base64_state)
        if decoded is None:
            return None
        data, token = decoded
        try:
            return check_state(data, self._mac_key), token
        except RendezvousStateRefused as exc:
            raise RendezvousStateRefused(
                f"rendezvous state refused: the store at {self._endpoint} holds a rendezvous "
                f"state for this job that {exc} (a process that can reach the store wrote it, "
                "or a node runs with another DDPKIT_JOB_TOKEN); nothing of it was unpickled and "
                "the job stops. Keep the store's port reachable from the job's nodes only "
                "(docs/security.md)."
            ) from None


_active_key: list[bytes | None] = []  # the key of the launch in progress (one per process)


def _create_handler(params: RendezvousParameters) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    if not _active_key:
        raise RendezvousStateError(
            f"the {BACKEND_NAME!r} rendezvous backend is ddpkit run's own; use ddpkit run"
        )
    _, store = create_backend(params)
    backend = SignedC10dBackend(store, params.run_id, _active_key[-1], params.endpoint)
    return create_handler(store, backend, params)


@contextlib.contextmanager
def signed_rendezvous(key: bytes | None) -> Iterator[str]:
    """Within the block, torchrun's rendezvous backend :data:`BACKEND_NAME` is a
    :class:`SignedC10dBackend` keyed with ``key``; yields the name to pass as
    ``--rdzv-backend``."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND_NAME, _create_handler)  # idempotent
    _active_key.append(key)
    try:
        yield BACKEND_NAME
    finally:
        _active_key.pop()
