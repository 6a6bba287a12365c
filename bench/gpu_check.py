"""The GPU check of ``ddpkit train`` (issue 24): five runs and a raw-torch loop, one table.

    bash bench/gpu_check.sh                                   # one CUDA GPU, at most 8 minutes
    bash bench/gpu_check.sh --data-dir ~/mnist --json gpu_check.json
    OMP_NUM_THREADS=1 bash bench/gpu_check.sh --cpu-dry-run --data-dir ../shared/data/mnist

Runs, one after another, each a subprocess in a session of its own with its own hard timeout
(on expiry the process group and every descendant are killed), each writing to ``OUT/<run>``
(``--out DIR``, else a temporary folder removed at the end):

- ``fp32``: ``ddpkit train --nproc 1`` (on a GPU: backend auto, which picks nccl and cuda:0);
- ``bf16``: the same with ``--precision bf16-mixed``;
- ``compile``: the same with ``--compile`` (inductor; the first step compiles, and that time
  counts in the run's samples/s);
- ``fsdp``: ``--strategy fsdp``, which ddpkit runs on 2 or more processes only, and ddpkit's
  nccl needs a GPU per process: with one GPU the 2 processes run on the CPU with gloo (the
  table says so); with 2 GPUs, nccl on 2 GPUs;
- ``nccl``: ``--backend nccl``, ``--nproc 1`` on one GPU (at world size 1 ddpkit creates no
  process group, so this checks the backend's selection and the device, not a communicator;
  the table shows what ran), ``--nproc 2`` with 2 GPUs;
- ``raw_torch``: plain PyTorch, no ddpkit in the loop: the same CNN (``build_model``), the same
  data (read by ddpkit's MNIST reader), seed, batch and steps, Adam with the same one-cycle LR,
  fp32, ``DataLoader(shuffle=True)``; samples/s over the training steps, then the test set.

Every ``ddpkit train`` run also gets ``--epochs 1 --max-steps S --batch-size B --seed 0
--step-timing off --progress off --tensorboard off`` (no ``torch.cuda.synchronize`` at phase
boundaries, so samples/s compare with the raw loop), the data set resolved once here, and
``--train-args``. The table (markdown, stdout; ``--json PATH`` too) and the exit statuses (0 all
succeeded, 1 a run failed, 2 bad input or no GPU without ``--cpu-dry-run``): docs/measuring.md,
"GPU check". ``--cpu-dry-run``: the same runs on the CPU with gloo and 30 steps, every row
saying what it substituted, so the check is known to work before a GPU is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

COMMON_FLAGS = ["--step-timing", "off", "--progress", "off", "--tensorboard", "off"]
# Seconds per run. On a GPU they sum to the 8-minute budget (--budget-s also caps the whole).
GPU_TIMEOUT_S = {"fp32": 60, "bf16": 60, "compile": 120, "fsdp": 120, "nccl": 60, "raw_torch": 60}
DRY_TIMEOUT_S = {"fp32": 90, "bf16": 90, "compile": 150, "fsdp": 90, "nccl": 90, "raw_torch": 60}
FIGURES = ("test_accuracy", "samples_per_s", "peak_memory_mb", "world_size", "backend")
STDERR_LINES = 15


@dataclass
class Run:
    """One run: ``flags`` for ``ddpkit train`` (``None``: the raw-torch loop)."""

    name: str
    flags: list[str] | None
    device: str = "cuda"
    substituted: list[str] = field(default_factory=list)


def plan_runs(dry_run: bool, num_gpus: int) -> list[Run]:
    """The runs in order; ``num_gpus``: CUDA devices (ignored in the dry run, which does what
    one GPU would, on the CPU)."""
    two_gpus = num_gpus >= 2 and not dry_run
    runs = [
        Run("fp32", ["--nproc", "1"]),
        Run("bf16", ["--nproc", "1", "--precision", "bf16-mixed"]),
        Run("compile", ["--nproc", "1", "--compile"]),
        Run("fsdp", ["--nproc", "2", "--strategy", "fsdp", "--backend", "nccl"]),
        Run("nccl", ["--nproc", "2" if two_gpus else "1", "--backend", "nccl"]),
        Run("raw_torch", None),
    ]
    for run in runs:
        if run.name == "fsdp" and not two_gpus:
            _on_cpu(run, "fsdp needs 2 processes, ddpkit's nccl a GPU for each")
        elif dry_run:
            _on_cpu(run, "")
    return runs


def _on_cpu(run: Run, why: str) -> None:
    """Move ``run`` to the CPU with gloo (nccl and CUDA need a GPU), saying so."""
    run.device = "cpu"
    run.substituted = ["cuda -> cpu"] + (["nccl -> gloo"] if run.flags is not None else [])
    if why:
        run.substituted[-1] += f" ({why})"
    if run.flags is None:
        return
    if "--backend" in run.flags:
        run.flags[run.flags.index("--backend") + 1] = "gloo"
    else:
        run.flags += ["--backend", "gloo"]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_with_timeout(argv: list[str], run_dir: Path, timeout_s: float) -> tuple[int, float]:
    """Run ``argv``, stdout and stderr to files in ``run_dir``; returns ``(exit status,
    seconds)``. On timeout every descendant and the process group get SIGKILL; status 124."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            from ddpkit.env import descendant_pids

            # torchrun starts its workers in sessions of their own: the group alone misses them
            for pid in descendant_pids(proc.pid):
                _kill(pid)
            _kill(-proc.pid)
            proc.wait()
            err.write(f"\ngpu_check: killed after its timeout of {timeout_s:.0f} s\n")
            code = 124
    return code, time.perf_counter() - start


