"""What ``wrap_model(compile=...)`` costs and gains: compile time, then time per step against eager.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/compile_cost.py --rounds 7 --steps 20
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/compile_cost.py --backends inductor aot_eager \
        --one-process

Two ranks (gloo, CPU; on a machine with 2 GPUs, ``--backend nccl`` runs one rank per GPU). The
MNIST CNN of ``ddpkit train`` (batch 64 per rank of 1x28x28, Adam), two copies of one module:
``ddpkit.wrap_model(net, rt)`` (eager DDP) and ``ddpkit.wrap_model(net, rt, compile=...)``
(DDP compiled in place, with the gradient check of its first 3 steps).

- compile: the wall time of the compiled model's first optimizer step minus the eager model's
  (both ranks compile at the same time), with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``
  set to a new folder per run: a cold compile, what a fresh machine pays; a second run of the
  same model on the same machine hits the cache and pays less);
- per step: after 5 warm-up steps each, rounds of ``--steps`` steps alternating eager/compiled
  (A B B A ...); median ms per step of each form and the median of the per-round ratios
  compiled/eager (below 1: compiled is faster);
- the gradient check: its comparison timed directly (checksums of every gradient and one
  all-gather), per checked step; it runs on 3 steps and is then removed;
- ``--one-process``: the same comparison in one process without DDP, which tells the
  compiler's own code for this CNN apart from what DDP adds.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
from torch.nn import functional as F

import ddpkit
from ddpkit.testing import run_distributed


def _timed_steps(model, optimizer, x, y, num_steps: int) -> float:
    """Seconds per optimizer step over ``num_steps`` steps (synchronised on CUDA)."""
    start = time.perf_counter()
    for _ in range(num_steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_steps


def _worker(runtime, backend: str, rounds: int, steps: int) -> dict[str, object]:
    from ddpkit.app.mnist.model import MnistCNN
    from ddpkit.guards.grad_sync import GradSyncCheck

    torch.manual_seed(0)
    net = MnistCNN()
    device = runtime.device
    x = torch.randn(64, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    forms = {
        "eager": ddpkit.wrap_model(copy.deepcopy(net), runtime),
        "compiled": ddpkit.wrap_model(net, runtime, compile={"backend": backend}),
    }
    optimizers = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in forms.items()}
    first = {k: _timed_steps(m, optimizers[k], x, y, 1) for k, m in forms.items()}
    for form, model in forms.items():  # warm-up (a recompile, if any, happens here)
        _timed_steps(model, optimizers[form], x, y, 5)
    per_step: dict[str, list[float]] = {form: [] for form in forms}
    for index in range(rounds):
        order = list(forms) if index % 2 == 0 else list(reversed(forms))
        for form in order:
            per_step[form].append(_timed_steps(forms[form], optimizers[form], x, y, steps))
    check = GradSyncCheck(forms["eager"], runtime, num_steps=10**9)  # timed, never attached
    start = time.perf_counter()
    for _ in range(20):
        check.before_step(optimizers["eager"])
    check_s = (time.perf_counter() - start) / 20
    return {"first": first, "per_step": per_step, "check_s": check_s}


def _one_process(backend: str, rounds: int, steps: int) -> tuple[float, list[float]]:
    """The same comparison in this process without DDP (``nn.Module.compile`` on the CNN):
    whether a slowdown is the compiler's code for this model or comes with DDP."""
    from ddpkit.app.mnist.model import MnistCNN

    torch.manual_seed(0)
    eager = MnistCNN()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend=backend)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    optimizers = {m: torch.optim.Adam(m.parameters(), lr=1e-3) for m in (eager, compiled)}
    with tempfile.TemporaryDirectory(prefix="ddpkit-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        compile_s = _timed_steps(compiled, optimizers[compiled], x, y, 1)
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    for model in (eager, compiled):
        _timed_steps(model, optimizers[model], x, y, 5)
    ratios = []
    for index in range(rounds):
        order = (eager, compiled) if index % 2 == 0 else (compiled, eager)
        seconds = {id(m): _timed_steps(m, optimizers[m], x, y, steps) for m in order}
        ratios.append(seconds[id(compiled)] / seconds[id(eager)])
    return compile_s, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["inductor"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="gloo", help="process group backend")
    parser.add_argument(
        "--one-process", action="store_true", help="also time the CNN in this process, no DDP"
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, 2 ranks, {args.backend}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} thread(s) per rank; MNIST CNN, batch 64 per rank, Adam"
    )
    for compile_backend in args.backends:
        with tempfile.TemporaryDirectory(prefix="ddpkit-inductor-") as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache}  # a cold compile
            rank0 = run_distributed(
                _worker,
                2,
                args=(compile_backend, args.rounds, args.steps),
                backend=args.backend,
                env=env,
                timeout_s=3600,
            )[0]
        eager, compiled = rank0["per_step"]["eager"], rank0["per_step"]["compiled"]
        ratios = [c / e for c, e in zip(compiled, eager, strict=True)]
        first = rank0["first"]
        print(
            f"{compile_backend:10s} 2 ranks: compile {first['compiled'] - first['eager']:6.1f} s "
            f"(first step {first['compiled']:.1f} s vs eager {first['eager'] * 1000:.0f} ms)  "
            f"eager {statistics.median(eager) * 1000:6.1f} ms/step  compiled "
            f"{statistics.median(compiled) * 1000:6.1f} ms/step  ratio compiled/eager "
            f"{statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
        )
        print(
            f"{'':10s} gradient check {rank0['check_s'] * 1000:.2f} ms per checked step "
            f"(3 steps per run)"
        )
        if args.one_process:
            compile_s, ratios = _one_process(compile_backend, args.rounds, args.steps)
            print(
                f"{'':10s} 1 process, no DDP: compile {compile_s:.1f} s, ratio compiled/eager "
                f"{statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
