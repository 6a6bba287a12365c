"""All-reduce time, algorithm bandwidth and bus bandwidth per message size (nccl-tests convention).

    ddpkit bench allreduce                      # 2 ranks, 4 KiB .. 256 MiB by x2, backend auto
    ddpkit bench allreduce --nproc 3 -b 1M -e 64M --csv ar.csv --json ar.json

Per message size (--min-bytes, min*factor, ... up to --max-bytes, like nccl-tests -b/-e/-f):
every rank fills its buffer with rank+1 and one all-reduce (sum) is checked to give n(n+1)/2 in
every element; then --warmup untimed ops, then up to --iters ops, each timed on its own (the ranks
lined up by a one-element all-reduce before each; torch.cuda.synchronize around it on CUDA). Per
op the slowest rank's time counts (that is what the job waits for); time = the median over the
repeats. Time budget: a size whose ops are slow gets fewer repeats, about --budget-s seconds'
worth, never under 3 (column "repeats"); the default run takes about 30 s on 2 CPU ranks.

Formulas (nccl-tests doc/PERFORMANCE.md), n = world size, 1 GB = 1e9 bytes:
  algbw_gbps = bytes / time_s / 1e9
  busbw_gbps = algbw_gbps * 2(n-1)/n      (all-reduce bus bandwidth, comparable across n)
  busbw_frac_memcpy = busbw_gbps / memcpy_gbps
memcpy_gbps: the median rate of dst.copy_(src) for one buffer of --max-bytes bytes on the device
the ranks use (cuda:0 with nccl, else the CPU with this process's torch threads), measured before
the ranks start. It counts the bytes of ONE buffer per copy; the memory traffic (read src + write
dst) is twice that. It is the reference limit for ranks that share one machine's memory.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
import torch.distributed as dist

from ddpkit.bench.report import (
    available_memory_bytes,
    format_table,
    machine,
    machine_line,
    median,
    output_problem,
    write_csv,
    write_json,
)
from ddpkit.env import ProcessInfo
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.runtime.process_group import BACKENDS, Runtime, resolve_backend

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MIN_REPEATS = 3  # the time budget never cuts a size below this many timed ops
MEMCPY_REPEATS = 5
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
COLUMNS = (
    ("bytes", "bytes", "d"),
    ("elements", "elements", "d"),
    ("repeats", "repeats", "d"),
    ("time_us", "time us", ".1f"),
    ("algbw_gbps", "algbw GB/s", ".3f"),
    ("busbw_gbps", "busbw GB/s", ".3f"),
    ("busbw_frac_memcpy", "busbw/memcpy", ".3f"),
)


def parse_size(text: str) -> int:
    """Bytes from a human size: ``4096``, ``4K``, ``4KiB``, ``4KB``, ``256M``, ``1G`` (powers of
    1024; case-insensitive).

    Raises:
        ConfigError: ``text`` is not such a size, or is 0.
    """
    match = _SIZE.match(str(text))
    if not match or int(match.group(1)) == 0:
        raise ConfigError(
            f"invalid message size: {text!r}. Use a positive whole number of bytes with an "
            "optional K/M/G suffix (powers of 1024), e.g. 4K, 4KiB, 256M, 1G."
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``[min_bytes, min_bytes*factor, ...]`` up to and including ``max_bytes`` (nccl-tests -f)."""
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def bus_factor(world_size: int) -> float:
    """``2(n-1)/n``: all-reduce busbw / algbw (nccl-tests doc/PERFORMANCE.md)."""
    return 2 * (world_size - 1) / world_size


# Why busbw/memcpy can exceed 1 (measured on 2 CPU cores, torch 2.13, one thread: dst.copy_(src)
# runs at 30 GB/s for 256 KiB, which stays in the CPU caches, and at 2.9 GB/s for 64 MiB).
MEMCPY_FOOTER = (
    "busbw/memcpy: busbw over one copy of a --max-bytes buffer (bytes counted once, read and "
    "write) by one process; above 1 is possible: messages that fit in the CPU caches move faster "
    "than a memory-sized copy, and the ranks copy on several cores at once. A reference, not a "
    "ceiling."
)