def run_argv(run: Run, args: argparse.Namespace, data: list[str], out: Path) -> list[str]:
    """The command line of one run."""
    common = ["--seed", str(args.seed), "--batch-size", str(args.batch_size), *data]
    if run.flags is None:
        return [
            sys.executable,
            __file__,
            "--raw-loop",
            "--device",
            run.device,
            "--steps",
            str(args.steps),
            "--out",
            str(out),
            *common,
        ]
    return [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        *run.flags,
        "--epochs",
        "1",
        "--max-steps",
        str(args.steps),
        "--output-dir",
        str(out),
        *common,
        *COMMON_FLAGS,
        *shlex.split(args.train_args),
    ]


def read_figures(out: Path) -> dict[str, object]:
    """:data:`FIGURES` of one run's folder: ``summary.json``, and ``peak_memory_mb`` from the
    last record of ``metrics.jsonl`` where there is one; ``None`` for what is missing."""
    figures: dict[str, object] = dict.fromkeys(FIGURES)
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return figures
    figures.update({key: summary.get(key) for key in FIGURES})
    try:
        records = (out / "metrics.jsonl").read_text().splitlines()
        figures["peak_memory_mb"] = json.loads(records[-1]).get("peak_memory_mb")
    except (OSError, ValueError, IndexError):
        pass
    return figures


def settings_text(run: Run, figures: dict[str, object]) -> str:
    """The run's flags and device, and what its summary.json says ran (``process group none``:
    world size 1, where ddpkit creates no process group)."""
    if run.flags is None:
        return f"plain PyTorch loop, fp32, no process group, {run.device}"
    text = f"{' '.join(run.flags)}, {run.device}"
    if figures["world_size"] is not None:
        text += f"; ran: world size {figures['world_size']}, process group {figures['backend']}"
    return text


