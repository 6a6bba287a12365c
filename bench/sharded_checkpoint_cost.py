"""What a sharded (fsdp) checkpoint costs the training loop: synchronous against asynchronous
save, and the resume on the same and on another number of ranks.

    python bench/sharded_checkpoint_cost.py                  # 2 ranks save, 2 and 3 resume
    python bench/sharded_checkpoint_cost.py --depth 6 --rounds 5

The model of ``ddpkit bench memory`` (``--depth`` x ``Linear(--width, --width)``, AdamW) under
``wrap_model(strategy="fsdp")`` on ``--nproc`` gloo ranks. Each round saves once synchronously
and once with ``async_save=True`` (the order alternating), and per save measures, on the
slowest rank: the seconds ``save()`` blocks the loop; for the asynchronous one also the
``--steps`` training steps that run while the shards are written (against the same steps with
no save in flight) and the seconds ``wait()`` then blocks. Then ``--nproc`` and ``--nproc + 1``
ranks resume the last checkpoint (``resume()`` seconds, the resharding included). Medians over
rounds; the machine and the checkpoint size are printed with them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ddpkit
from ddpkit.bench.report import machine_line
from ddpkit.bench.sharded_worker import MemorySettings, build_mlp
from ddpkit.testing import run_distributed


def _setup(rt, settings: MemorySettings, directory: str, async_save: bool):
    model = ddpkit.wrap_model(build_mlp(settings), rt, strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optimizer": optimizer}
    ckpt = ddpkit.CheckpointManager(directory, rt, state=state, keep_last=1, async_save=async_save)
    return model, optimizer, ckpt


def _step(model, optimizer, settings: MemorySettings) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(settings.batch_size, settings.width)).square().mean().backward()
    optimizer.step()


def _timed_steps(rt, model, optimizer, settings, num_steps: int) -> float:
    ddpkit.barrier(rt)
    start = time.perf_counter()
    for _ in range(num_steps):
        _step(model, optimizer, settings)
    return time.perf_counter() - start


def _save_rank(rt, settings: MemorySettings, directory: str, async_save: bool, steps: int):
    torch.set_num_threads(settings.num_threads)
    model, optimizer, ckpt = _setup(rt, settings, directory, async_save)
    _step(model, optimizer, settings)  # the optimizer state exists
    quiet_s = _timed_steps(rt, model, optimizer, settings, steps)
    ddpkit.barrier(rt)
    start = time.perf_counter()
    ckpt.save(1)
    out = {"save_s": time.perf_counter() - start, "quiet_steps_s": quiet_s}
    if async_save:
        out["steps_in_flight_s"] = _timed_steps(rt, model, optimizer, settings, steps)
        start = time.perf_counter()
        ckpt.wait()
        out["wait_s"] = time.perf_counter() - start
    return out


def _resume_rank(rt, settings: MemorySettings, directory: str) -> float:
    torch.set_num_threads(settings.num_threads)
    _, _, ckpt = _setup(rt, settings, directory, False)
    ddpkit.barrier(rt)
    start = time.perf_counter()
    ckpt.resume()
    return time.perf_counter() - start


def _slowest(results: list[dict]) -> dict:
    return {key: max(r[key] for r in results) for key in results[0]}


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = MemorySettings(width=args.width, depth=args.depth, num_threads=1)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    resumes: dict[int, list[float]] = {args.nproc: [], args.nproc + 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for async_save in (False, True) if index % 2 == 0 else (True, False):
                results = run_distributed(
                    _save_rank,
                    args.nproc,
                    timeout_s=900,
                    args=(settings, tmp, async_save, args.steps),
                )
                runs[async_save].append(_slowest(results))
            for nproc in resumes:
                times = run_distributed(_resume_rank, nproc, args=(settings, tmp), timeout_s=900)
                resumes[nproc].append(max(times))
        folder = Path(tmp) / "step-00000001"
        size_mib = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
    sync, asynchronous = runs[False], runs[True]
    print(machine_line())
    params_m = settings.num_parameters / 1e6
    print(
        f"fsdp on {args.nproc} ranks, {params_m:.1f} M parameters + AdamW state: checkpoint "
        f"{size_mib:.0f} MiB; medians of {args.rounds} rounds, slowest rank"
    )
    print(f"synchronous save: save() blocks {_median(sync, 'save_s'):.3f} s")
    print(
        f"async save: save() blocks {_median(asynchronous, 'save_s'):.3f} s; {args.steps} steps "
        f"while writing {_median(asynchronous, 'steps_in_flight_s'):.3f} s (without a save in "
        f"flight {_median(asynchronous, 'quiet_steps_s'):.3f} s); wait() then blocks "
        f"{_median(asynchronous, 'wait_s'):.3f} s"
    )
    for nproc, times in resumes.items():
        print(f"resume on {nproc} ranks: {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
