"""Every rank trains and evaluates on the same data: the silent-wrong-result classes of issue 23.

Each fault is caused for real on 2-3 gloo ranks; where plain torch has the same fault, the test
runs plain torch's way too and asserts the wrong result it gives.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    random_split,
)

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.testing import DistributedTestError, run_distributed


def _messages(error: DistributedTestError) -> list[str]:
    assert error.failures, error.header
    return [text.strip().splitlines()[-1] for text in error.failures.values()]


# --- 1. every rank built the same dataset --------------------------------------------------


def _split(seed: int) -> tuple[Dataset, Dataset]:
    torch.manual_seed(seed)
    data = TensorDataset(torch.arange(40).float().unsqueeze(1), torch.arange(40) % 3)
    return random_split(data, [34, 6])


def _per_rank_split(runtime, use_ddpkit: bool, which: str):
    """A per-rank seed (as for augmentation) set before random_split: each rank its own split."""
    train, val = _split(seed=runtime.rank)
    if not use_ddpkit:  # plain torch: DistributedSampler only checks nothing
        sampler = DistributedSampler(train, num_replicas=runtime.world_size, rank=runtime.rank)
        trained = [int(train.indices[i]) for i in sampler]
        return {"trained": trained, "val": [int(i) for i in val.indices]}
    if which == "train":
        ddpkit.build_train_loader(train, runtime, batch_size=4)
    else:
        ddpkit.build_eval_loader(val, runtime, batch_size=4)
    return "built"


@pytest.mark.slow  # several seconds (plain torch trains on both ranks): out of the inner loop
def test_plain_torch_trains_on_the_validation_samples_of_another_rank():
    results = run_distributed(_per_rank_split, 2, args=(False, "train"))
    trained = set(results[0]["trained"]) | set(results[1]["trained"])
    leaked = trained & (set(results[0]["val"]) | set(results[1]["val"]))
    assert leaked  # exit 0, held-out samples trained on: what ddpkit refuses below


@pytest.mark.parametrize(
    "which,what",
    [
        ("train", "the train dataset (Subset of TensorDataset)"),
        ("eval", "the evaluation dataset (Subset of TensorDataset)"),
    ],
)
@pytest.mark.slow
def test_a_per_rank_split_is_refused_on_every_rank(which, what):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_per_rank_split, 2, args=(True, which))
    messages = _messages(info.value)
    assert len(messages) >= 1
    for message in messages:
        assert message.startswith(f"ddpkit.errors.ConfigError: {what} differs across ranks: "), (
            message
        )
        assert "indices" in message.split("differ (")[0] and "ranks 0 | ranks 1" in message
        assert "compared: indices, length, tensors" in message
        assert "generator=torch.Generator().manual_seed(0)" in message


class Augmented(Dataset):
    """Random crops in __getitem__ (torch's global RNG), fixed labels: random by design."""

    def __init__(self, n: int) -> None:
        self.targets = torch.arange(n) % 5

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return torch.rand(3) + i, int(self.targets[i])


class Relabelled(Augmented):
    """Class ids in an order that differs by rank (what list(set(names)) does across hash seeds)."""

    def __init__(self, n: int, rank: int) -> None:
        super().__init__(n)
        self.targets = [(i + rank) % 5 for i in range(n)]  # a list, as many datasets keep


def _build_kind(runtime, kind: str) -> int:
    torch.manual_seed(runtime.rank)  # per-rank seed: augmentation and model init differ
    if kind == "augmented":
        data: Dataset = Augmented(20)
    elif kind == "relabelled":
        data = Relabelled(20, runtime.rank)
    else:  # synthetic data drawn after the per-rank seed
        data = TensorDataset(torch.randn(20, 3), torch.zeros(20, dtype=torch.long))
    loader = ddpkit.build_train_loader(data, runtime, batch_size=5, seed=0)
    ddpkit.build_eval_loader(data, runtime, batch_size=5)
    return len(loader)


def test_random_augmentation_in_getitem_is_no_false_alarm():
    assert run_distributed(_build_kind, 3, args=("augmented",)) == [2, 2, 2]


@pytest.mark.parametrize(
    "kind,differs", [("relabelled", "targets differ"), ("synthetic", "tensors differ")]
)
def test_labels_or_tensors_that_differ_by_rank_are_refused(kind, differs):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_build_kind, 2, args=(kind,))
    for message in _messages(info.value):
        assert "differs across ranks: " + differs in message, message


# --- 3. weighted and custom samplers -------------------------------------------------------


def _weights() -> torch.Tensor:
    weights = torch.ones(50, dtype=torch.double)
    weights[:10] = 0.0  # never drawn
    weights[10:20] = 8.0
    return weights


