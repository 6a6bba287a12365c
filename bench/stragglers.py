"""Straggler detection: which slowdowns are named after how many steps, false alarms, cost.

    OMP_NUM_THREADS=1 python bench/stragglers.py detect --steps 200        # the detection table
    OMP_NUM_THREADS=1 python bench/stragglers.py balanced --runs 10        # false alarms
    OMP_NUM_THREADS=1 python bench/stragglers.py cost --rounds 7           # samples/s on vs off

``detect``: 2 gloo ranks train ddpkit's MNIST CNN on random 28x28 batches of 64 with the default
detector (20-step windows, factor 1.25, 10% of a step, patience 3); rank 1 is slowed by a sleep
of ``(f - 1)`` times the measured baseline step time (median of a balanced run), in its data
loading or in its forward (compute), so that alone it would step f times slower. Reported: the
step it was named at (``-``: not named in the run) and the factor the detector measured.
``balanced``: the same with no slowdown at 2 and 3 ranks; every rank named is a false alarm.
``cost``: each rank holds two identical models, one stepped with the detector and one without,
and trains them in alternating blocks of 100 steps; the ratio of the medians of samples/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ddpkit  # noqa: E402
from ddpkit.app.mnist.model import build_model  # noqa: E402
from ddpkit.monitoring.stragglers import StragglerDetector  # noqa: E402
from ddpkit.testing import run_distributed  # noqa: E402

BATCH = 64


class _Batches:
    """Random MNIST-shaped batches; ``sleep_s`` before each on the slow rank."""

    def __init__(self, num: int, sleep_s: float, slow: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(8, BATCH, 1, 28, 28, generator=gen)
        self.y = torch.randint(0, 10, (8, BATCH), generator=gen)
        self.num, self.sleep_s, self.slow = num, sleep_s, slow

    def __iter__(self):
        for i in range(self.num):
            if self.slow and self.sleep_s:
                time.sleep(self.sleep_s)
            yield self.x[i % 8], self.y[i % 8]

    def __len__(self) -> int:
        return self.num


class _SlowForward(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, sleep_s: float) -> None:
        super().__init__()
        self.inner, self.sleep_s = inner, sleep_s

    def forward(self, x):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.inner(x)


def _run(runtime, phase: str, sleep_s: float, steps: int, stragglers=True) -> dict:
    slow = runtime.rank == 1
    torch.manual_seed(0)
    net = _SlowForward(build_model("mnist"), sleep_s if phase == "compute" and slow else 0.0)
    model = ddpkit.wrap_model(net, runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    detector = StragglerDetector(runtime) if stragglers else False
    step = ddpkit.TrainStep(
        model, optimizer, runtime=runtime, stragglers=detector, same_batch_sizes=True
    )
    batches = _Batches(steps, sleep_s if phase == "data" else 0.0, slow)
    for _ in ddpkit.train_epoch(step, batches):
        pass
    return step.stragglers.summary() if step.stragglers else {}


def _detect_job(runtime, factors: list[float], steps: int) -> list[dict]:
    base = _run(runtime, "none", 0.0, 60)["ranks"]  # the baseline step time
    own = statistics.median(r["step_s"] for r in base)
    rows = []
    for phase in ("data", "compute"):
        for factor in factors:
            summary = _run(runtime, phase, (factor - 1) * own, steps)
            named = [n for n in summary["named"] if n["rank"] == 1 and n["phase"] == phase]
            wrong = [n for n in summary["named"] if (n["rank"], n["phase"]) != (1, phase)]
            rows.append(
                {
                    "phase": phase,
                    "factor": factor,
                    "own_ms": own * 1e3,
                    "named_step": named[0]["named_step"] if named else None,
                    "measured": named[0]["factor"] if named else None,
                    "wrong": [(n["rank"], n["phase"], round(n["factor"], 2)) for n in wrong],
                }
            )
    return rows


def _balanced_job(runtime, runs: int, steps: int) -> list[int]:
    return [len(_run(runtime, "none", 0.0, steps)["named"]) for _ in range(runs)]


def _own_loop(model, optimizer, probe, runtime, block: int) -> None:
    """The README's loop for ``block`` steps; ``probe``: the straggler figures, or ``None``."""
    runtime.step_probe = probe
    for x, y in _Batches(block, 0.0, False):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        runtime.stop_requested()  # what maybe_save calls once per step


def _cost_job(runtime, rounds: int, block: int) -> dict:
    """samples/s with and without the detector: TrainStep, and the own loop (wrap_model's
    probe), each pair of forms alternating, ABBA order."""
    torch.manual_seed(0)
    steps, loops = {}, {}
    for name, on in (("on", True), ("off", False)):
        model = ddpkit.wrap_model(build_model("mnist"), runtime)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        steps[name] = ddpkit.TrainStep(
            model, optimizer, runtime=runtime, stragglers=on, same_batch_sizes=True
        )
        model = ddpkit.wrap_model(build_model("mnist"), runtime)  # its probe: runtime's now
        probe, runtime.step_probe = runtime.step_probe, None  # the next wrap would close it
        if not on:
            probe.close()
        loops[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01), probe if on else None)
    rates = {f"{form} {name}": [] for form in ("TrainStep", "own loop") for name in ("on", "off")}
    for index in range(rounds * 2 + 2):
        name = ("on", "off")[index % 2] if (index // 2) % 2 == 0 else ("off", "on")[index % 2]
        for form in ("TrainStep", "own loop"):
            start = time.perf_counter()
            if form == "TrainStep":
                for _ in ddpkit.train_epoch(steps[name], _Batches(block, 0.0, False)):
                    pass
            else:
                _own_loop(*loops[name], runtime, block)
            if index >= 2:  # the first pair warms up
                elapsed = time.perf_counter() - start
                rates[f"{form} {name}"].append(block * BATCH * runtime.world_size / elapsed)
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("detect", "balanced", "cost"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--factors", default="1.1,1.25,1.5,2,4")
    args = parser.parse_args()
    if args.mode == "detect":
        factors = [float(f) for f in args.factors.split(",")]
        rows = run_distributed(_detect_job, 2, args=(factors, args.steps), timeout_s=3600)[0]
        print("| slowed phase | slowdown | baseline step (ms) | named at step | measured |")
        print("|---|---|---|---|---|")
        for r in rows:
            measured = f"{r['measured']:.2f}x" if r["measured"] else "-"
            also = f" also named: {r['wrong']}" if r["wrong"] else ""
            print(
                f"| {r['phase']} | {r['factor']:g}x | {r['own_ms']:.1f} | "
                f"{r['named_step'] or '-'} | {measured} |{also}"
            )
    elif args.mode == "balanced":
        for world in (2, 3):
            counts = run_distributed(
                _balanced_job, world, args=(args.runs, args.steps), timeout_s=3600
            )[0]
            print(
                f"world size {world}: {args.runs} runs x {args.steps} steps, "
                f"false alarms {sum(counts)} ({counts})"
            )
    else:
        rates = run_distributed(_cost_job, 2, args=(args.rounds, 100), timeout_s=3600)[0]
        for form in ("TrainStep", "own loop"):
            on, off = rates[f"{form} on"], rates[f"{form} off"]
            print(
                f"{form}: samples/s with detection {on:.0f}, without {off:.0f}, ratio "
                f"{on / off:.4f} (medians of {args.rounds} blocks of 100 steps)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
