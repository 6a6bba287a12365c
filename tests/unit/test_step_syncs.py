"""``TrainStep`` reads nothing from the device per micro-step (issue #25 §6).

A read (``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``, ``.tolist()``) of a CUDA tensor waits
for the GPU; the step keeps its losses on the device and the loops that add them up read them
once per logging interval, with the values the host reads gave before, bitwise. On CPU, in one
process, the reads are counted by patching the tensor methods that copy to the host.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.app.mnist.monitor import TrainingMonitor
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.device_values import DeviceSum, DeviceValues, sequential_sum
from ddpkit.training.loop import EpochLoss

READS = ("item", "tolist", "__float__", "__bool__", "__int__", "__index__")
K, NUM_STEPS, LOG_EVERY = 4, 8, 4


@contextlib.contextmanager
def counted_reads() -> Iterator[list[str]]:
    """Every tensor-to-host read in the ``with`` body, by method name."""
    reads: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str):
        def read(self, *args, **kwargs):
            reads.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield reads
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def _setup(num_layers: int = 1, guard: bool = False, device: str = "cpu"):
    torch.manual_seed(0)
    runtime = Runtime(ProcessInfo(), device=torch.device(device))
    layers = [nn.Linear(8, 8) for _ in range(num_layers)]
    model = nn.Sequential(*layers, nn.Linear(8, 3)).to(runtime.device)
    seen: list[tuple[torch.Tensor, int]] = []

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(outputs, targets)
        seen.append((loss.detach().clone(), len(targets)))
        return loss

    step = ddpkit.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        runtime=runtime,
        num_micro_steps=K,
        loss_fn=loss_fn,
        guard=ddpkit.NonFiniteGuard(runtime, "raise") if guard else None,
    )
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(5 + i % 3, 8, generator=generator), torch.randint(0, 3, (5 + i % 3,)))
        for i in range(K * NUM_STEPS)
    ]
    return runtime, step, batches, seen


def test_micro_steps_read_nothing_and_a_log_interval_reads_once():
    _runtime, step, batches, _seen = _setup()
    epoch_loss, logged = EpochLoss(), []
    since = DeviceSum()
    with counted_reads() as reads:
        for result in ddpkit.train_epoch(step, batches):
            epoch_loss.add(result)
            since.add(sequential_sum(result.loss_sums_tensor))
            if result.step % LOG_EVERY == 0:
                logged.append(since.value())  # the interval's one read
                since = DeviceSum()
    # before: one float(loss) per micro-step (32 here), whatever the logging interval
    assert len(reads) == NUM_STEPS // LOG_EVERY, reads
    assert len(logged) == 2


def test_the_values_are_bitwise_the_host_reads():
    _runtime, step, batches, seen = _setup()
    results = list(ddpkit.train_epoch(step, batches))
    host = [float(loss) * n for loss, n in seen]  # what the step read per micro-step before
    per_step = [tuple(host[i : i + K]) for i in range(0, len(host), K)]
    assert [r.loss_sums for r in results] == per_step
    assert all(isinstance(r.loss_sums, DeviceValues) for r in results)
    assert [r.loss_sum for r in results] == [sum(values) for values in per_step]
    epoch_loss, expected = EpochLoss(), 0.0
    for result in results:
        epoch_loss.add(result)
    for value in host:
        expected += value
    assert epoch_loss.loss_sum == expected  # exact: the same additions in the same order


def test_device_sums_add_as_python_does():
    rng = random.Random(3)
    values = [rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8) for _ in range(500)]
    tensor = torch.tensor(values, dtype=torch.float64)
    total, running = DeviceSum(), 0.0
    total.add_each(tensor)
    for value in values:
        running += value
    assert total.value() == running == sum(values)
    assert float(sequential_sum(tensor)) == sum(values)
    assert float(tensor.sum()) != sum(values)  # a pairwise sum differs: order matters


def test_the_monitor_reads_once_per_record(tmp_path):
    runtime, step, batches, _seen = _setup()
    monitor = TrainingMonitor(
        tmp_path, runtime, step.timer, step.optimizer, 0, LOG_EVERY, "off", "off"
    )
    results = []
    with counted_reads() as reads:
        for result in ddpkit.train_epoch(step, batches):
            results.append(result)
            monitor.on_step(result.step, result)
    # per record: the loss sum (the device read) and the reduced pair (a host tensor)
    assert len(reads) == 2 * NUM_STEPS // LOG_EVERY, reads
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    expected = []  # what the monitor computed from the host reads before
    for first in range(0, NUM_STEPS, LOG_EVERY):
        loss_sum = num_samples = 0.0
        for result in results[first : first + LOG_EVERY]:
            loss_sum += result.loss_sum
            num_samples += result.num_samples
        expected.append(loss_sum / num_samples)
    assert [r["step"] for r in records] == [4, 8]
    assert [r["loss"] for r in records] == expected


@pytest.mark.parametrize("num_layers", [1, 6])
def test_the_guard_reads_once_per_optimizer_step(num_layers):
    _runtime, step, batches, _seen = _setup(num_layers, guard=True)
    with counted_reads() as reads:
        results = list(ddpkit.train_epoch(step, batches))
    assert len(results) == NUM_STEPS
    # per step: the finite flags (one device read) and the ranks' table (a host tensor, two
    # columns): not one read per parameter or per micro-step
    assert len(reads) == 3 * NUM_STEPS, reads


def test_the_guard_names_the_step_of_a_nan_loss():
    _runtime, step, batches, _seen = _setup(guard=True)
    x, y = batches[2 * K + 1]  # step 3, its second micro-step
    batches[2 * K + 1] = (torch.full_like(x, float("nan")), y)
    with pytest.raises(ddpkit.NonFiniteError, match="non-finite loss at step 3 on rank"):
        list(ddpkit.train_epoch(step, batches))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode")
def test_no_step_synchronizes_the_gpu():
    # Not run on the CI machine (no GPU): torch raises at any synchronizing call. The runtime's
    # device is set: Runtime(ProcessInfo()) alone computes on the CPU, where nothing is checked.
    runtime, step, batches, _seen = _setup(device="cuda:0")
    assert next(step.model.parameters()).is_cuda
    batches = [(x.to(runtime.device), y.to(runtime.device)) for x, y in batches]
    epoch_loss = EpochLoss()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for result in ddpkit.train_epoch(step, batches):
            epoch_loss.add(result)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert epoch_loss.loss_sum > 0  # the one read, after the loop
