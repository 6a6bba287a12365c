"""What wraps a module or a tensor, and the module inside: DDP, DataParallel, ``torch.compile``,
FSDP2's ``fully_shard`` and its ``DTensor`` shards.

The bottom of the library's model handling: it imports nothing of ddpkit, so the guards (which
inspect wrapped models) and the strategies (which build them) both stand on it. FSDP, DTensor
and ``torch.compile`` are recognised without importing them: each is looked up only when its
torch module is already imported (a sharded or compiled model implies it is).

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Linear(2, 2)
    >>> unwrap_model(nn.DataParallel(net)) is net
    True
    >>> is_compiled(net), is_fsdp(net), is_sharded_tensor(net.weight)
    (False, False, False)
    >>> local_tensor(net.weight) is net.weight
    True
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "WRAPPERS",
    "is_compiled",
    "is_fsdp",
    "is_sharded_tensor",
    "local_tensor",
    "uncompiled",
    "unwrap_model",
]

WRAPPERS = (DistributedDataParallel, DataParallel)  # wrappers that hold the module in .module


def is_compiled(model: object) -> bool:
    """True for what ``torch.compile(module)`` returns (``torch._dynamo``'s ``OptimizedModule``).

    Looked up only when ``torch._dynamo`` is already imported (a compiled module implies it is),
    so this costs no import; the compiled wrapper holds the original module in ``_orig_mod``,
    the attribute torch documents for it and every library unwraps through.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(model, optimized)


def is_fsdp(model: object) -> bool:
    """True for a module ``fully_shard`` was applied to (an ``FSDPModule``).

    Looked up only when torch's FSDP package is already imported (a sharded module implies
    it is), so this costs no import for DDP users.
    """
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    fsdp_module = getattr(module, "FSDPModule", None)
    return fsdp_module is not None and isinstance(model, fsdp_module)


def is_sharded_tensor(tensor: object) -> bool:
    """True for a ``DTensor`` (what FSDP2 makes of parameters, gradients, optimizer state)."""
    module = sys.modules.get("torch.distributed.tensor._api")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: ``tensor.to_local()`` for a ``DTensor``, else ``tensor``.

    Checks on the local part stay local: a ``DTensor`` reduction would be a collective.
    """
    if is_sharded_tensor(tensor):
        return cast("DTensor", tensor).to_local()
    return tensor


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside any ``torch.compile`` wrappers (``_orig_mod``); else ``model``.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> uncompiled(net) is net  # uncompiled(torch.compile(net)) is net too
        True
    """
    while is_compiled(model):
        inner = model._orig_mod
        assert isinstance(inner, nn.Module)  # torch.compile wraps modules only
        model = inner
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside any DDP/DataParallel and ``torch.compile`` wrappers.

    Its state dict keys lack the wrappers' ``module.`` and ``_orig_mod.`` prefixes, in any
    nesting (``DDP(torch.compile(m))``, ``torch.compile(DDP(m))``). Not a collective.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> unwrap_model(nn.DataParallel(nn.DataParallel(net))) is net
        True
        >>> unwrap_model(net) is net
        True
    """
    while isinstance(model, WRAPPERS) or is_compiled(model):
        model = model.module if isinstance(model, WRAPPERS) else uncompiled(model)
    return model
