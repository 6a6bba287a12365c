"""Where a rank's training thread is, read from its Python stack: no markers needed.

The watchdog's thread calls :func:`locate` once per heartbeat with the training thread's
innermost frame (``sys._current_frames()``). A thread blocked in a collective sits in a function
of ``torch.distributed.distributed_c10d`` (``work.wait()`` releases the GIL, so the sampling
thread runs), DDP's gradient all-reduce blocks inside autograd's ``_engine_run_backward``, and
both are told apart from "running other code" by the innermost frame alone. The user's line is
the first frame outside torch, ddpkit and the standard library.

For a collective it also reads, from the c10d frame's arguments, the group (its name, members
and sequence number: how many collectives it has issued, the current one included) and the
tensor's dtype and shape. Two ranks blocked in the same operation on the same group at the same
sequence number are in the same collective; anything else cannot match.
"""

from __future__ import annotations

import linecache
import os
import sysconfig
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DDPKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_DISTRIBUTED = os.path.join(_TORCH_DIR, "distributed") + os.sep
_C10D = os.path.join(_DISTRIBUTED, "distributed_c10d.py")
_AUTOGRAD = os.path.join(_TORCH_DIR, "autograd", "graph.py")
_DDP = os.path.join(_TORCH_DIR, "nn", "parallel", "distributed.py")
_DATALOADER = os.path.join(_TORCH_DIR, "utils", "data", "dataloader.py")
#: ``op`` of a thread waiting for its DataLoader's worker processes (torch's function it waits in)
DATALOADER_WAIT = "_try_get_data"

#: c10d functions that every rank of the group must enter (the object variants call these)
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "gather",
        "scatter",
        "all_to_all",
        "all_to_all_single",
        "barrier",
    }
)
_TENSOR_ARGS = ("tensor", "input_tensor", "input", "tensor_list", "input_tensor_list")

# states of a position
COLLECTIVE = "collective"  # blocked in one of COLLECTIVES
BACKWARD = "backward"  # in autograd's backward with the process idle: DDP's gradient all-reduce
WAITING = "waiting"  # in other torch.distributed code (p2p, group creation, DDP internals)
RUNNING = "running"  # anywhere else


@dataclass(frozen=True)
class Position:
    """Where a training thread is.

    Attributes:
        state: :data:`COLLECTIVE`, :data:`BACKWARD`, :data:`WAITING` or :data:`RUNNING`.
        op: the c10d function (``"all_reduce"``), ``"backward"``, or for other code the
            innermost function's name.
        group: the process group's name (``"0"`` is the default group); ``""`` if unknown.
        ranks: the group's global ranks; empty if unknown (DDP's group inside backward).
        seq: the group's sequence number (collectives issued so far, this one included), or
            ``None`` where torch does not give it.
        site: ``file:line`` of the user's code that called it (running: the innermost line of
            the user's code, ``op`` naming the function actually running).
        via: the ddpkit function in between (``"evaluate"``), or ``""``.
        tensor: ``"float32 (4,)"`` for a collective's tensor, else ``""``.
        outer_op: the torch.distributed function the user called when it differs from ``op``
            (``all_gather_object`` around ``all_gather``), else ``""``.
    """

    state: str
    op: str
    group: str = ""
    ranks: tuple[int, ...] = ()
    seq: int | None = None
    site: str = ""
    via: str = ""
    tensor: str = ""
    outer_op: str = ""

    @property
    def blocked(self) -> bool:
        return self.state != RUNNING

    @property
    def key(self) -> tuple:
        """Equal on two ranks exactly when they wait in the same collective."""
        return (self.state, self.op, self.group, self.seq)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ranks": list(self.ranks)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Position:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, "ranks": tuple(fields.get("ranks", ()))})


def locate(frame: FrameType | None, *, idle: bool) -> Position:
    """The position of the thread whose innermost Python frame is ``frame``.

    Args:
        frame: the thread's innermost frame (``sys._current_frames()[thread_id]``); ``None``
            for a thread that is gone.
        idle: the process used (almost) no CPU over the last interval. Backward and DDP's own
            code count as blocked only then (they also compute).
    """
    if frame is None:
        return Position(RUNNING, "(thread gone)")
    code = frame.f_code
    if code.co_filename == _C10D and not code.co_name.startswith("_"):
        state = COLLECTIVE if code.co_name in COLLECTIVES else WAITING
        return _collective(frame, state)
    if code.co_filename == _DDP and idle:
        ddp_collective = _ddp_forward_collective(frame)
        if ddp_collective is not None:
            return ddp_collective
    if code.co_filename.startswith(_DISTRIBUTED) or code.co_filename == _DDP:
        if idle:  # group creation, DDP's set-up and buffer broadcasts, point-to-point calls
            return Position(WAITING, code.co_name, site=user_site(frame), via=_via(frame))
    elif code.co_filename == _AUTOGRAD and code.co_name == "_engine_run_backward" and idle:
        return Position(BACKWARD, "backward", site=user_site(frame), via=_via(frame))
    op = DATALOADER_WAIT if _waits_for_dataloader_workers(frame) else code.co_name
    return Position(RUNNING, op, site=user_site(frame))


def _waits_for_dataloader_workers(frame: FrameType | None) -> bool:
    """Whether the thread waits in torch's DataLoader for a batch from its worker processes
    (``_try_get_data``, below it only the standard library: queues, pipes, ``select``)."""
    while frame is not None and frame.f_code.co_filename.startswith((_STDLIB_DIR, "<frozen")):
        frame = frame.f_back
    return (
        frame is not None
        and frame.f_code.co_filename == _DATALOADER
        and frame.f_code.co_name == DATALOADER_WAIT
    )


