"""Data randomness: the shuffle is shared by every rank, augmentation draws are not.

Workers are seeded from (seed, rank, epoch) and main-process loading from (seed, rank, epoch,
batch), so every (rank, worker) stream differs, and the same seed repeats every draw."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

import ddpkit
from ddpkit.testing import run_distributed

NUM_SAMPLES = 24
SEED = 7


class Augmented(Dataset):
    """Sample i: (i, worker id or -1, torch draw, numpy draw, python draw)."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int):
        info = get_worker_info()
        worker = info.id if info is not None else -1
        draws = torch.tensor([torch.rand(1).item(), np.random.rand(), random.random()])
        return index, worker, draws.double()


def _seed_everything_identically() -> None:
    torch.manual_seed(0)  # the usual script: one seed, the same on every rank
    np.random.seed(0)
    random.seed(0)


def _passes(runtime, num_workers: int, num_passes: int = 2) -> list[list[tuple]]:
    """Per pass: (index, worker, torch draw, numpy draw, python draw) of each sample seen."""
    _seed_everything_identically()
    # fork: the ranks come from a forkserver, whose default context would start each worker
    # through a fresh forkserver of its own (a 5 s torch import per pass)
    workers = {"num_workers": num_workers, "multiprocessing_context": "fork"} if num_workers else {}
    loader = ddpkit.build_train_loader(Augmented(), runtime, batch_size=3, seed=SEED, **workers)
    passes = []
    for _ in range(num_passes):
        rows = []
        for index, worker, draws in loader:
            rows += [
                (int(i), int(w), *d.tolist()) for i, w, d in zip(index, worker, draws, strict=True)
            ]
        passes.append(rows)
    return passes


def _sampler_order(rank: int, epoch: int) -> list[int]:
    sampler = DistributedSampler(range(NUM_SAMPLES), num_replicas=2, rank=rank, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def _streams(results) -> dict[tuple[int, int, int], list[tuple[float, ...]]]:
    """(pass, rank, worker) -> that stream's draws."""
    streams: dict[tuple[int, int, int], list[tuple[float, ...]]] = {}
    for rank, passes in enumerate(results):
        for number, rows in enumerate(passes):
            for _, worker, *draws in rows:
                streams.setdefault((number, rank, worker), []).append(tuple(draws))
    return streams


def test_workers_draw_differently_on_every_rank_with_a_shared_order_and_repeat():
    first = run_distributed(_passes, 2, args=(2,))
    for rank, passes in enumerate(first):
        for epoch, rows in enumerate(passes):
            assert [row[0] for row in rows] == _sampler_order(rank, epoch)
    streams = _streams(first)
    assert {(r, w) for _, r, w in streams} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    every_draw = [value for draws in streams.values() for d in draws for value in d]
    assert len(set(every_draw)) == len(every_draw)  # no draw repeats across (rank, worker, pass)
    again = run_distributed(_passes, 2, args=(2,))
    assert again == first  # same seed: the same draws, bitwise


def test_main_process_loading_draws_differently_per_rank_and_repeats():
    first = run_distributed(_passes, 2, args=(0,))
    for rank, passes in enumerate(first):
        for epoch, rows in enumerate(passes):
            assert [row[0] for row in rows] == _sampler_order(rank, epoch)
    draws = [tuple(row[2:]) for passes in first for rows in passes for row in rows]
    values = [v for d in draws for v in d]
    assert len(set(values)) == len(values)  # rank 0 and rank 1 (and the passes) all differ
    assert run_distributed(_passes, 2, args=(0,)) == first


def _training_stream_untouched_and_resume_exact(runtime) -> None:
    _seed_everything_identically()
    reference = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    _seed_everything_identically()
    loader = ddpkit.build_train_loader(Augmented(), runtime, batch_size=3, seed=SEED)
    whole = [(i.tolist(), d) for i, _, d in loader]
    after = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    # loading drew from its own per-batch RNGs: the training stream (dropout, ...) is untouched
    assert torch.equal(after[0], reference[0]) and np.array_equal(after[1], reference[1])
    assert after[2] == reference[2]
    cut = ddpkit.build_train_loader(Augmented(), runtime, batch_size=3, seed=SEED)
    cut.set_epoch(0)
    for number, _ in enumerate(cut):
        if number == 1:
            state = cut.state_dict()  # two batches handed out
            break
    resumed = ddpkit.build_train_loader(Augmented(), runtime, batch_size=3, seed=SEED)
    resumed.load_state_dict(state)
    rest = [(i.tolist(), d) for i, _, d in resumed]
    assert [i for i, _ in rest] == [i for i, _ in whole[2:]]
    for (_, got), (_, want) in zip(rest, whole[2:], strict=True):
        assert torch.equal(got, want)  # bitwise the augmentation of the uninterrupted pass


def test_main_process_loading_leaves_the_training_rng_alone_and_resumes_bitwise():
    run_distributed(_training_stream_untouched_and_resume_exact, 2)


def test_a_generator_argument_is_refused():
    runtime = ddpkit.init_runtime()
    with runtime:
        try:
            ddpkit.build_train_loader(
                Augmented(), runtime, batch_size=4, generator=torch.Generator()
            )
        except ddpkit.ConfigError as exc:
            assert "generator= is not accepted" in str(exc) and "pass seed=" in str(exc)
        else:
            raise AssertionError("generator= was accepted")