def _weighted(runtime, use_ddpkit: bool, stop_after: int | None):
    """Indices drawn per rank in epoch 0 (and 1), the ddpkit or the plain torch way."""
    data = TensorDataset(torch.arange(50))
    sampler = WeightedRandomSampler(_weights(), num_samples=200, replacement=True)
    if not use_ddpkit:
        torch.manual_seed(0)  # the same seed on every rank, as users do for model init
        loader = DataLoader(data, batch_size=10, sampler=sampler)
        return [int(i) for (b,) in loader for i in b]
    loader = ddpkit.build_train_loader(data, runtime, batch_size=10, sampler=sampler, seed=3)
    epochs = []
    for _ in range(2):
        drawn = []
        for (batch,) in loader:
            drawn += [int(i) for i in batch]
            if stop_after is not None and len(drawn) == stop_after:
                return {"drawn": drawn, "state": loader.state_dict()}
        epochs.append(drawn)
    return epochs


def _resumed(runtime, state: dict) -> list[int]:
    data = TensorDataset(torch.arange(50))
    sampler = WeightedRandomSampler(_weights(), num_samples=200, replacement=True)
    loader = ddpkit.build_train_loader(data, runtime, batch_size=10, sampler=sampler, seed=3)
    loader.load_state_dict(state)
    return [int(i) for (b,) in loader for i in b]


def test_plain_torch_draws_the_weighted_epoch_on_every_rank():
    ranks = run_distributed(_weighted, 2, args=(False, None))
    assert [len(r) for r in ranks] == [200, 200]  # 400 per epoch where 200 were meant
    assert ranks[0] == ranks[1]  # and the same 200 twice


def test_weighted_sampling_is_one_draw_split_across_ranks_and_resumes_on_another_size():
    two = run_distributed(_weighted, 2, args=(True, None))
    whole = run_distributed(_weighted, 1, args=(True, None))[0]
    for epoch in range(2):
        parts = [two[0][epoch], two[1][epoch]]
        assert [len(p) for p in parts] == [100, 100]  # 200 per epoch in all
        interleaved = [parts[p % 2][p // 2] for p in range(200)]
        assert interleaved == whole[epoch]  # the same draw as one process makes
        assert not {i for p in parts for i in p} & set(range(10))  # weight 0: never drawn
    assert whole[0] != whole[1]  # a new draw every epoch
    heavy = sum(10 <= i < 20 for i in whole[0]) / 200  # 80 of 120 weight: 2/3 expected
    assert 0.55 < heavy < 0.78, heavy
    # stop after 3 batches per rank (60 of 200 positions), resume on 3 ranks: the other 140
    stopped = run_distributed(_weighted, 2, args=(True, 30))
    assert stopped[0]["state"] == stopped[1]["state"]
    rest = run_distributed(_resumed, 3, args=(stopped[0]["state"],))
    assert sorted(stopped[0]["drawn"] + stopped[1]["drawn"]) == sorted(whole[0][:60])
    # positions 60..199 on 3 ranks: padded to 141 with position 0 again, as torch pads
    assert sorted(sum(rest, [])) == sorted(whole[0][60:] + whole[0][:1])


def _single() -> ddpkit.Runtime:
    return ddpkit.Runtime(ProcessInfo())


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"sampler": RandomSampler(range(8))}, "sampler=RandomSampler is not accepted"),
        ({"batch_sampler": [[0, 1]]}, "batch_sampler=list is not accepted"),
        (
            {"sampler": WeightedRandomSampler([1.0] * 3, 4)},
            "WeightedRandomSampler has len(weights)=3 but len(dataset)=8",
        ),
    ],
)
def test_other_samplers_are_refused_in_one_line(kwargs, expected):
    data = TensorDataset(torch.arange(8))
    with pytest.raises(ddpkit.ConfigError) as info:
        ddpkit.build_train_loader(data, _single(), batch_size=2, **kwargs)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_sampler_in_evaluation_is_refused():
    data = TensorDataset(torch.arange(8))
    weighted = WeightedRandomSampler([1.0] * 8, 4)
    with pytest.raises(ddpkit.ConfigError, match="sampler=WeightedRandomSampler is not accepted"):
        ddpkit.build_eval_loader(data, _single(), batch_size=2, sampler=weighted)


# --- 5. gathers in dataset order -----------------------------------------------------------


def _gathered_predictions(runtime, use_ddpkit: bool) -> float:
    """Accuracy of a perfect "model" (it looks the label up) scored the usual way: gather the
    predictions, concatenate, compare with the labels in dataset order."""
    labels = torch.arange(23) % 4
    data = TensorDataset(torch.arange(23), labels)
    if use_ddpkit:
        loader = ddpkit.build_eval_loader(data, runtime, batch_size=4)
    else:
        sampler = DistributedSampler(data, runtime.world_size, runtime.rank, shuffle=False)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
    preds = torch.cat([labels[x] for x, _ in loader])
    gathered = torch.cat(ddpkit.all_gather(preds, runtime))[: len(labels)]
    return (gathered == labels).float().mean().item()


def test_gathered_eval_predictions_are_in_dataset_order():
    assert run_distributed(_gathered_predictions, 3, args=(True,)) == [1.0] * 3
    plain = run_distributed(_gathered_predictions, 3, args=(False,))
    assert plain[0] < 0.5  # interleaved shards: the same gather scores like chance


# --- the fingerprint's pieces, one process -------------------------------------------------


