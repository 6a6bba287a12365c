"""Admission at rendezvous: forged claims, extra ranks, limits, token settings, address rules."""

from __future__ import annotations

import os

import pytest

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.rendezvous import PREFIX
from ddpkit.security.bind import (
    check_store_address,
    interface_of,
    listening_socket,
    reserve_port,
)
from ddpkit.security.token import load_token
from ddpkit.testing import run_distributed

TOKEN = "0123456789abcdef0123456789abcdef"


def _info(rank: int, world_size: int) -> ProcessInfo:
    return ProcessInfo(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        source="torchrun",
    )


def _forged_claim(store) -> str:
    """Rank 0 joins with the token; "rank 1" is a raw store client forging its claim."""
    if int(os.environ["RANK"]) == 1:
        store.wait([f"{PREFIX}/job"])
        store.set(f"{PREFIX}/rank/1", "evil-host:4242:cafe|" + "0" * 64)
        store.add(f"{PREFIX}/count", 1)
        return "forged"
    os.environ["DDPKIT_JOB_TOKEN"] = TOKEN
    try:
        ddpkit.init_runtime("gloo", init_timeout_s=20, info=_info(0, 2), store=store)
    except ddpkit.DistributedError as exc:
        return str(exc)
    return "admitted"


def test_a_forged_claim_stops_the_job_before_any_collective():
    message, _ = run_distributed(_forged_claim, world_size=2, init=False, timeout_s=60)
    assert message.startswith("rendezvous refused: rank 1's claim (evil-host pid 4242)")
    assert "carries no valid proof of the job token" in message


def _extra_rank(store) -> str:
    rank = int(os.environ["RANK"])
    if rank == 2:  # arrives after the 2-rank job exists, claiming a world of 3
        store.wait([f"{PREFIX}/job"])
        try:
            ddpkit.init_runtime("gloo", init_timeout_s=20, info=_info(2, 3), store=store)
        except ddpkit.DistributedError as exc:
            return str(exc)
        return "admitted"
    with ddpkit.init_runtime("gloo", init_timeout_s=20, info=_info(rank, 2), store=store) as rt:
        return f"sum {ddpkit.all_reduce_sum([1.0], rt).item()}"


def test_an_extra_rank_is_refused_and_the_job_runs():
    results = run_distributed(_extra_rank, world_size=3, init=False, timeout_s=60)
    assert results[:2] == ["sum 2.0", "sum 2.0"]
    assert results[2] == (
        "refused to join as rank 2: this job has world_size=2 but this process has "
        "world_size=3. Start every rank with the same world size."
    )


def test_world_size_limit(monkeypatch):
    monkeypatch.setenv("DDPKIT_MAX_WORLD_SIZE", "2")
    with pytest.raises(ddpkit.ConfigError, match="world_size=4, DDPKIT_MAX_WORLD_SIZE=2"):
        ddpkit.init_runtime("gloo", info=_info(0, 4))
    for bad in ("abc", "0", "\u00b2"):  # "²".isdigit() is True, int("²") fails
        monkeypatch.setenv("DDPKIT_MAX_WORLD_SIZE", bad)
        with pytest.raises(ddpkit.ConfigError, match="invalid DDPKIT_MAX_WORLD_SIZE"):
            ddpkit.init_runtime("gloo", info=_info(0, 4))


def test_token_settings_are_checked_without_showing_the_token(tmp_path):
    assert load_token({}) is None
    assert load_token({"DDPKIT_JOB_TOKEN": TOKEN}) == TOKEN.encode()
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert load_token({"DDPKIT_JOB_TOKEN_FILE": str(tmp_path / "token")}) == TOKEN.encode()
    (tmp_path / "empty").write_text(" \n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    for env, expected in (
        ({"DDPKIT_JOB_TOKEN": "short-secret"}, "job token too short: 12 bytes"),
        ({"DDPKIT_JOB_TOKEN_FILE": str(tmp_path / "missing")}, "cannot read the job token"),
        ({"DDPKIT_JOB_TOKEN": TOKEN, "DDPKIT_JOB_TOKEN_FILE": "x"}, "job token given twice"),
        ({"DDPKIT_JOB_TOKEN_FILE": str(tmp_path / "empty")}, "empty job token"),  # never fail open
        ({"DDPKIT_JOB_TOKEN_FILE": str(tmp_path / "binary")}, "not UTF-8 text"),
    ):
        with pytest.raises(ddpkit.ConfigError, match=expected) as caught:
            load_token(env)
        assert "short-secret" not in str(caught.value) and TOKEN not in str(caught.value)


def test_store_address_rules(monkeypatch):
    monkeypatch.delenv("DDPKIT_MULTI_NODE", raising=False)
    assert check_store_address("127.0.0.1", multi_node=False) == "127.0.0.1"
    assert check_store_address("localhost", multi_node=False) == "127.0.0.1"
    with pytest.raises(ddpkit.ConfigError, match="refusing to listen on a non-loopback address"):
        check_store_address("10.20.30.40", multi_node=False)  # checked before any socket
    assert check_store_address("10.20.30.40", multi_node=True) == "10.20.30.40"
    monkeypatch.setenv("DDPKIT_MULTI_NODE", "1")
    assert check_store_address("10.20.30.40", multi_node=False) == "10.20.30.40"
    with pytest.raises(ddpkit.ConfigError, match="refusing to listen on every interface"):
        check_store_address("0.0.0.0", multi_node=True)


def test_listener_is_bound_to_the_address_given():
    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
        with pytest.raises(ddpkit.ConfigError, match=f"port {sock.getsockname()[1]} on"):
            listening_socket("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.7") is None  # TEST-NET-3: on no interface here


def test_a_reserved_port_takes_one_listener_and_no_other_bind():
    import socket

    reserved = reserve_port("127.0.0.1")
    port = reserved.getsockname()[1]
    try:
        for _ in range(2):  # rank 0's store, and again after a restart
            store = listening_socket("127.0.0.1", port)
            with pytest.raises(ddpkit.ConfigError, match=f"port {port} on"):
                listening_socket("127.0.0.1", port)  # one listener at a time
            store.close()
        picked = set()
        for _ in range(3000):  # what torch's get_free_port and gloo's listeners do
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                picked.add(other.getsockname()[1])
        assert port not in picked and len(picked) > 100
    finally:
        reserved.close()