def check_runs(
    runs: list[Run], args: argparse.Namespace, data: list[str], root: Path, deadline: float
) -> list[dict]:
    """Run each in turn within its own timeout and what is left of the budget; the rows."""
    timeouts = DRY_TIMEOUT_S if args.cpu_dry_run else GPU_TIMEOUT_S
    rows = []
    for index, run in enumerate(runs, start=1):
        figures = dict.fromkeys(FIGURES)
        row = {
            "run": run.name,
            "settings": settings_text(run, figures),
            "note": "",
            "substituted": run.substituted,
            "exit": None,
            "seconds": 0.0,
            **figures,
        }
        rows.append(row)
        timeout_s = min(timeouts[run.name], deadline - time.monotonic())
        if timeout_s < 5:
            row["note"] = "not run: the time budget is spent"
            continue
        print(f"gpu_check: [{index}/{len(runs)}] {run.name} ...", file=sys.stderr, flush=True)
        argv = run_argv(run, args, data, root / run.name)
        code, seconds = run_with_timeout(argv, root / run.name, timeout_s)
        figures = read_figures(root / run.name)
        row.update(figures, exit=code, seconds=round(seconds, 1))
        row["settings"] = settings_text(run, figures)
        if code == 124:
            row["note"] = f"killed after its timeout of {timeout_s:.0f} s"
        elif code == 0 and figures["samples_per_s"] is None:
            row["note"] = "no summary.json"
        print(
            f"gpu_check: [{index}/{len(runs)}] {run.name}: exit {code} in {seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    raw = rows[-1]["samples_per_s"] if rows and rows[-1]["run"] == "raw_torch" else None
    for row in rows:
        speed = row["samples_per_s"]
        row["ratio_to_raw"] = round(speed / raw, 3) if speed and raw else None
    return rows


def _number(value: object, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_table(rows: list[dict]) -> str:
    """The rows as one markdown table."""
    lines = [
        "| run | settings | substituted | exit | test acc | samples/s | vs raw | peak MiB | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        settings = r["settings"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(
            f"| {r['run']} | {settings} | {', '.join(r['substituted']) or 'none'} | "
            f"{'-' if r['exit'] is None else r['exit']} | {_number(r['test_accuracy'], 4)} | "
            f"{_number(r['samples_per_s'], 0)} | {_number(r['ratio_to_raw'], 2)} | "
            f"{_number(r['peak_memory_mb'], 0)} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def resolve_data_flags(args: argparse.Namespace) -> tuple[list[str], str]:
    """The data set resolved once, as ``ddpkit train`` would (``--data-dir``, the cache, a
    download, else digits), so every run reads the same; ``(flags for the runs, what it is)``.

    Raises:
        ConfigError, DataError: as :func:`ddpkit.app.mnist.data.resolve_data`.
    """
    from ddpkit.app.mnist.data import resolve_data

    source = resolve_data(args.dataset, args.data_dir, download=not args.no_download)
    if source.dataset == "digits":
        note = f" ({source.note})" if source.note else ""
        return ["--dataset", "digits"], f"scikit-learn's 8x8 digits{note}"
    return [
        "--dataset",
        "mnist",
        "--data-dir",
        str(source.directory),
    ], f"MNIST in {source.directory}"


def machine_text(dry_run: bool) -> str:
    import torch

    where = "CPU dry run" if dry_run else torch.cuda.get_device_name(0)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (
        f"{where}; {os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{sys.version.split()[0]}, OMP_NUM_THREADS={threads}"
    )


def report(args: argparse.Namespace, rows: list[dict], data_text: str, seconds: float) -> bool:
    """Print the table (and the failed runs' stderr tails), write ``--json``; all succeeded?"""
    ok = all(r["exit"] == 0 and r["samples_per_s"] is not None for r in rows)
    settings = {
        "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
        "data": data_text,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "train_flags": ["--epochs", "1", *COMMON_FLAGS, *shlex.split(args.train_args)],
    }
    machine = machine_text(args.cpu_dry_run)
    print(f"GPU check of ddpkit train ({settings['mode']}): {machine}")
    print(
        f"data: {data_text}; {args.steps} steps of {args.batch_size} samples per process, seed "
        f"{args.seed}; every ddpkit train run: {' '.join(settings['train_flags'])}\n"
    )
    print(format_table(rows))
    failed = [r for r in rows if r["exit"] != 0 or r["samples_per_s"] is None]
    verdict = "FAILED: " + ", ".join(r["run"] for r in failed) if failed else "all runs succeeded"
    print(f"\n{verdict}; {seconds:.0f} s in all")
    for row in failed:
        if row.get("stderr_tail"):
            print(f"\n{row['run']}: the last lines of its stderr\n{row['stderr_tail']}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"machine": machine, "settings": settings, "rows": rows, "ok": ok}
        path.write_text(json.dumps(doc, indent=2) + "\n")
    return ok


def _stderr_tail(run_dir: Path) -> str:
    try:
        lines = (run_dir / "stderr.log").read_text(errors="replace").splitlines()
    except OSError:
        return "    (no stderr.log)"
    return "\n".join("    " + line for line in lines[-STDERR_LINES:])


def check(args: argparse.Namespace) -> int:
    """The whole check; returns the exit status."""
    import torch

    from ddpkit.errors import DdpkitError

    start = time.monotonic()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); run with --cpu-dry-run to check the same runs on the CPU.",
            file=sys.stderr,
        )
        return 2
    if args.steps is None:
        args.steps = 30 if args.cpu_dry_run else 500
    try:
        data, data_text = resolve_data_flags(args)
    except DdpkitError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    runs = plan_runs(args.cpu_dry_run, 0 if args.cpu_dry_run else torch.cuda.device_count())
    with tempfile.TemporaryDirectory(prefix="ddpkit-gpu-check-") as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        rows = check_runs(runs, args, data, root, start + args.budget_s)
        for row in rows:
            if row["exit"] is not None and row["exit"] != 0:
                row["stderr_tail"] = _stderr_tail(root / row["run"])
    return 0 if report(args, rows, data_text, time.monotonic() - start) else 1


def raw_loop(args: argparse.Namespace) -> int:
    """``--raw-loop``: the plain PyTorch loop; trains, evaluates, writes ``OUT/summary.json``."""
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    from ddpkit.app.mnist.data import DataSource
    from ddpkit.app.mnist.model import build_model

    device = torch.device(args.device)
    source = DataSource(args.dataset, Path(args.data_dir) if args.data_dir else None)
    train_set, test_set = source.load("train"), source.load("test")
    torch.manual_seed(args.seed)
    model = build_model(args.dataset).to(device)
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=generator)
    num_steps = min(args.steps, len(loader))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=num_steps)
    num_samples, start = 0, time.perf_counter()
    for x, y in (batch for _, batch in zip(range(num_steps), loader, strict=False)):
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        schedule.step()
        num_samples += len(y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_s = time.perf_counter() - start
    summary = {
        "test_accuracy": _accuracy(model, test_set, device),
        "samples_per_s": num_samples / train_s,
        "peak_memory_mb": _peak_memory_mb(device),
        "world_size": 1,
        "backend": "none",
        "final_step": num_steps,
        "train_s": train_s,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _accuracy(model, test_set, device) -> float:
    """The raw loop's test accuracy (0..1), batches of 1000."""
    import torch
    from torch.utils.data import DataLoader

    with torch.no_grad():
        correct = sum(
            int((model(x.to(device)).argmax(1) == y.to(device)).sum())
            for x, y in DataLoader(test_set, batch_size=1000)
        )
    return correct / len(test_set)


def _peak_memory_mb(device) -> float:
    """As ``ddpkit train``'s: CUDA memory allocated on a GPU, else this process's peak RSS."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_check.sh",
        description=__doc__.splitlines()[0],
        epilog="Without --cpu-dry-run it needs a CUDA GPU (exit status 2 otherwise).",
    )
    add = parser.add_argument
    add("--cpu-dry-run", action="store_true", help="the same runs on the CPU, gloo, 30 steps")
    add("--steps", type=int, help="optimizer steps per run (default 500; dry run 30)")
    add("--batch-size", type=int, default=64, help="samples per process per step (default 64)")
    add("--seed", type=int, default=0, help="seed of every run (default 0)")
    add("--lr", type=float, default=3e-3, help=argparse.SUPPRESS)  # ddpkit train's default
    add("--dataset", choices=("auto", "mnist", "digits"), default="auto", help="default auto")
    add("--data-dir", help="the four MNIST IDX files (default: ddpkit train's cache/download)")
    add("--no-download", action="store_true", help="never download MNIST")
    add("--train-args", default="", help="more ddpkit train flags for every run, one string")
    add("--budget-s", type=float, help="seconds for all runs (default 480; dry run 600)")
    add("--out", help="keep each run's folder under DIR (default: a temporary folder)")
    add("--json", help="also write the table as JSON to PATH")
    add("--raw-loop", action="store_true", help=argparse.SUPPRESS)
    add("--device", default="cpu", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.raw_loop:
        return raw_loop(args)
    if args.budget_s is None:
        args.budget_s = 600.0 if args.cpu_dry_run else 480.0
    problems = []
    if (args.steps is not None and args.steps < 1) or args.batch_size < 1:
        problems.append(f"steps={args.steps}, batch_size={args.batch_size}: both 1 or more")
    if args.json and Path(args.json).is_dir():
        problems.append(f"json={args.json} is a folder: give a file path")
    if problems:
        print(f"gpu_check: bad input: {'; '.join(problems)}.", file=sys.stderr)
        return 2
    return check(args)


if __name__ == "__main__":
    raise SystemExit(main())