def make_row(
    num_bytes: int, elem_bytes: int, time_s: float, repeats: int, world_size: int, memcpy: float
) -> dict:
    """One table row: ``bytes``, ``elements``, ``repeats``, ``time_us`` (median, microseconds),
    ``algbw_gbps = bytes / time_s / 1e9``, ``busbw_gbps = algbw_gbps * 2(n-1)/n`` and
    ``busbw_frac_memcpy = busbw_gbps / memcpy`` (``memcpy`` in GB/s)."""
    algbw_gbps = num_bytes / time_s / 1e9
    busbw_gbps = algbw_gbps * bus_factor(world_size)
    return {
        "bytes": num_bytes,
        "elements": num_bytes // elem_bytes,
        "repeats": repeats,
        "time_us": time_s * 1e6,
        "algbw_gbps": algbw_gbps,
        "busbw_gbps": busbw_gbps,
        "busbw_frac_memcpy": busbw_gbps / memcpy,
    }


def check_result(tensor: torch.Tensor, world_size: int, rank: int = 0) -> None:
    """Check one all-reduce (sum) of buffers filled with ``rank + 1``: every element of
    ``tensor`` (any shape) must be ``n(n+1)/2``.

    Raises:
        DistributedError: some element differs; the message names the rank, the message size in
            bytes, how many elements are wrong and the first one.
    """
    expected = world_size * (world_size + 1) / 2
    wrong = (tensor != expected).flatten()
    num_wrong = int(wrong.sum())
    if num_wrong:
        first = int(wrong.nonzero()[0])
        num_bytes = tensor.numel() * tensor.element_size()
        raise DistributedError(
            f"[rank {rank}/{world_size}] all-reduce result wrong: bytes={num_bytes}, "
            f"{num_wrong} of {tensor.numel()} elements differ from {expected:g} (element {first} "
            f"is {tensor.flatten()[first].item()!r}). Each rank sent rank+1, so every element "
            "must be 1+2+...+n. Rerun with --backend gloo to compare, and report the backend bug."
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memcpy_gbps(num_bytes: int, device: torch.device, repeats: int = MEMCPY_REPEATS) -> float:
    """Median bandwidth of ``dst.copy_(src)`` for two ``num_bytes``-byte buffers on ``device``,
    in GB/s = ``num_bytes / time_s / 1e9``: the bytes of ONE buffer per copy (the memory traffic,
    read plus write, is twice that). One untimed copy first."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times_s = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times_s.append(time.perf_counter() - start)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return num_bytes / median(times_s) / 1e9


def _timed_ops(buffer: torch.Tensor, runtime: Runtime, num_ops: int) -> list[float]:
    """Seconds of each of ``num_ops`` all-reduces of ``buffer`` on this rank."""
    align = torch.zeros(1, device=runtime.device)
    times_s = []
    for _ in range(num_ops):
        dist.all_reduce(align, group=runtime.process_group)  # line the ranks up
        _sync(runtime.device)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=runtime.process_group)
        _sync(runtime.device)
        times_s.append(time.perf_counter() - start)
    return times_s


def _slowest(times_s: list[float], runtime: Runtime) -> list[float]:
    """Per op, the largest time over the ranks. Collective: call on every rank."""
    tensor = torch.tensor(times_s, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=runtime.process_group)
    return tensor.tolist()


def _measure_size(buffer: torch.Tensor, runtime: Runtime, plan: dict) -> tuple[float, int]:
    """``(median slowest-rank seconds per op, repeats)`` for one message. Collective."""
    buffer.fill_(runtime.rank + 1)
    first = _timed_ops(buffer, runtime, 1)
    check_result(buffer, runtime.world_size, runtime.rank)
    buffer.zero_()  # sums of zeros stay zeros: no overflow in float16 over many ops
    warm = _timed_ops(buffer, runtime, plan["warmup"])
    estimate_s = _slowest([min(first + warm)], runtime)[0]
    repeats = plan["iters"]
    if estimate_s * repeats > plan["budget_s"]:
        repeats = min(repeats, max(MIN_REPEATS, int(plan["budget_s"] / estimate_s)))
    times_s = _slowest(_timed_ops(buffer, runtime, repeats), runtime)
    return median(times_s), repeats


def measure(runtime: Runtime, plan: dict) -> list[tuple[int, float, int]]:
    """Run the sweep on this rank: ``[(bytes, median seconds, repeats), ...]``, the same on
    every rank.

    Collective: call on every rank. ``plan`` holds ``sizes`` (bytes), ``dtype`` (a name in
    :data:`DTYPES`), ``warmup``, ``iters`` and ``budget_s``.

    Raises:
        DistributedError: a result was wrong (:func:`check_result`), or a peer stopped answering.
    """
    dtype = DTYPES[plan["dtype"]]
    elem_bytes = torch.empty(0, dtype=dtype).element_size()
    storage = torch.empty(max(plan["sizes"]) // elem_bytes, dtype=dtype, device=runtime.device)
    results = []
    for num_bytes in plan["sizes"]:
        with runtime.watch(f"all_reduce of {num_bytes} bytes"):
            time_s, repeats = _measure_size(storage[: num_bytes // elem_bytes], runtime, plan)
        results.append((num_bytes, time_s, repeats))
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ddpkit bench allreduce`` (the module docstring is its description)."""
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="world size: ranks (processes) on this machine, >= 2 (default 2)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto (default): nccl when each rank has its own GPU, else gloo",
    )
    _add_size_arguments(parser)
    _add_repeat_arguments(parser)
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default="float32", help="element type (default float32)"
    )
    parser.add_argument("--csv", default=None, help="write the rows as CSV to this path")
    parser.add_argument("--json", default=None, help="write the report as JSON to this path")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the whole run may take; every rank is killed then (default 600)",
    )


