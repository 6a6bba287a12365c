"""Cost of telling the truth about replicated state: the save-time cross-rank comparison and
evaluate's broadcast of rank 0's buffers.

    OMP_NUM_THREADS=1 python bench/state_cost.py --repeats 20

Two gloo ranks (forked by ``ddpkit.testing.run_distributed``), interleaved A B A B, medians:

1. checkpoint save of the MNIST CNN + Adam state (the ``ddpkit train`` checkpoint), with the
   comparison (as shipped) and with the checksums replaced by nothing (what ddpkit did before);
   also the checksum computation alone, per save;
2. ``evaluate`` of 2,000 MNIST-shaped test images on a CNN with BatchNorm (the MNIST CNN plus
   BatchNorm2d after each convolution), with rank 0's buffers broadcast first (as shipped) and
   without; the broadcast itself. The MNIST CNN has no buffers: there it is no work at all.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.app.mnist.model import MnistCNN
from ddpkit.checkpoint import consistency, manager
from ddpkit.testing import run_distributed
from ddpkit.training import evaluate as evaluate_module


def _ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


def _save_rank(rt, repeats: int) -> dict[str, float]:
    model = ddpkit.wrap_model(MnistCNN(), rt)
    optimizer = torch.optim.Adam(model.parameters())
    F.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.zeros(8, dtype=torch.long)).backward()
    optimizer.step()
    shipped, without, digest = [], [], []
    real = consistency.replicated_digests
    with tempfile.TemporaryDirectory() as tmp:
        state = {"model": model, "optimizer": optimizer}
        ckpt = ddpkit.CheckpointManager(tmp, rt, state=state, keep_last=2)
        for step in range(1, 2 * repeats + 1):
            compare = step % 2 == 1
            manager.replicated_digests = real if compare else (lambda *a, **k: {})
            start = time.perf_counter()
            ckpt.save(step)
            (shipped if compare else without).append(time.perf_counter() - start)
            start = time.perf_counter()
            real(state)
            digest.append(time.perf_counter() - start)
    manager.replicated_digests = real
    return {"with_ms": _ms(shipped), "without_ms": _ms(without), "digest_ms": _ms(digest)}


def _bn_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def _evaluate_rank(rt, repeats: int) -> dict[str, float]:
    model = ddpkit.wrap_model(_bn_cnn(), rt)
    model(torch.randn(16, 1, 28, 28)).sum().backward()  # running statistics now differ
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(2000, 1, 28, 28, generator=gen), torch.randint(0, 10, (2000,)))
    loader = ddpkit.build_eval_loader(data, rt, batch_size=500)
    real = evaluate_module.rank_zero_buffers
    shipped, without, broadcast = [], [], []
    for i in range(2 * repeats):
        evaluate_module.rank_zero_buffers = real if i % 2 == 0 else _no_broadcast
        start = time.perf_counter()
        ddpkit.evaluate(model, loader, rt)
        (shipped if i % 2 == 0 else without).append(time.perf_counter() - start)
        start = time.perf_counter()
        with real(ddpkit.unwrap_model(model), rt):
            pass
        broadcast.append(time.perf_counter() - start)
    evaluate_module.rank_zero_buffers = real
    return {"with_ms": _ms(shipped), "without_ms": _ms(without), "broadcast_ms": _ms(broadcast)}


@contextlib.contextmanager
def _no_broadcast(module, runtime):
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    save = run_distributed(_save_rank, 2, args=(args.repeats,), timeout_s=600)[0]
    print(
        f"save, MNIST CNN + Adam, 2 ranks: {save['with_ms']:.1f} ms with the cross-rank "
        f"comparison, {save['without_ms']:.1f} ms without; checksums alone "
        f"{save['digest_ms']:.2f} ms ({args.repeats} interleaved pairs, torch {torch.__version__})"
    )
    ev = run_distributed(_evaluate_rank, 2, args=(args.repeats,), timeout_s=600)[0]
    print(
        f"evaluate, 2,000 images, BatchNorm CNN, 2 ranks: {ev['with_ms']:.1f} ms with rank 0's "
        f"buffers broadcast, {ev['without_ms']:.1f} ms without; broadcast and restore alone "
        f"{ev['broadcast_ms']:.2f} ms"
    )


if __name__ == "__main__":
    main()
