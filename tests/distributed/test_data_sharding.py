"""Sharding that never silently goes wrong: no empty passes, streams split by rank x worker,
settings that must agree checked across ranks, different batch sizes warned about."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import IterableDataset, TensorDataset

import ddpkit
from ddpkit.testing import DistributedTestError, run_distributed

FORK = {"multiprocessing_context": "fork"}  # forkserver-born ranks: see test_data_randomness


def _messages(error: DistributedTestError) -> list[str]:
    """The last line of each failed rank's traceback (1 or all: the harness kills the rest)."""
    assert error.failures, error.header
    return [text.strip().splitlines()[-1] for text in error.failures.values()]


# --- a pass with no batch ------------------------------------------------------------------


def _build(runtime, length: int, batch_size: int, drop_last: bool) -> list[int]:
    data = TensorDataset(torch.arange(length))
    loader = ddpkit.build_train_loader(data, runtime, batch_size=batch_size, drop_last=drop_last)
    return [len(list(loader)) for _ in range(2)]


@pytest.mark.slow
def test_a_pass_without_a_batch_is_an_error_naming_the_numbers():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_build, 2, args=(10, 8, True))
    for message in _messages(info.value):
        assert message.startswith(
            "ddpkit.errors.ConfigError: empty pass: len(dataset)=10, world_size=2, "
            "batch_size=8, drop_last=True give each rank 0 batches (5 samples per rank)."
        ), message
        assert "use a smaller batch_size, drop_last=False, or fewer processes" in message


def test_without_drop_last_a_tiny_dataset_still_gives_every_rank_a_batch():
    # DistributedSampler pads: 1 sample for 3 ranks -> one batch of 1 on each rank
    assert run_distributed(_build, 3, args=(1, 8, False)) == [[1, 1]] * 3


def _evaluate_tiny(runtime) -> dict:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2, 3), torch.tensor([0, 1]))
    loader = ddpkit.build_eval_loader(data, runtime, batch_size=4)
    return {"batches": len(list(loader)), **ddpkit.evaluate(nn.Linear(3, 2), loader, runtime)}


def test_evaluation_with_empty_shards_counts_every_sample_once():
    results = run_distributed(_evaluate_tiny, 3)
    assert [r["batches"] for r in results] == [1, 1, 0]  # rank 2's shard is empty: fine
    assert {r["num_samples"] for r in results} == {2}


def test_evaluation_refuses_drop_last_and_empty_data():
    runtime = ddpkit.init_runtime()
    with runtime:
        data = TensorDataset(torch.arange(4))
        with pytest.raises(ddpkit.ConfigError, match="drop_last=True would leave samples out"):
            ddpkit.build_eval_loader(data, runtime, batch_size=2, drop_last=True)
        with pytest.raises(ddpkit.ConfigError, match="empty evaluation dataset"):
            ddpkit.build_eval_loader(TensorDataset(torch.arange(0)), runtime, batch_size=2)


# --- streams -------------------------------------------------------------------------------


class Stream(IterableDataset):
    """range(length), the same in every process; with or without __len__."""

    def __init__(self, length: int, sized: bool = False) -> None:
        self.length = length
        self.sized = sized
        self.epochs: list[int] = []

    def __iter__(self):
        return iter(range(self.length))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no len")  # what an IterableDataset without __len__ does
        return self.length

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def _stream_pass(runtime, length: int, drop_last: bool, num_workers: int, sized: bool) -> dict:
    stream = Stream(length, sized)
    kwargs = {"num_workers": num_workers, **FORK} if num_workers else {}
    loader = ddpkit.build_train_loader(stream, runtime, batch_size=3, drop_last=drop_last, **kwargs)
    batches = [batch.tolist() for batch in loader]
    return {
        "batches": batches,
        "len": len(loader) if sized else None,
        "epochs": stream.epochs,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_stream_gives_each_item_to_one_rank_and_worker(world_size):
    length = 12 * world_size  # a multiple of world_size x 2 workers x batch 3: nothing padded
    results = run_distributed(_stream_pass, world_size, args=(length, False, 2, True))
    seen = [i for r in results for batch in r["batches"] for i in batch]
    assert sorted(seen) == list(range(length))
    assert {len(r["batches"]) for r in results} == {4} == {r["len"] for r in results}
    assert [r["epochs"] for r in results] == [[0]] * world_size


def test_a_ragged_stream_is_padded_like_the_sampler_so_ranks_stay_even():
    # 22 items, 2 ranks x 2 workers: rows of 4, the last row holds 2 -> 2 padding items, the
    # stream's first two, as DistributedSampler pads with the first indices
    results = run_distributed(_stream_pass, 2, args=(22, False, 2, False))
    counts = Counter(i for r in results for batch in r["batches"] for i in batch)
    assert sorted(counts) == list(range(22))
    assert [i for i, n in counts.items() if n == 2] == [0, 1]
    assert [len(r["batches"]) for r in results] == [4, 4]
    sizes = [[len(b) for b in r["batches"]] for r in results]
    assert sizes[0] == sizes[1]  # same size at every step on both ranks


def test_a_ragged_stream_with_drop_last_keeps_full_batches_only():
    results = run_distributed(_stream_pass, 2, args=(22, True, 0, True))
    seen = [i for r in results for batch in r["batches"] for i in batch]
    assert len(seen) == len(set(seen)) == 18  # 11 per rank -> 3 full batches of 3
    assert [len(r["batches"]) for r in results] == [3, 3] == [r["len"] for r in results]


def test_a_stream_too_short_for_one_batch_is_an_error_at_the_end_of_the_pass():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_stream_pass, 2, args=(10, True, 2, False))
    for message in _messages(info.value):
        assert "empty pass: the stream Stream gave rank" in message
        assert "world_size=2, num_workers=2, batch_size=3, drop_last=True" in message


