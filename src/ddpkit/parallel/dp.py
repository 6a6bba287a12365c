"""``DataParallel``: one process driving several CUDA devices (strategy ``dp``).

Each forward replicates the module onto every device, scatters the batch along dim 0, and
gathers the outputs on the first device; backward sums gradients there. It is one process, so
the Python interpreter and the replication on every step limit it: PyTorch recommends
``DistributedDataParallel`` (one process per device) even on a single machine, and so does
ddpkit (strategy ``ddp``). ``dp`` exists for code that must stay in one process.

Without at least two CUDA devices ``dp`` is refused with an error; it never silently falls back
to a single device.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DataParallel

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger
from ddpkit.parallel.choices import strategy_problems
from ddpkit.runtime.process_group import Runtime

DDP_ADVICE = (
    "PyTorch recommends DistributedDataParallel even on one machine: use strategy 'ddp' "
    "with one process per GPU (ddpkit train --strategy ddp --nproc N, or ddpkit run -n N)"
)


def check_dp_possible(world_size: int, device_ids: list[int] | None = None) -> list[int]:
    """The CUDA device ids ``dp`` would use, or a :class:`ConfigError` saying why it cannot run.

    Raises:
        ConfigError: more than one process (``dp`` is one process); fewer than 2 CUDA devices;
            a device id that does not exist.
    """
    for problem in strategy_problems("dp", world_size):  # one process
        raise ConfigError(f"{problem}.")
    num_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ids = list(range(num_devices)) if device_ids is None else list(device_ids)
    if num_devices < 2 or len(ids) < 2:
        raise ConfigError(
            f"strategy='dp' needs 2 or more CUDA devices: found {num_devices}"
            f"{'' if device_ids is None else f', device_ids={ids}'}. Use strategy 'single' "
            "for one device or the CPU, or 'ddp' for several processes."
        )
    missing = [i for i in ids if not 0 <= i < num_devices]
    if missing:
        raise ConfigError(
            f"strategy='dp': device_ids {missing} do not exist ({num_devices} CUDA devices). "
            f"Pass ids between 0 and {num_devices - 1}."
        )
    return ids


def wrap_data_parallel(
    model: nn.Module, runtime: Runtime, device_ids: list[int] | None = None
) -> DataParallel:
    """Wrap ``model`` in ``torch.nn.DataParallel`` over ``device_ids`` (default: every GPU).

    Shapes: the wrapped model takes ``(batch, ...)`` inputs on any device and returns outputs
    on ``cuda:device_ids[0]``; batch is split across the devices along dim 0.

    Not a collective (one process). Logs a line recommending ``ddp``.

    Raises:
        ConfigError: see :func:`check_dp_possible`.

    Example:
        >>> # needs 2+ CUDA GPUs in one process: DataParallel splits the batch over them
        >>> model = wrap_data_parallel(Net(), rt)  # doctest: +SKIP
    """
    ids = check_dp_possible(runtime.world_size, device_ids)
    get_logger("parallel").info(
        "strategy dp: DataParallel over cuda:%s in one process. %s.",
        ",".join(str(i) for i in ids),
        DDP_ADVICE,
    )
    model = model.to(torch.device("cuda", ids[0]))
    return DataParallel(model, device_ids=ids, output_device=ids[0])