def _add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """-b/-e/-f: the message sizes, as nccl-tests names them."""
    parser.add_argument(
        "-b",
        "--min-bytes",
        default="4K",
        help="smallest message, bytes with optional K/M/G suffix, powers of 1024 (default 4K)",
    )
    parser.add_argument(
        "-e",
        "--max-bytes",
        default="256M",
        help="largest message, bytes (default 256M); also the memory-copy reference buffer's size",
    )
    parser.add_argument(
        "-f",
        "--factor",
        type=int,
        default=2,
        help="multiply the size by this integer >= 2 from one row to the next (default 2)",
    )


def _add_repeat_arguments(parser: argparse.ArgumentParser) -> None:
    """--warmup/--iters/--budget-s: how many all-reduces each size gets."""
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed all-reduces per size after the checked one (default 2)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=20,
        help="timed all-reduces per size (default 20), cut to fit --budget-s for big sizes",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=2.0,
        help="seconds one size's timed "
        f"ops may take, about: fewer repeats (never under {MIN_REPEATS}) "
        "for sizes whose ops are slower (default 2.0)",
    )


def memory_problem(max_bytes: int, world_size: int, backend: str) -> str | None:
    """Why a CPU sweep up to ``max_bytes`` would not fit in memory, or ``None``.

    On CPU (gloo) every rank holds a ``max_bytes`` buffer and gloo a scratch copy of about the
    same size, and the memory-copy reference holds two before the ranks start: about
    ``2 * max_bytes * max(world_size, 1)`` at the peak. Refused above the available memory, so
    an oversized ``--max-bytes`` fails at once instead of in the allocator or the OOM killer.
    """
    available = available_memory_bytes()
    need = 2 * max_bytes * max(world_size, 1)
    if backend != "gloo" or available is None or need <= available:
        return None
    return (
        f"--max-bytes {max_bytes} bytes need about {need / 2**30:.1f} GiB of memory (a buffer and "
        f"gloo's scratch copy on each of {world_size} ranks) but {available / 2**30:.1f} GiB "
        "is available; lower --max-bytes"
    )