def _stream_resume(runtime) -> list[tuple[list, list]]:
    def loader():
        return ddpkit.build_train_loader(Stream(26), runtime, batch_size=3, num_workers=2, **FORK)

    whole = [b.tolist() for b in loader()]  # 2 workers x (3, 3, 1) items: 6 batches
    pairs = []
    for cut in (1, 2, 3, 5):  # stop after `cut` batches, resume in a fresh loader
        first = loader()
        for number, _ in enumerate(first):
            if number + 1 == cut:
                state = first.state_dict()
                break
        resumed = loader()
        resumed.load_state_dict(state)
        pairs.append((whole[cut:], [b.tolist() for b in resumed]))
    return pairs


def test_a_stream_resumes_mid_pass_exactly():
    for pairs in run_distributed(_stream_resume, 2):
        for want, got in pairs:
            assert got == want


def _eval_stream(runtime) -> list[int]:
    loader = ddpkit.build_eval_loader(Stream(11), runtime, batch_size=2, num_workers=2, **FORK)
    return [i for batch in loader for i in batch.tolist()]


def test_a_stream_in_evaluation_is_seen_exactly_once():
    shards = run_distributed(_eval_stream, 2)
    assert sorted(shards[0] + shards[1]) == list(range(11))


def test_a_stream_without_len_says_so():
    runtime = ddpkit.init_runtime()
    with runtime:
        loader = ddpkit.build_train_loader(Stream(5), runtime, batch_size=2)
        with pytest.raises(TypeError, match="the stream Stream has no __len__"):
            len(loader)
        assert sum(len(b) for b in loader) == 5
        with pytest.raises(ddpkit.ConfigError, match="persistent_workers=True with a stream"):
            ddpkit.build_train_loader(
                Stream(5), runtime, batch_size=2, num_workers=1, persistent_workers=True
            )


# --- settings that must agree; batch sizes ----------------------------------------------


def _per_rank_settings(runtime, key: str) -> int:
    settings = {"seed": 0, "length": 16, "num_workers": 0}
    settings[key] = settings[key] + runtime.rank
    data = (
        Stream(settings["length"])
        if key == "num_workers"
        else TensorDataset(torch.arange(settings["length"]))
    )
    kwargs = {"num_workers": settings["num_workers"], **FORK} if settings["num_workers"] else {}
    loader = ddpkit.build_train_loader(data, runtime, batch_size=4, seed=settings["seed"], **kwargs)
    return len(list(loader))


@pytest.mark.parametrize(
    "key,named",
    [
        ("seed", "seed: rank 0 0, rank 1 1"),
        ("length", "len(dataset): rank 0 16, rank 1 17"),
        ("num_workers", "num_workers: rank 0 0, rank 1 1"),
    ],
)
def test_settings_that_break_the_sharding_are_refused_on_every_rank(key, named):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_per_rank_settings, 2, args=(key,))
    for message in _messages(info.value):
        assert message.startswith("ddpkit.errors.ConfigError: train loader settings differ")
        assert named in message and "Pass the same values on every rank." in message


def _different_batch_sizes(runtime, sizes: tuple[int, int], use_accumulator: bool):
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ddpkit").addHandler(handler)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(22, 3), torch.randint(0, 2, (22,)))
    loader = ddpkit.build_train_loader(data, runtime, batch_size=sizes[runtime.rank], shuffle=False)
    model = ddpkit.wrap_model(nn.Linear(3, 2), runtime)
    if use_accumulator:
        windows = ddpkit.GradientAccumulator(model, runtime).windows(loader)
        window = next(windows)
        for micro in window:
            with micro:
                x, y = micro.batch
                micro.backward(F.cross_entropy(model(x), y))
        batch = window.micro_batches[0]
    else:
        batch = next(iter(loader))
        F.cross_entropy(model(batch[0]), batch[1]).backward()
    x_all = torch.cat(ddpkit.all_gather(batch[0], runtime))
    y_all = torch.cat(ddpkit.all_gather(batch[1], runtime))
    reference = nn.Linear(3, 2)
    reference.load_state_dict(ddpkit.model_state_dict(model))
    F.cross_entropy(reference(x_all), y_all).backward()  # the mean over both ranks' samples
    same = torch.allclose(ddpkit.unwrap_model(model).weight.grad, reference.weight.grad)
    return records, same


def test_different_batch_sizes_in_a_plain_loop_are_warned_about_once():
    # 11 samples per rank: batches of 5 and 6 give 3 and 2 batches per pass
    (records, same), (quiet, _) = run_distributed(_different_batch_sizes, 2, args=((5, 6), False))
    assert len(records) == 1 and quiet == []  # rank 0 warns, once
    assert records[0].startswith("ranks use different batch sizes (rank 0 5, rank 1 6):")
    assert "a sample in a batch of 5 weighs 1.2x one in a batch of 6" in records[0]
    assert "the batches per pass differ (rank 0 3, rank 1 2)" in records[0]
    assert not same  # what the warning is about: DDP averaged the two per-rank means


def test_the_accumulator_weighs_every_sample_equally_with_different_batch_sizes():
    # batches of 4 and 5: 3 batches per pass on both ranks, so nothing to warn about
    (records, same), _ = run_distributed(_different_batch_sizes, 2, args=((4, 5), True))
    assert records == []
    assert same  # the global mean over all 9 samples, not a mean of means