def _collective(frame: FrameType, state: str) -> Position:
    # Reading another thread's locals: the thread is blocked in C (GIL released), so the
    # snapshot is consistent; only the c10d function's own arguments are read.
    local = frame.f_locals
    group = local.get("group")
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    name, seq = "", None
    ranks: tuple[int, ...] = ()
    if isinstance(group, dist.ProcessGroup):
        name, ranks = group.group_name, tuple(dist.get_process_group_ranks(group))
        seq = sequence_number(group)
    outer = _outermost_torch_distributed(frame)
    return Position(
        state,
        frame.f_code.co_name,
        group=name,
        ranks=ranks,
        seq=seq,
        site=user_site(frame),
        via=_via(frame),
        tensor=describe_tensor(next((local[k] for k in _TENSOR_ARGS if k in local), None)),
        outer_op=outer if outer != frame.f_code.co_name else "",
    )


def _ddp_forward_collective(frame: FrameType) -> Position | None:
    """DDP's forward blocked in its own broadcast, which runs in C++ with no c10d frame: the
    bucket rebuild at the step after the first backward (``reducer._rebuild_buckets()``, two
    broadcasts), or the buffer broadcast (``_distributed_broadcast_coalesced``). Read from the
    line ``_pre_forward`` is on, and DDP's ``process_group``; else ``None``."""
    code = frame.f_code
    if code.co_name == "_pre_forward":
        if "_rebuild_buckets" not in linecache.getline(code.co_filename, frame.f_lineno):
            return None
        what = "DDP forward's bucket rebuild"
        group = getattr(frame.f_locals.get("self"), "process_group", None)
    elif code.co_name == "_distributed_broadcast_coalesced":
        what = "DDP forward's buffer broadcast"
        group = getattr(frame.f_locals.get("self"), "process_group", None)
    else:
        return None
    if not isinstance(group, dist.ProcessGroup):
        return None
    return Position(
        COLLECTIVE,
        "broadcast",
        group=group.group_name,
        ranks=tuple(dist.get_process_group_ranks(group)),
        seq=sequence_number(group),
        site=user_site(frame),
        via=_via(frame),
        outer_op=what,
    )


def collective_in_traceback(exc: BaseException) -> str:
    """``"all_reduce of float32 (8,) at train.py:13"`` when ``exc`` was raised inside a
    torch.distributed function (its innermost one), else ``""``."""
    tb, frame = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == _C10D and not code.co_name.startswith("_"):
            frame = tb.tb_frame
        tb = tb.tb_next
    if frame is None:
        return ""
    local = frame.f_locals
    tensor = describe_tensor(next((local[k] for k in _TENSOR_ARGS if k in local), None))
    of = f" of {tensor}" if tensor else ""
    return f"{frame.f_code.co_name}{of} at {user_site(frame) or '?'}"


def sequence_number(group: Any) -> int | None:
    """How many collectives ``group`` has issued on this rank, or ``None``.

    torch has no public accessor for it: ``ProcessGroup._get_sequence_number_for_group`` is
    what its own c10d logger and debug wrapper read. Guarded, so a torch without it only loses
    the sequence check (ranks then compare by operation and group).
    """
    getter = getattr(group, "_get_sequence_number_for_group", None)
    try:
        return int(getter()) if getter is not None else None
    except Exception:  # a destroyed group, a backend that does not count
        return None


def describe_tensor(value: Any) -> str:
    """``"float32 (4,)"``; a list of tensors as ``"2 x float32 (4,)"``; ``""`` otherwise."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return f"{len(value)} x {describe_tensor(value[0])}"
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')} {tuple(value.shape)}"
    return ""


def _is_library(filename: str) -> bool:
    if filename.startswith((_TORCH_DIR, _DDPKIT_DIR, "<frozen")):
        return True
    return filename.startswith(_STDLIB_DIR) and "-packages" + os.sep not in filename


def user_site(frame: FrameType | None) -> str:
    """``file:line`` of the first frame outward that is not torch, ddpkit or the standard
    library; without one (ddpkit's own jobs), the first one outside torch."""
    fallback = ""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            return f"{short_path(filename)}:{frame.f_lineno}"
        if not fallback and not filename.startswith((_TORCH_DIR, _STDLIB_DIR, "<frozen")):
            fallback = f"{short_path(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback


def _via(frame: FrameType | None) -> str:
    """The outermost ddpkit function below the user's code (``"evaluate"``), or ``""``; a
    closure (a decorator's wrapper such as ``live_guarded``'s) is not a name to show."""
    found = ""
    while frame is not None:
        filename = frame.f_code.co_filename
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        if filename.startswith(_DDPKIT_DIR) and "<locals>" not in name:
            found = name
        elif not _is_library(filename):
            break
        frame = frame.f_back
    return found


def _outermost_torch_distributed(frame: FrameType) -> str:
    name = frame.f_code.co_name
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.startswith(_TORCH_DIR):
        if caller.f_code.co_filename == _C10D and not caller.f_code.co_name.startswith("_"):
            name = caller.f_code.co_name
        caller = caller.f_back
    return name


def short_path(filename: str) -> str:
    """A path relative to the working folder when inside it, else as it is."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative
