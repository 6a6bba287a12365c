"""Per-step cost of the stop-signal check: ``rt.stop_requested()`` after every step, or not.

    python bench/stop_check_cost.py --rounds 15

Two gloo ranks in one run train ddpkit train's models with :class:`ddpkit.TrainStep` on random
data; blocks of ``--steps`` steps alternate (A B A B ...) between three forms: no check, the
check as ``CheckpointManager.maybe_save`` runs it (``rt.stop_requested()``: one all-reduce every
K calls, K adapted), and a blocking all-reduce of one flag every step (the naive form, for
comparison). Reports each form's median seconds per step over the rounds and its ratio to no
check (noisy on a shared machine: several percent), the median time per step spent inside the
check itself (the cost, measured directly) as a share of the step, and the K the adaptive
check settled on. Interleaved in the same processes, so the
machine's load drifts through every form alike.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.app.mnist.model import MODELS
from ddpkit.testing import run_distributed

FORMS = ("no check", "stop_requested() (adaptive)", "all-reduce every step")


def _block(rt, step, form: str, num_steps: int, windows) -> tuple[float, float]:
    """``(seconds per step, seconds per step inside the check)`` of one block."""
    flag = torch.zeros(1, dtype=torch.int64)
    in_check = 0.0
    start = time.perf_counter()
    for _ in range(num_steps):
        step(next(windows))
        before = time.perf_counter()
        if form == FORMS[1]:
            rt.stop_requested()
        elif form == FORMS[2]:
            with rt.watch("naive stop check"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=rt.process_group)
        in_check += time.perf_counter() - before
    return (time.perf_counter() - start) / num_steps, in_check / num_steps


def _measure(rt, model_name: str, rounds: int, num_steps: int, batch_size: int) -> dict:
    torch.manual_seed(0)
    model = ddpkit.wrap_model(MODELS[model_name](), rt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = ddpkit.TrainStep(model, optimizer, runtime=rt)
    batch = (torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,)))
    windows = step.windows(itertools.repeat(batch))  # one optimizer step each
    times: dict[str, list[tuple[float, float]]] = {form: [] for form in FORMS}
    for form in FORMS:  # warm-up: one block each
        _block(rt, step, form, num_steps, windows)
    for _ in range(rounds):
        for form in FORMS:
            times[form].append(_block(rt, step, form, num_steps, windows))
    interval = rt.stop._next_check - rt.stop._calls if rt.stop is not None else None
    return {"times": times, "interval": interval}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, 2 gloo ranks, batch {args.batch_size} per rank, "
        f"{args.rounds} rounds of {args.steps}-step blocks per form"
    )
    for name in ("digits", "mnist"):
        result = run_distributed(
            _measure, 2, args=(name, args.rounds, args.steps, args.batch_size), timeout_s=1800
        )[0]
        base = statistics.median(t for t, _ in result["times"][FORMS[0]])
        print(f"\n{name} CNN (adaptive check settled on K = {result['interval']} steps)")
        print(f"  {'form':<30} {'ms/step':>9} {'ratio':>7} {'in check':>10} {'% of step':>10}")
        for form in FORMS:
            step_s = statistics.median(t for t, _ in result["times"][form])
            check_s = statistics.median(c for _, c in result["times"][form])
            print(
                f"  {form:<30} {step_s * 1e3:9.3f} {step_s / base:7.4f} "
                f"{check_s * 1e3:8.4f}ms {100 * check_s / base:9.2f}%"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
