"""Resuming the training loader on another number of ranks, counted sample by sample.

Every rank of a job is simulated in one process (a loader per rank, no process group): the loaders
of world size W run in lockstep for some batches, rank 0's state is saved, and loaders of world size
M load it and run to the end of the epoch. Counted: every remaining sample of the epoch exactly
once, the padding exactly torch's rule, each global batch the same samples as in the
uninterrupted W-rank run, and at W itself the very indices torch's own sampler gives.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset, TensorDataset

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.errors import ConfigError
from ddpkit.runtime.process_group import Runtime


def _runtime(rank: int, world_size: int) -> Runtime:
    info = ProcessInfo(
        rank=rank, world_size=world_size, local_world_size=world_size, local_rank=rank
    )
    return Runtime(info, backend=None, device=torch.device("cpu"))


def _loaders(num_samples, world_size, batch_size, **kwargs):
    data = TensorDataset(torch.arange(num_samples))
    return [
        ddpkit.build_train_loader(
            data, _runtime(r, world_size), batch_size=batch_size, seed=5, **kwargs
        )
        for r in range(world_size)
    ]


def _global_batches(loaders, num_batches=None, passes=None) -> list[list[int]]:
    """The global batches (rank 0's batch, then rank 1's, ...) of one pass in lockstep; stops
    after ``num_batches`` with every pass left open (kept alive in ``passes``: a closed pass
    is a finished one)."""
    passes = [] if passes is None else passes
    passes += [iter(loader) for loader in loaders]
    batches = []
    while num_batches is None or len(batches) < num_batches:
        per_rank = [next(p, None) for p in passes]
        if per_rank[0] is None:
            assert all(b is None for b in per_rank), "ranks ran out at different batches"
            return batches
        batches.append([int(i) for (b,) in per_rank for i in b])
    return batches


def _saved_state(loaders, num_batches):
    passes = []
    seen = _global_batches(loaders, num_batches, passes)
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), states  # one position, the same on every rank
    return seen, states[0]


def _epoch_order(num_samples: int, epoch: int) -> list[int]:
    whole = DistributedSampler(range(num_samples), num_replicas=1, rank=0, seed=5)
    whole.set_epoch(epoch)
    return list(whole)


@pytest.mark.parametrize("num_samples", [23, 24, 48])
@pytest.mark.parametrize("world_size,batch_size", [(1, 4), (2, 3), (3, 2), (4, 1)])
def test_same_world_size_resume_is_torchs_own_shard(num_samples, world_size, batch_size):
    reference = []
    for r in range(world_size):
        sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=r, seed=5)
        reference.append(list(sampler))  # torch's shard of epoch 0
    full = len(_loaders(num_samples, world_size, batch_size)[0])
    for cut in range(1, full):
        loaders = _loaders(num_samples, world_size, batch_size)
        _, state = _saved_state(loaders, cut)
        resumed = _loaders(num_samples, world_size, batch_size)
        for r, loader in enumerate(resumed):
            loader.load_state_dict(state)
            rest = [int(i) for (b,) in loader for i in b]
            assert rest == reference[r][cut * batch_size :], (r, cut)
            assert loader.epoch == 1


# (samples, W, per-rank batch at W, M, per-rank batch at M): the global batch kept, B*W = B'*M
RESIZES = [
    (48, 2, 6, 3, 4),  # 2 -> 3, no padding at either size
    (48, 3, 4, 2, 6),  # 3 -> 2
    (48, 4, 3, 2, 6),  # 4 -> 2
    (50, 2, 6, 3, 4),  # padded: W pads 50 to 50, M pads the rest to a multiple of 3
    (23, 4, 3, 2, 6),  # padded at W (23 -> 24)
    (23, 2, 6, 4, 3),
    (37, 3, 4, 6, 2),
    (37, 2, 3, 3, 2),  # the global batch changes (6 -> 6 with 3 x 2): still every sample once
    (37, 2, 4, 3, 4),  # 8 -> 12: a user's own loop that keeps its per-rank batch
]


@pytest.mark.parametrize("num_samples,old_ws,old_b,new_ws,new_b", RESIZES)
def test_resize_sees_every_remaining_sample_exactly_once(num_samples, old_ws, old_b, new_ws, new_b):
    uninterrupted = _global_batches(_loaders(num_samples, old_ws, old_b))
    order = _epoch_order(num_samples, 0)
    for cut in range(1, len(uninterrupted)):
        before, state = _saved_state(_loaders(num_samples, old_ws, old_b), cut)
        assert before == uninterrupted[:cut]
        resumed = _loaders(num_samples, new_ws, new_b)
        for loader in resumed:
            loader.load_state_dict(state)
        after = _global_batches(resumed)
        consumed = cut * old_b * old_ws  # the global cursor: samples of the epoch done
        assert state["samples_done"] == consumed
        seen_after = collections.Counter(i for batch in after for i in batch)
        remaining = order[consumed:] if consumed < num_samples else []
        for index in remaining:  # counted: every remaining sample of the epoch exactly once
            assert seen_after[index] == 1, (cut, index, seen_after[index])
        # the rest is padding: positions past the epoch's end, as torch pads (its first indices
        # again), to make every rank's shard the same length; never more than one row of ranks
        # beyond what the W-rank run padded
        padding = sum(seen_after.values()) - len(remaining)
        old_end = -(-num_samples // old_ws) * old_ws
        new_end = consumed + -(-(old_end - consumed) // new_ws) * new_ws
        assert padding == new_end - max(consumed, num_samples)
        cycle = [order[p % num_samples] for p in range(max(consumed, num_samples), new_end)]
        assert seen_after - collections.Counter(remaining) == collections.Counter(cycle)
        if num_samples % old_ws == 0 and num_samples % new_ws == 0:  # no padding anywhere:
            assert not set(seen_after) & {i for b in before for i in b}  # nothing seen again
        if old_b * old_ws == new_b * new_ws and new_end == old_end:
            # the same global batch: each step trains on the same samples as the W-rank run
            assert [sorted(b) for b in after] == [sorted(b) for b in uninterrupted[cut:]]
        for loader in resumed:  # the next epoch is a fresh one at the new size
            assert loader.epoch == 1 and loader.state_dict()["samples_done"] == 0


def test_resize_with_drop_last_never_repeats_and_drops_less_than_a_row():
    order = _epoch_order(50, 0)
    before, state = _saved_state(_loaders(50, 2, 6, drop_last=True), 2)
    resumed = _loaders(50, 3, 4, drop_last=True)
    for loader in resumed:
        loader.load_state_dict(state)
    after = [i for b in _global_batches(resumed) for i in b]
    assert len(after) == len(set(after))  # drop_last: nothing twice, no padding
    assert not set(after) & {i for b in before for i in b}
    # W = 2 trains 4 whole global batches of 12 (positions 0-47) and drops the last 2; after 2
    # of them, M = 3 trains whole batches of 12 from the 26 positions left: 24-47, the same
    assert sorted(after) == sorted(order[24:48])


def test_resize_mid_pass_twice_keeps_the_global_cursor():
    """2 -> 3 -> 4 ranks within one epoch: a position saved by a resized pass resizes again."""
    uninterrupted = _global_batches(_loaders(48, 2, 6))
    first, state = _saved_state(_loaders(48, 2, 6), 1)
    middle_loaders = _loaders(48, 3, 4)
    for loader in middle_loaders:
        loader.load_state_dict(state)
    middle, state = _saved_state(middle_loaders, 1)
    assert state["samples_done"] == 24
    last_loaders = _loaders(48, 4, 3)
    for loader in last_loaders:
        loader.load_state_dict(state)
    rest = _global_batches(last_loaders)
    steps = first + middle + rest
    assert [sorted(b) for b in steps] == [sorted(b) for b in uninterrupted]


def test_resize_respects_max_batches_in_global_samples():
    # each pass capped at 3 global batches of 12: 36 of the 48 samples
    uninterrupted = _global_batches(_loaders(48, 2, 6, max_batches=3))
    assert len(uninterrupted) == 3
    _, state = _saved_state(_loaders(48, 2, 6, max_batches=3), 1)
    # one rank with 2 micro-steps of 6 keeps the global batch: the job's cap is then 3 x 2
    resumed = _loaders(48, 1, 6, max_batches=3 * 2)
    for loader in resumed:
        loader.load_state_dict(state)
    after = _global_batches(resumed)
    assert sorted(i for b in after for i in b) == sorted(i for b in uninterrupted[1:] for i in b)


def test_loading_a_state_of_another_dataset_length_is_refused():
    _, state = _saved_state(_loaders(48, 2, 6), 1)
    loader = _loaders(40, 2, 6)[0]
    with pytest.raises(ConfigError, match=r"len\(dataset\)=40, .* 48 samples"):
        loader.load_state_dict(state)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.tensor(i),) for i in range(40)])


def test_a_stream_position_at_another_world_size_is_refused_in_one_line():
    loaders = [ddpkit.build_train_loader(_Stream(), _runtime(r, 2), batch_size=4) for r in range(2)]
    _, state = _saved_state(loaders, 2)
    other = ddpkit.build_train_loader(_Stream(), _runtime(0, 3), batch_size=4)
    with pytest.raises(ConfigError) as error:
        other.load_state_dict(state)
    message = str(error.value)
    assert "\n" not in message
    assert "world_size=3" in message and "written by world_size 2" in message
    assert "map-style" in message  # the fix: a dataset with __len__/__getitem__ resizes
    same = ddpkit.build_train_loader(_Stream(), _runtime(0, 2), batch_size=4)
    same.load_state_dict(state)  # the same world size resumes as before


def test_old_state_without_a_global_cursor_resumes_at_its_own_world_size():
    """Checkpoints written before the global cursor hold ``{"epoch", "batches_done"}``."""
    reference = _global_batches(_loaders(48, 2, 6))
    resumed = _loaders(48, 2, 6)
    for loader in resumed:
        loader.load_state_dict({"epoch": 0, "batches_done": 2})
    assert _global_batches(resumed) == reference[2:]


@pytest.mark.parametrize(
    "global_batch,world_size,batch_size,expected",
    [
        (128, 2, 64, (64, 1)),  # the size it was set for: unchanged
        (128, 4, 64, (32, 1)),  # more ranks: a smaller per-rank batch
        (128, 1, 64, (64, 2)),  # fewer ranks: the per-rank batch kept, more micro-steps
        (12, 2, 4, (3, 2)),  # 6 per rank: the largest batch <= 4 that divides 6 is 3
        (12, 3, 6, (4, 1)),
        (256, 4, 64, (64, 1)),  # 64 x 2 micro-steps on 2 ranks -> 64 x 1 on 4
        (7, 7, 1, (1, 1)),
    ],
)
def test_fit_global_batch_keeps_the_global_batch(global_batch, world_size, batch_size, expected):
    fitted = ddpkit.fit_global_batch(global_batch, world_size, batch_size=batch_size)
    assert fitted == expected
    assert fitted[0] * fitted[1] * world_size == global_batch and fitted[0] <= batch_size


def test_fit_global_batch_refuses_in_one_line_naming_the_sizes_that_work():
    with pytest.raises(ConfigError) as error:
        ddpkit.fit_global_batch(128, 3, batch_size=64)
    message = str(error.value)
    assert "\n" not in message
    assert "global_batch_size=128" in message and "world_size=3" in message
    assert "1, 2, 4, 8, 16, 32, 64, 128" in message


@pytest.mark.parametrize("args", [(0, 2), (128, 0), (128, 2.0), (True, 2)])
def test_fit_global_batch_refuses_bad_input(args):
    with pytest.raises(ConfigError, match="positive integer"):
        ddpkit.fit_global_batch(*args, batch_size=4)


def _draws() -> tuple:
    import random

    import numpy as np

    return float(torch.rand(1)), float(np.random.rand()), random.random()


def _states_after(seeds: list[int]) -> list[dict]:
    from ddpkit.checkpoint.state import rng_state

    states = []
    for seed in seeds:
        torch.manual_seed(seed)
        __import__("numpy").random.seed(seed)
        __import__("random").seed(seed)
        states.append(rng_state())
    return states


def test_rng_on_another_world_size_continues_a_shared_state_on_every_rank():
    from ddpkit.checkpoint.rng import restore_rng_state
    from ddpkit.checkpoint.state import set_rng_state

    saved = _states_after([4, 4])  # one seed on every rank: the usual DDP job
    set_rng_state(saved[0])
    expected = _draws()
    for rank in range(3):
        note = restore_rng_state(saved, rank, 3, step=10)
        assert _draws() == expected  # rank 2 too: what every rank of the 2-rank run drew next
    assert note == "RNG states: torch, numpy, python as the 2 saved ranks shared it"


def test_rng_on_another_world_size_keeps_per_rank_states_and_seeds_new_ranks():
    from ddpkit.checkpoint.rng import restore_rng_state
    from ddpkit.checkpoint.state import set_rng_state

    saved = _states_after([1, 2])  # per-rank seeds: every generator differs
    own = []
    for state in saved:
        set_rng_state(state)
        own.append(_draws())
    draws, notes = [], []
    for rank in range(3):
        notes.append(restore_rng_state(saved, rank, 3, step=10))
        draws.append(_draws())
    assert draws[:2] == own  # ranks 0 and 1 go on with their own streams
    assert all(value not in {o[i] for o in own} for i, value in enumerate(draws[2]))
    restore_rng_state(saved, 2, 3, step=10)
    assert _draws() == draws[2]  # derived from (step, rank): the same on a rerun
    restore_rng_state(saved, 2, 3, step=11)
    assert _draws() != draws[2]
    assert notes[0] == (
        "RNG states: torch, numpy, python per rank (ranks 0-1 their own, rank 2 seeded from "
        "(step, rank))"
    )
    fewer = restore_rng_state(_states_after([1, 2, 3]), 0, 2, step=10)
    assert fewer.endswith("per rank (ranks 0-1 their own, saved rank 2 dropped)")


def test_rng_on_another_world_size_decides_each_generator_on_its_own():
    """``ddpkit train`` seeds torch alike on every rank, numpy and python not at all."""
    import random

    import numpy as np

    from ddpkit.checkpoint.rng import restore_rng_state
    from ddpkit.checkpoint.state import rng_state

    saved = []
    for seed in (1, 2):
        torch.manual_seed(0)
        np.random.seed(seed)
        random.seed(seed)
        saved.append(rng_state())
    torch.manual_seed(0)
    shared_torch = float(torch.rand(1))
    note = restore_rng_state(saved, 2, 4, step=10)
    assert float(torch.rand(1)) == shared_torch  # rank 2 continues the shared torch stream
    assert note == (
        "RNG states: torch as the 2 saved ranks shared it; numpy, python per rank (ranks 0-1 "
        "their own, ranks 2-3 seeded from (step, rank))"
    )


@pytest.mark.parametrize("num_samples", [1, 11, 12, 13, 23, 25, 47, 48, 49, 71])
def test_epoch_steps_are_the_same_on_every_world_size_that_keeps_the_global_batch(num_samples):
    """What lets ``ddpkit train`` resume its LR schedule (steps x epochs) on another size."""
    expected = -(-num_samples // 12)
    for world_size in (1, 2, 3, 4, 6, 12):
        batch_size, micro_steps = ddpkit.fit_global_batch(12, world_size, batch_size=5)
        loader = _loaders(num_samples, world_size, batch_size)[0]
        assert -(-len(loader) // micro_steps) == expected, world_size
