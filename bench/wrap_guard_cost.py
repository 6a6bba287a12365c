"""Per-step cost of wrap_model's guard (ddpkit.guards.wrapped): steps/s with and without.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/wrap_guard_cost.py --rounds 7 --steps 100

Two ranks (gloo, CPU). For each model, two copies of one module are stepped: one through a plain
``DistributedDataParallel`` ("raw") and through ``ddpkit.wrap_model`` (DDP plus the guard:
the forward pre-hook on the wrapper and a post-accumulate-grad hook per parameter), alternately
in rounds of ``--steps`` steps (A B B A ...), after 10 warm-up steps each. Models: the MNIST CNN
of ``ddpkit train`` (8 parameters, batch 64 of 1x28x28) and a 32-layer MLP of width 64
(64 parameters, batch 16: little compute per parameter, the guard's worst case). Prints per
model the median steps/s of each form and the median of the per-round ratios guarded/raw, then
the guard's own time per step measured directly (its hook bodies called 20000 times, plus
torch's dispatch of one Python hook per parameter, measured on a bare backward), which stays
readable on a machine too noisy for the ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.testing import run_distributed


def _models() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    from ddpkit.app.mnist.model import MnistCNN

    torch.manual_seed(0)
    layers = [m for _ in range(32) for m in (nn.Linear(64, 64), nn.ReLU())]
    return {
        "mnist_cnn": (MnistCNN(), torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))),
        "mlp_32x64": (nn.Sequential(*layers), torch.randn(16, 64), torch.randint(0, 64, (16,))),
    }


def _steps_per_s(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_steps: int) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    for _ in range(num_steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return num_steps / (time.perf_counter() - start)


def _worker(runtime, rounds: int, steps: int) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {}
    for name, (net, x, y) in _models().items():
        forms = {
            "raw": DistributedDataParallel(copy.deepcopy(net), process_group=runtime.process_group),
            "guarded": ddpkit.wrap_model(net, runtime),
        }
        rates: dict[str, list[float]] = {form: [] for form in forms}
        for model in forms.values():  # warm-up
            _steps_per_s(model, x, y, 10)
        for index in range(rounds):
            order = list(forms) if index % 2 == 0 else list(reversed(forms))
            for form in order:
                rates[form].append(_steps_per_s(forms[form], x, y, steps))
        rates["hook_us_per_step"] = [_hook_cost_us(net)]
        results[name] = rates
    return results


def _hook_cost_us(net: nn.Module, num_calls: int = 20000) -> float:
    """The guard's own time per step, called directly: its pre-hook once, each parameter's
    post-accumulate-grad hook once (the hook bodies, not torch's dispatch to them)."""
    from ddpkit.guards.wrapped import _GUARDED

    guard = _GUARDED[net]()
    hooks = [guard._gradient_hook(index) for index in range(len(guard.params))]
    start = time.process_time()
    for _ in range(num_calls):
        guard._before_forward(guard.module, ())
        for hook, param in zip(hooks, guard.params, strict=True):
            hook(param)
    return (time.process_time() - start) / num_calls * 1e6


def _dispatch_us_per_parameter(num_params: int = 64, repeats: int = 1000) -> float:
    """What torch adds to call one Python post-accumulate-grad hook in backward (plus its body):
    a backward over ``num_params`` one-element parameters with and without such hooks."""
    params = [nn.Parameter(torch.ones(1)) for _ in range(num_params)]
    last = [0] * num_params

    def backward_us() -> float:  # CPU time of this process: other processes' load left out
        start = time.process_time()
        for _ in range(repeats):
            sum(p.sum() for p in params).backward()
        return (time.process_time() - start) / repeats * 1e6

    def hook_for(index: int):
        def hook(param: torch.Tensor) -> None:
            last[index] = last[index] + 1  # about the guard's body: a compare and a store

        return hook

    without, with_hooks = [], []
    for _ in range(9):  # interleaved; the minimum of each is the least disturbed by other load
        without.append(backward_us())
        handles = [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params)]
        with_hooks.append(backward_us())
        for handle in handles:
            handle.remove()
    return (min(with_hooks) - min(without)) / num_params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    per_rank = run_distributed(_worker, 2, args=(args.rounds, args.steps), timeout_s=3600)
    rank0 = per_rank[0]
    print(f"torch {torch.__version__}, 2 ranks, gloo, CPU, {torch.get_num_threads()} thread(s)")
    dispatch_us = _dispatch_us_per_parameter()
    print(f"one Python post-accumulate-grad hook, dispatch included: {dispatch_us:.2f} us")
    for name, rates in rank0.items():
        ratios = [g / r for g, r in zip(rates["guarded"], rates["raw"], strict=True)]
        num_params = sum(1 for _ in _models()[name][0].parameters())
        hook_us = rates["hook_us_per_step"][0] + num_params * max(dispatch_us, 0.0)
        step_us = 1e6 / statistics.median(rates["raw"])
        print(
            f"{name:10s} raw {statistics.median(rates['raw']):7.1f} steps/s  guarded "
            f"{statistics.median(rates['guarded']):7.1f} steps/s  ratio (median of rounds) "
            f"{statistics.median(ratios):.4f}  rounds: {', '.join(f'{r:.3f}' for r in ratios)}"
        )
        print(
            f"{'':10s} guard {hook_us:.1f} us per step (hooks and their dispatch) = "
            f"{100 * hook_us / step_us:.3f}% "
            f"of a raw step ({step_us / 1000:.2f} ms)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