def _validate(args: argparse.Namespace) -> dict:
    """Every problem with the flags in one ConfigError; else the plan for :func:`measure`."""
    problems, sizes = [], {}
    for flag in ("min_bytes", "max_bytes"):
        try:
            sizes[flag] = parse_size(getattr(args, flag))
        except ConfigError:
            problems.append(
                f"--{flag.replace('_', '-')} {getattr(args, flag)!r} is not a size "
                "(e.g. 4K, 4KiB, 256M, 1G)"
            )
    elem_bytes = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    if len(sizes) == 2 and sizes["min_bytes"] > sizes["max_bytes"]:
        problems.append(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    if sizes.get("min_bytes", 0) % elem_bytes:
        problems.append(f"--min-bytes {args.min_bytes} is not a whole number of {args.dtype}")
    if args.nproc < 2:
        problems.append(
            f"--nproc {args.nproc} must be >= 2 (an all-reduce over one rank "
            "moves no data, so it measures nothing)"
        )
    if args.factor < 2:
        problems.append(f"--factor {args.factor} must be >= 2")
    if args.warmup < 0 or args.iters < 1:
        problems.append(f"--warmup {args.warmup} must be >= 0 and --iters {args.iters} >= 1")
    for flag in ("budget_s", "timeout"):
        if not getattr(args, flag) > 0 or getattr(args, flag) == float("inf"):
            problems.append(
                f"--{flag.replace('_', '-')} {getattr(args, flag)} must be a "
                "finite number of seconds > 0"
            )
    for flag in ("csv", "json"):
        problem = output_problem(f"--{flag}", getattr(args, flag))
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(f"invalid benchmark settings: {'; '.join(problems)}. Fix the flags.")
    info = ProcessInfo(world_size=args.nproc, local_world_size=args.nproc)
    backend = resolve_backend(args.backend, info)
    problem = memory_problem(sizes["max_bytes"], args.nproc, backend)
    if problem:
        raise ConfigError(f"invalid benchmark settings: {problem}. Fix the flags.")
    return {
        "sizes": message_sizes(sizes["min_bytes"], sizes["max_bytes"], args.factor),
        "dtype": args.dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "budget_s": args.budget_s,
        "backend": backend,
    }


def run_ranks(plan: dict, world_size: int, timeout_s: float) -> list[tuple[int, float, int]]:
    """Start ``world_size`` ranks (spawned, FileStore rendezvous) and run :func:`measure`.

    Raises:
        DistributedError: a rank failed, died or ran past ``timeout_s``; every rank is killed
            and the message is one line naming the first failed rank.
    """
    from ddpkit.launch.spawn import DistributedTestError, run_distributed

    try:
        results = run_distributed(
            measure,
            world_size,
            args=(plan,),
            timeout_s=timeout_s,
            pg_timeout_s=timeout_s,
            backend=plan["backend"],
        )
    except DistributedTestError as exc:
        raise DistributedError(
            f"all-reduce benchmark failed, every rank stopped: {exc.first_cause()}"
        ) from None
    return results[0]


def run(args: argparse.Namespace) -> int:
    """Measure, print the machine, world size, backend and table; write --csv/--json. Returns 0.

    Raises:
        ConfigError: bad flags (every problem in one line) or nccl without a GPU per rank; the
            CLI prints it and exits 2.
        DistributedError: a rank failed (wrong result, crash, timeout); exit 1.
    """
    plan = _validate(args)
    device = torch.device("cuda", 0) if plan["backend"] == "nccl" else torch.device("cpu")
    memcpy = memcpy_gbps(max(plan["sizes"]), device)
    results = run_ranks(plan, args.nproc, args.timeout)
    elem_bytes = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    rows = [make_row(b, elem_bytes, t, r, args.nproc, memcpy) for b, t, r in results]
    info = machine()
    print(machine_line(info))
    print(
        f"world size {args.nproc}, backend {plan['backend']}, dtype {args.dtype}; "
        f"memory copy {memcpy:.2f} GB/s (dst.copy_(src), {max(plan['sizes'])} bytes on {device})"
    )
    print(format_table(rows, COLUMNS))
    print(MEMCPY_FOOTER)
    if args.csv:
        write_csv(args.csv, rows)
    if args.json:
        write_json(
            args.json,
            {
                "machine": info,
                "world_size": args.nproc,
                "backend": plan["backend"],
                "dtype": args.dtype,
                "memcpy_gbps": memcpy,
                "memcpy_bytes": max(plan["sizes"]),
                "memcpy_device": str(device),
                "rows": rows,
            },
        )
    return 0
