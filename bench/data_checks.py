"""Cost of the same-data checks: the dataset fingerprint in the loader builders' exchange.

    python bench/data_checks.py --rounds 15

Two gloo ranks in one run build the MNIST job's loaders (a ``TensorDataset`` of 60,000 float32
images of 1x28x28 and their labels; 10,000 for evaluation) with ``build_train_loader`` and
``build_eval_loader``, alternating (A B A B ...) between the fingerprint on (the default) and off
(``dataset_fingerprint`` replaced by an empty dict), and also on a ``random_split`` Subset of the
training set. Reports the median milliseconds per build of each form (the difference is within the
exchange's noise), the fingerprint's own time (the cost), and that cost as a share of one MNIST
epoch at ``--samples-per-s`` (the job's measured 1,800-2,300 samples/s on 2 ranks,
docs/performance.md). The checks run once per loader build, never per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import TensorDataset, random_split

import ddpkit
import ddpkit.data.sampler as sampler_module
from ddpkit.testing import run_distributed

_REAL = sampler_module.dataset_fingerprint


def _build_ms(rt, train, test, fingerprint: bool) -> float:
    sampler_module.dataset_fingerprint = _REAL if fingerprint else (lambda dataset: {})
    start = time.perf_counter()
    ddpkit.build_train_loader(train, rt, batch_size=64, seed=0)
    ddpkit.build_eval_loader(test, rt, batch_size=1000)
    elapsed = (time.perf_counter() - start) * 1000
    sampler_module.dataset_fingerprint = _REAL
    return elapsed


def _rounds(rt, rounds: int) -> dict[str, list[float]]:
    gen = torch.Generator().manual_seed(0)
    train = TensorDataset(
        torch.rand(60_000, 1, 28, 28, generator=gen), torch.randint(0, 10, (60_000,), generator=gen)
    )
    test = TensorDataset(
        torch.rand(10_000, 1, 28, 28, generator=gen), torch.randint(0, 10, (10_000,), generator=gen)
    )
    split, _ = random_split(train, [54_000, 6_000], generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for data, label in ((train, "TensorDataset"), (split, "Subset of TensorDataset")):
            for on in (True, False):
                key = f"{label}, fingerprint {'on' if on else 'off'}"
                times.setdefault(key, []).append(_build_ms(rt, data, test, on))
            start = time.perf_counter()
            _REAL(data)
            elapsed = (time.perf_counter() - start) * 1000
            times.setdefault(f"{label}, the fingerprint alone", []).append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--samples-per-s", type=float, default=1800.0)
    args = parser.parse_args()
    results = run_distributed(_rounds, 2, args=(args.rounds,), timeout_s=600)
    epoch_s = 60_000 / args.samples_per_s
    print(
        f"2 gloo ranks, {args.rounds} interleaved rounds, medians of rank 0 (ms per build of "
        "the train and the eval loader):"
    )
    medians = {key: statistics.median(values) for key, values in results[0].items()}
    for key, value in medians.items():
        print(f"  {key:45s} {value:8.2f} ms")
    for label in ("TensorDataset", "Subset of TensorDataset"):
        cost = medians[f"{label}, the fingerprint alone"]
        share = cost / 1000 / epoch_s
        print(
            f"  cost on {label}: {cost:.2f} ms per build = {share:.5%} of one MNIST epoch "
            f"({epoch_s:.0f} s at {args.samples_per_s:.0f} samples/s)"
        )


if __name__ == "__main__":
    main()
