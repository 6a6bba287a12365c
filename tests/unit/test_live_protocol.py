"""Live fault tolerance's agreement, on a real TCPStore in one process: the decision rule, the
quorums the lighthouse forms, and a worker declared dead refused when it comes back."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from ddpkit.errors import DistributedError
from ddpkit.live.lighthouse import Lighthouse
from ddpkit.live.membership import LiveMembership
from ddpkit.live.outcomes import RefusedError, is_lost_peer
from ddpkit.live.protocol import DEAD, Quorum, Vote, decide, key, next_quorum, slot_of


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master


def _client(store) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )


Q = Quorum(3, ("s0-a", "s1-b", "s2-c"))


def test_every_ok_vote_commits_and_a_missing_one_discards_everywhere():
    ok = Vote(True, 3)
    assert decide(Q, dict.fromkeys(Q.members, ok)).commit
    assert not decide(Q, dict.fromkeys(Q.members, ok)).reconfigure
    one_failed = {**dict.fromkeys(Q.members, ok), "s1-b": Vote(False, 3)}
    decision = decide(Q, one_failed)
    assert (decision.commit, decision.reconfigure) == (False, True)
    dead = {**dict.fromkeys(Q.members, ok), "s2-c": None}  # found DEAD before it voted
    decision = decide(Q, dead)
    assert (decision.commit, decision.reconfigure, decision.dead) == (False, True, ("s2-c",))


def test_a_newer_quorum_moves_now_and_waiting_replacements_wait_for_the_next_step():
    newer = dict.fromkeys(Q.members, Vote(True, 3))
    newer["s0-a"] = Vote(True, 4)
    decision = decide(Q, newer)
    assert (decision.commit, decision.reconfigure, decision.admit) == (True, True, False)
    waiting = {**dict.fromkeys(Q.members, Vote(True, 3)), "s1-b": Vote(True, 3, waiting=1)}
    decision = decide(Q, waiting)
    assert (decision.commit, decision.reconfigure, decision.admit) == (True, False, True)


def test_a_stop_and_leaving_members_are_agreed_and_every_member_leaving_is_a_stop():
    votes = {**dict.fromkeys(Q.members, Vote(True, 3)), "s2-c": Vote(True, 3, stop="SIGTERM")}
    assert decide(Q, votes).stop == "SIGTERM"
    one = {**dict.fromkeys(Q.members, Vote(True, 3)), "s1-b": Vote(True, 3, leave=True)}
    decision = decide(Q, one)
    assert (decision.leaving, decision.stop, decision.reconfigure) == (("s1-b",), "", True)
    everyone = dict.fromkeys(Q.members, Vote(True, 3, leave=True))
    assert decide(Q, everyone).stop == "every member leaving"


def test_next_quorum_keeps_the_survivors_first_and_heals_only_with_a_survivor():
    quorum = next_quorum(Q, ["s2-c", "s0-a"], ["s1-x"], "slot 1 died")
    assert quorum == Quorum(4, ("s0-a", "s2-c", "s1-x"), ("s1-x",), "slot 1 died")
    assert quorum.rank_of("s1-x") == 2
    first = next_quorum(None, ["s1-b", "s0-a"], ["s0-a", "s1-b"], "start")
    assert first == Quorum(1, ("s0-a", "s1-b"), (), "start")
    assert next_quorum(Q, [], [], "every member died") is None
    assert Vote.decode(DEAD) is None and Vote.decode(Vote(True, 2).encode()) == Vote(True, 2)
    assert slot_of("s12-abc") == 12 and slot_of("spare") == -1


def _register(store, replica: str, slot: int) -> None:
    store.set(key("replica", replica), f'{{"slot": {slot}}}')


def test_the_lighthouse_forms_quorums_from_exits_heartbeats_and_admissions(store):
    lighthouse = Lighthouse(store, 2, heartbeat_timeout_s=5.0)
    for slot, replica in enumerate(("s0-a", "s1-b")):
        lighthouse.add(replica, slot)
    assert lighthouse.tick(now=0.0) == []  # nobody registered yet
    _register(store, "s0-a", 0)
    _register(store, "s1-b", 1)
    [first] = lighthouse.tick(now=0.0)
    assert first.quorum == Quorum(1, ("s0-a", "s1-b"), (), "start")
    store.add(key("hb", "s0-a"), 1)
    store.add(key("hb", "s1-b"), 1)
    assert lighthouse.tick(now=1.0) == []
    store.add(key("hb", "s0-a"), 1)  # s1-b's heartbeat stops
    events = lighthouse.tick(now=7.0)
    assert [(e.kind, e.replica, e.kill) for e in events[:1]] == [("dead", "s1-b", True)]
    assert "stopped answering (no heartbeat for 6.0 s)" in events[0].why
    assert events[-1].quorum.members == ("s0-a",)
    assert store.get(key("dead", "s1-b")).decode().startswith("stopped answering")
    # a replacement, ready: taken in only once the members ask (a step boundary)
    lighthouse.add("s1-c", 1)
    _register(store, "s1-c", 1)
    store.set(key("ready", "s1-c"), "1")
    store.add(key("hb", "s0-a"), 1)
    assert lighthouse.tick(now=8.0) == []
    assert lighthouse.status.waiting == 1
    store.set(key("admit", 2), "1")
    [admitted] = lighthouse.tick(now=8.5)
    assert admitted.quorum == Quorum(3, ("s0-a", "s1-c"), ("s1-c",), "1 replacement(s) taken in")
    assert lighthouse.status.latest == 3 and lighthouse.status.waiting == 0
    store.set(key("healed", "s1-c"), "1")  # its formation committed: a member from now on
    lighthouse.exited("s0-a", -9)
    events = lighthouse.tick(now=9.0)
    assert (events[0].kind, events[0].why, events[0].kill) == ("dead", "died (SIGKILL)", False)
    assert events[-1].quorum.members == ("s1-c",)
    lighthouse.exited("s1-c", 0)  # ran to its end: the last member finished, the job is done
    events = lighthouse.tick(now=9.5)
    assert [e.kind for e in events] == ["finished", "done"] and lighthouse.finished("s1-c")


def test_a_replacement_whose_heal_did_not_commit_is_taken_in_again_not_kept(store):
    lighthouse = Lighthouse(store, 2)
    for slot, replica in enumerate(("s0-a", "s1-b")):
        lighthouse.add(replica, slot)
        _register(store, replica, slot)
    lighthouse.tick(now=0.0)
    lighthouse.add("s2-j", 2)
    store.set(key("ready", "s2-j"), "1")
    store.set(key("admit", 1), "1")
    [taken] = lighthouse.tick(now=1.0)
    assert taken.quorum.joiners == ("s2-j",)
    lighthouse.exited("s1-b", -9)  # a survivor lost while s2-j was being healed
    events = lighthouse.tick(now=2.0)
    assert events[-1].quorum.members == ("s0-a",)  # not s2-j: it never got the state
    assert lighthouse.tick(now=2.5) == []
    assert lighthouse.status.waiting == 1  # still ready: the members take it in at a step
    store.set(key("admit", 3), "1")
    [again] = lighthouse.tick(now=3.0)
    assert (again.quorum.members, again.quorum.joiners) == (("s0-a", "s2-j"), ("s2-j",))


def test_a_worker_that_fails_before_the_first_quorum_ends_the_job(store):
    lighthouse = Lighthouse(store, 2)
    lighthouse.add("s0-a", 0)
    lighthouse.add("s1-b", 1)
    _register(store, "s0-a", 0)
    lighthouse.exited("s1-b", 1)
    [event] = lighthouse.tick(now=0.0)
    why = "slot 1 exited with status 1 before the job started"
    assert (event.kind, event.why) == ("empty", why)


def test_the_last_member_gone_is_an_empty_event(store):
    lighthouse = Lighthouse(store, 1)
    lighthouse.add("s0-a", 0)
    _register(store, "s0-a", 0)
    lighthouse.tick(now=0.0)
    lighthouse.exited("s0-a", 1)
    events = lighthouse.tick(now=1.0)
    assert [e.kind for e in events] == ["dead", "empty"]
    assert events[-1].why == "slot 0 exited with status 1"


def test_a_member_declared_dead_is_refused_when_it_votes_late(store):
    quorum = Quorum(1, ("s0-a", "s1-b"))
    alive = LiveMembership(_client(store), "s0-a")
    late = LiveMembership(_client(store), "s1-b")
    for member in (alive, late):
        member.quorum = quorum
    store.set(key("status"), '{"latest": 1, "waiting": 0, "stop": ""}')
    store.set(key("dead", "s1-b"), "stopped answering")  # the launcher's verdict
    decision = alive.vote(True)  # finds s1-b dead, writes DEAD in its vote first
    assert (decision.commit, decision.dead) == (False, ("s1-b",))
    assert store.get(key("vote", 1, 0, "s1-b")).decode() == DEAD
    with pytest.raises(RefusedError, match="declared dead by the job"):
        late.vote(True)  # it woke up: its vote cannot change what the others decided


def test_a_vote_that_came_first_stands_even_if_the_member_dies_after(store):
    quorum = Quorum(1, ("s0-a", "s1-b"))
    first = LiveMembership(_client(store), "s1-b")
    second = LiveMembership(_client(store), "s0-a")
    first.quorum = second.quorum = quorum
    store.set(key("status"), '{"latest": 1, "waiting": 0, "stop": ""}')
    store.set(key("vote", 1, 0, "s1-b"), Vote(True, 1).encode())  # voted, then died
    store.set(key("dead", "s1-b"), "died (SIGKILL)")
    decision = second.vote(True)
    assert decision.commit and not decision.dead  # the same on every member that reads it


def test_lost_peer_errors_are_told_from_bugs():
    assert is_lost_peer(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    wrapped = ValueError("x")
    wrapped.__cause__ = RuntimeError("Read error [127.0.0.1]:5: Connection reset by peer")
    assert is_lost_peer(wrapped)
    assert not is_lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_members_that_ran_different_operations_are_told_so():
    votes = {
        "s0-a": Vote(True, 3, op="training step"),
        "s1-b": Vote(True, 3, op="barrier"),
        "s2-c": Vote(True, 3, op="training step"),
    }
    with pytest.raises(DistributedError, match="'barrier' and 'training step'"):
        decide(Q, votes)
