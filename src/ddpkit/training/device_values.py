"""Step values kept on the device and read on the host only when asked: no sync per micro-step.

Reading a CUDA tensor on the host (``loss.item()``, ``float(loss)``, ``bool(...)``,
``.tolist()``) waits for every kernel queued before it, so the host can no longer run ahead of
the GPU. :class:`~ddpkit.TrainStep` therefore keeps each micro-step's loss on the device
(:class:`DeviceValues`), and the loops that add the losses up (:class:`~ddpkit.EpochLoss`, the
MNIST job's per-``--log-every`` record) keep their running sums there too (:class:`DeviceSum`):
the host reads them once per logging interval, or when a caller asks for a value (as torchtitan
does). On CPU nothing changes but the bookkeeping.

The sums are float64 and added one value at a time in the order the values came, which is what
Python's ``total += value`` does with floats: the results are bitwise those of adding the read
floats on the host.

Example:
    >>> values = DeviceValues(torch.tensor([0.5, 0.25], dtype=torch.float64))
    >>> len(values)  # from the shape: no read
    2
    >>> total = DeviceSum()
    >>> total.add_each(values.tensor)  # no read
    >>> total.value(), sum(values)  # one read each
    (0.75, 0.75)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import torch


class DeviceValues(Sequence[float]):
    """A tuple of floats that stays a tensor on its device until it is first read.

    Reading it (iterating, indexing, comparing, ``sum``) copies the tensor to the host once
    (one sync) and keeps the floats; ``len`` and :attr:`tensor` never read.

    Args:
        tensor: shape ``(num_values,)``; detached.

    Attributes:
        tensor: the values where they were computed (no sync to use them in further tensor ops).
    """

    __slots__ = ("_host", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach().reshape(-1)
        self._host: tuple[float, ...] | None = None

    def _values(self) -> tuple[float, ...]:
        if self._host is None:
            self._host = tuple(self.tensor.tolist())  # the one device-to-host copy
        return self._host

    def __len__(self) -> int:
        return self.tensor.shape[0]

    @overload
    def __getitem__(self, index: int) -> float: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[float, ...]: ...

    def __getitem__(self, index: int | slice) -> float | tuple[float, ...]:
        return self._values()[index]

    def __iter__(self) -> Iterator[float]:
        return iter(self._values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DeviceValues):
            return self._values() == other._values()
        return self._values() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return repr(self._values())


def values_tensor(values: Sequence[float]) -> torch.Tensor:
    """``values`` as a float64 tensor: a :class:`DeviceValues`' own (no read), else on CPU."""
    if isinstance(values, DeviceValues):
        return values.tensor
    return torch.tensor(tuple(values), dtype=torch.float64)


class DeviceSum:
    """A float64 running sum kept on the device of the values added to it (no sync per add).

    Bitwise what ``total = 0.0; total += value`` gives on the host for the same values in the
    same order; :meth:`value` reads it (one sync).
    """

    def __init__(self) -> None:
        self._total: torch.Tensor | None = None

    def add(self, value: torch.Tensor) -> None:
        """Add one value (a one-element tensor)."""
        self.add_each(value.reshape(1))

    def add_each(self, values: torch.Tensor) -> None:
        """Add each of ``values`` (shape ``(k,)``) in turn, first to last."""
        values = values.detach().to(torch.float64)
        total = self._total if self._total is not None else values.new_zeros(())
        for value in values.unbind(0):
            total = total + value
        self._total = total

    def tensor(self) -> torch.Tensor:
        """The sum as a 0-dim float64 tensor on its device (CPU when nothing was added)."""
        return self._total if self._total is not None else torch.zeros((), dtype=torch.float64)

    def value(self) -> float:
        """The sum on the host (one device-to-host read; ``0.0`` when nothing was added)."""
        return float(self._total) if self._total is not None else 0.0


def sequential_sum(values: torch.Tensor) -> torch.Tensor:
    """Python's ``sum(values)`` on the device: from 0.0, first to last (not pairwise).

    Args:
        values: shape ``(k,)``.

    Returns:
        A 0-dim float64 tensor on ``values``' device.
    """
    total = DeviceSum()
    total.add_each(values)
    return total.tensor() if len(values) else values.new_zeros((), dtype=torch.float64)
