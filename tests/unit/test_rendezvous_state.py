"""ddpkit's rendezvous backend: torchrun's state is signed, and unpickled only through an
allow-list (ddpkit.security.rendezvous_state)."""

from __future__ import annotations

import datetime
import os
import pickle
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from ddpkit.security.rendezvous_state import (
    RendezvousStateRefused,
    SignedC10dBackend,
    check_state,
    rendezvous_key,
)


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _state() -> _RendezvousState:
    state = _RendezvousState()
    node = _NodeDesc("127.0.0.1", 123, 0)
    state.participants[node] = 0
    state.wait_list.add(_NodeDesc("127.0.0.1", 124, 0))
    state.last_heartbeats[node] = datetime.datetime.now(datetime.timezone.utc)
    state.deadline = datetime.datetime.now(datetime.timezone.utc) + timedelta(seconds=30)
    return state


def test_a_real_state_passes_with_and_without_a_key():
    raw = pickle.dumps(_state())
    assert check_state(raw, None) == raw
    key = rendezvous_key(None, several_nodes=False)
    import hashlib
    import hmac

    signed = hmac.new(key, raw, hashlib.sha256).digest() + raw
    assert check_state(signed, key) == raw


def test_a_payload_is_refused_before_anything_is_resolved(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Payload(str(marker)))
    with pytest.raises(RendezvousStateRefused, match=r"holds the global (posix|os)\.mkdir"):
        check_state(payload, None)  # several nodes without a token: the allow-list alone
    with pytest.raises(RendezvousStateRefused, match="is not signed with this job's key"):
        check_state(b"\0" * 32 + payload, rendezvous_key(None, several_nodes=False))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (pickle.dumps({"round": 1}), "holds a dict, not a rendezvous state"),
        (pickle.dumps(_state())[:-5], "is not a valid pickle"),
        (b"", "is not a valid pickle"),
    ],
)
def test_other_bytes_are_refused(data, reason):
    with pytest.raises(RendezvousStateRefused, match=reason):
        check_state(data, None)


def test_keys():
    token = b"0123456789abcdef0123456789abcdef"
    assert rendezvous_key(token, several_nodes=True) == rendezvous_key(token, several_nodes=False)
    assert len(rendezvous_key(token, several_nodes=True)) == 32
    assert rendezvous_key(None, several_nodes=True) is None  # nothing shared to key it with
    one, two = rendezvous_key(None, several_nodes=False), rendezvous_key(None, several_nodes=False)
    assert len(one) == 32 and one != two


def test_the_backend_signs_what_it_writes_and_refuses_another_keys_state():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    client = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, use_libuv=True, timeout=timedelta(seconds=10)
    )
    key = rendezvous_key(b"0123456789abcdef0123456789abcdef", several_nodes=True)
    ours = SignedC10dBackend(client, "job", key, f"127.0.0.1:{server.port}")
    raw = pickle.dumps(_state())
    new_state, token, written = ours.set_state(raw)
    assert written and new_state == raw
    assert ours.get_state()[0] == raw
    # a second write with the token torch's holder keeps
    again = pickle.dumps(_RendezvousState())
    assert ours.set_state(again, token)[2] is True
    # the stored value is signed: torch's own backend would read 32 bytes of MAC first
    import base64

    stored = base64.b64decode(client.get("torch.rendezvous.job"))
    assert stored[32:] == again and stored[:32] != again[:32]

    other = SignedC10dBackend(
        client, "job", rendezvous_key(None, several_nodes=False), "127.0.0.1:1"
    )
    refused = r"the store at 127\.0\.0\.1:1 .* not signed"
    with pytest.raises(RendezvousStateRefused, match=refused):
        other.get_state()
    assert ours.name == "ddpkit"