def test_the_fingerprint_names_the_string_hash_cause_when_the_runtime_saw_one():
    from ddpkit.data.fingerprint import dataset_fingerprint, fingerprint_mismatch

    a = dataset_fingerprint(Relabelled(10, rank=0))
    b = dataset_fingerprint(Relabelled(10, rank=1))
    assert fingerprint_mismatch([a, a], "the train dataset (X)", False) is None
    hashed = fingerprint_mismatch([a, b], "the train dataset (X)", False)
    assert "targets differ" in hashed and "export PYTHONHASHSEED=0" in hashed
    assert "PYTHONHASHSEED" not in fingerprint_mismatch([a, b], "the train dataset (X)", True)


def test_the_fingerprint_sees_concat_sizes_and_ignores_augmentation():
    from torch.utils.data import ConcatDataset

    from ddpkit.data.fingerprint import dataset_fingerprint

    torch.manual_seed(0)
    first = dataset_fingerprint(Augmented(12))
    torch.manual_seed(1)
    assert dataset_fingerprint(Augmented(12)) == first  # random items: the same fingerprint
    assert set(first) == {"length", "targets"}
    whole = TensorDataset(torch.arange(10))
    one = dataset_fingerprint(ConcatDataset([torch.utils.data.Subset(whole, range(4)), whole]))
    other = dataset_fingerprint(ConcatDataset([torch.utils.data.Subset(whole, range(1, 5)), whole]))
    assert one["length"] == other["length"] == "14" and one["indices"] != other["indices"]


def test_labels_of_objects_and_bfloat16_rows_fingerprint_alike_in_two_builds():
    import numpy as np

    from ddpkit.data.fingerprint import dataset_fingerprint

    class Labelled(Dataset):
        def __init__(self, labels) -> None:
            self.labels = labels

        def __len__(self) -> int:
            return len(self.labels)

    class Note:  # no __repr__ of its own: the default one holds an address
        pass

    def strings():  # new str objects each call: an object array's bytes are their addresses
        return np.array([f"class-{i % 3}" for i in range(30)], dtype=object)

    assert dataset_fingerprint(Labelled(strings())) == dataset_fingerprint(Labelled(strings()))
    notes = [dataset_fingerprint(Labelled([Note() for _ in range(5)])) for _ in range(2)]
    assert notes[0] == notes[1] and "targets" not in notes[0]  # left out, not a false alarm
    rows = torch.randn(10, 3).bfloat16()  # numpy has no bfloat16
    same = dataset_fingerprint(TensorDataset(rows.clone()))
    assert same == dataset_fingerprint(TensorDataset(rows.clone()))
    assert same != dataset_fingerprint(TensorDataset(rows + 1))


class _LazyTargets(Dataset):
    """Labels read from a file on first use: missing on rank 1 (a node without the data)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 10

    @property
    def targets(self):
        if self.rank == 1:
            raise FileNotFoundError("labels.csv")
        return list(range(10))


def _lazy(runtime):
    ddpkit.build_eval_loader(_LazyTargets(runtime.rank), runtime, batch_size=2)


def test_a_fingerprint_that_fails_on_one_rank_is_heard_by_every_rank():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_lazy, 2, timeout_s=30)
    messages = _messages(info.value)
    assert messages, info.value
    for message in messages:
        assert "FileNotFoundError" in message and "labels.csv" in message, message


def test_a_weighted_position_does_not_resume_a_plain_shuffle_nor_the_reverse():
    data = TensorDataset(torch.arange(20))
    weighted = WeightedRandomSampler([1.0] * 20, num_samples=20)
    states = {}
    for name, extra in (("plain", {}), ("weighted", {"sampler": weighted})):
        loader = ddpkit.build_train_loader(data, _single(), batch_size=4, **extra)
        batches = iter(loader)
        next(batches)  # one batch in: a position inside the epoch
        states[name] = loader.state_dict()
        assert states[name]["samples_done"] == 4
    plain = ddpkit.build_train_loader(data, _single(), batch_size=4)
    with pytest.raises(
        ddpkit.ConfigError,
        match="loader state of another sampler: this loader "
        "draws a shuffle of the dataset; the state was written by one drawing "
        "weights",
    ):
        plain.load_state_dict(states["weighted"])
    again = ddpkit.build_train_loader(data, _single(), batch_size=4, sampler=weighted)
    with pytest.raises(ddpkit.ConfigError, match="loader state of another sampler"):
        again.load_state_dict(states["plain"])
    again.load_state_dict(states["weighted"])  # its own: fine
    assert states["weighted"]["dataset_len"] == 20


def test_more_draws_without_replacement_than_weighted_samples_is_refused_when_built():
    data = TensorDataset(torch.arange(10))
    sampler = WeightedRandomSampler([1.0] * 4 + [0.0] * 6, num_samples=5, replacement=False)
    with pytest.raises(ddpkit.ConfigError, match="num_samples=5 without replacement from 4"):
        ddpkit.build_train_loader(data, _single(), batch_size=2, sampler=sampler)
