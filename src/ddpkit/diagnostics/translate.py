"""One line with the fix for the classic failures of distributed training.

ddpkit raises its own clear errors where it owns the call (the store, the rendezvous, the backend,
wrapping a model twice, the non-finite guard). :func:`explain` covers errors that torch raises
from the user's own code: ``ddpkit run``'s worker bootstrap prints its line under the traceback
and puts it in the launcher's closing summary.
"""

from __future__ import annotations

import multiprocessing
import re

import torch

from ddpkit.errors import ConfigError, DiskFullError, add_note

# (text found in the exception message, or a pattern whose groups fill {0}..; the explanation
# and fix)
_KNOWN: tuple[tuple[str | re.Pattern[str], str], ...] = (
    (
        "Default process group has not been initialized",
        "torch.distributed was used before the process group exists: call "
        "ddpkit.init_runtime() (or torch.distributed.init_process_group) first, on every rank, "
        "before DistributedDataParallel, DistributedSampler or any collective.",
    ),
    (
        "Cannot re-initialize CUDA in forked subprocess",
        "CUDA was initialised in the parent before it forked this worker; forked children "
        "cannot use CUDA. Start workers with the 'spawn' start method (ddpkit run / torchrun "
        "do), or move every CUDA call into the worker.",
    ),
    (
        "Distributed package doesn't have NCCL built in",
        "backend nccl is not in this torch build (a CPU build). Use --backend gloo, or 'auto', "
        "which picks nccl only where it works.",
    ),
    (
        "ProcessGroupNCCL is only supported with GPUs",
        "backend nccl needs a CUDA device for each rank and none was found. Use --backend gloo "
        "(or 'auto') on CPU machines.",
    ),
    (
        "Torch not compiled with CUDA enabled",
        "a CUDA device was asked for, but this torch build has no CUDA. Use the CPU device and "
        "--backend gloo (or 'auto'), or install a CUDA build of torch.",
    ),
    (
        "Found no NVIDIA driver",
        "a CUDA device was asked for on a machine without an NVIDIA driver. Use the CPU device "
        "and --backend gloo (or 'auto').",
    ),
    (
        "Connection reset by peer",
        "a peer's process ended during this collective: it raised, crashed or was aborted. "
        "When gloo aborts a rank with 'Is there a distributed collective mismatch in your "
        "code?', the ranks called different collectives or passed tensors of different sizes "
        "there. The first failure in the other ranks' output is the cause.",
    ),
    (
        "Connection closed by peer",
        "a peer's process ended during this collective: it raised, crashed or was aborted. "
        "The first failure in the other ranks' output is the cause.",
    ),
    (
        re.compile(r"Timed out waiting (\d+)ms for (?:recv|send) operation"),
        "this collective waited {0} ms, the process group's timeout (init_runtime's "
        "train_timeout_s), for a peer that did not join it: a rank busy longer than that (a "
        "save or an evaluation on rank 0 only), or one waiting in a different collective. Run "
        "rank-0-only work under `with rt.main_process_first():` or on every rank, or raise "
        "train_timeout_s; keep stall_timeout_s below it, so the watchdog names the late rank "
        "first.",
    ),
    (
        "Expected to have finished reduction in the prior iteration",
        "some parameters got no gradient in the previous step, so DDP waited for them. If a "
        "branch is skipped on some steps, pass find_unused_parameters=True "
        "(--find-unused-parameters); if an output is returned but not used in the loss, use it "
        "or stop returning it; if parameters were frozen or replaced after wrapping, wrap the "
        "model again (ddpkit.wrap_model(ddpkit.unwrap_model(model), runtime)); a "
        "torch.utils.checkpoint(use_reentrant=True) segment whose inputs do not require grad "
        "gives its parameters no gradient: pass use_reentrant=False.",
    ),
    (
        "Expected to mark a variable ready only once",
        "DDP got a parameter's gradient twice in one backward. The usual cause is activation "
        "checkpointing with use_reentrant=True (torch.utils.checkpoint's old default): pass "
        "use_reentrant=False, or wrap with static_graph=True if the graph is the same every "
        "step. Another: a parameter used outside the wrapper's forward (model.module.f(x)) in "
        "the same loss: move that call into forward.",
    ),
    (
        re.compile(r"'DistributedDataParallel' object has no attribute '(\w+)'"),
        "DDP wraps your model: its own attributes and methods live on the module inside. Use "
        "ddpkit.unwrap_model(model).{0}, which works at every world size (at 1 process "
        "ddpkit.wrap_model returns the module itself, so model.{0} only fails once scaled out).",
    ),
    (
        "object has no attribute 'module'",
        "if this is the model from ddpkit.wrap_model: at world size 1 it returns the module "
        "itself (no DDP wrapper, so no .module). Use ddpkit.unwrap_model(model), which works at "
        "every world size.",
    ),
    (
        re.compile(r'Unexpected key\(s\) in state_dict: "module\.'),
        "the checkpoint's keys start with 'module.' (saved from the DDP wrapper), the model's do "
        "not (at world size 1 ddpkit.wrap_model returns the module itself). Save with "
        "ddpkit.model_state_dict(model) and load with ddpkit.load_model_state(model, state): "
        "the same keys at every world size; for this file, strip the prefix "
        "({{k.removeprefix('module.'): v for k, v in state.items()}}).",
    ),
    (
        re.compile(r'Missing key\(s\) in state_dict: "module\.'),
        "the model's keys start with 'module.' (a DDP wrapper), the checkpoint's do not (saved "
        "from the bare module, e.g. at world size 1). Load with ddpkit.load_model_state(model, "
        "state), or into ddpkit.unwrap_model(model); save with ddpkit.model_state_dict(model): "
        "the same keys at every world size.",
    ),
    (
        re.compile(r"No space left on device|Disk quota exceeded"),
        "the disk written to is full (or its quota used up). Check it with `df -h DIR` (`quota "
        "-s`); free space there, write to a disk with room, or keep fewer checkpoints "
        "(CheckpointManager keep_last).",
    ),
    (
        re.compile(
            r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed writing|file write failed"
            r"|basic_ios::clear: iostream error"
        ),
        "torch.save could not write the whole file; the usual cause is a full disk or a "
        "used-up quota. Check the folder it saves to with `df -h DIR`; free space there, save "
        "to a disk with room, or keep fewer checkpoints (CheckpointManager keep_last).",
    ),
    (
        "Expected more than 1 value per channel when training",
        "a batch of 1 sample reached BatchNorm in training mode: after sharding, a rank's last "
        "batch can hold a single sample even when the whole dataset's does not. Pass "
        "drop_last=True to ddpkit.build_train_loader (or your DataLoader), or use SyncBatchNorm "
        "(ddpkit.wrap_model(..., sync_batchnorm=True)) so statistics span every rank's samples.",
    ),
)


def explain(exc: BaseException) -> str | None:
    """The explanation and fix for a known distributed-training failure, else ``None``.

    Looks at ``exc`` and the exceptions it was raised from (``__cause__``/``__context__``).

    Example:
        >>> explain(ValueError("Default process group has not been initialized, ..."))[:32]
        'torch.distributed was used befor'
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, DiskFullError):  # it names the disk and the fix itself
            return None
        seen.add(id(current))
        text = str(current)
        for needle, explanation in _KNOWN:
            if isinstance(needle, str) and needle in text:
                return explanation
            match = needle.search(text) if isinstance(needle, re.Pattern) else None
            if match:
                return explanation.format(*match.groups())
        current = current.__cause__ or current.__context__
    return None


HINT_PREFIX = "ddpkit hint: "


def add_hint_note(exc: BaseException) -> None:
    """Attach :func:`explain`'s line to ``exc`` as a note (shown under its traceback), once.

    :class:`~ddpkit.Runtime` does this for an exception leaving its ``with`` block, so the hint
    appears under plain ``torchrun`` too, not only in ``ddpkit run``'s summary.
    """
    hint = explain(exc)
    notes = getattr(exc, "__notes__", [])
    if hint and not any(note.startswith(HINT_PREFIX) for note in notes):
        add_note(exc, HINT_PREFIX + hint)


def check_start_method(start_method: str) -> None:
    """Refuse to fork workers from a process that has already initialised CUDA.

    A forked child inherits a CUDA context it cannot use: its first CUDA call fails with
    "Cannot re-initialize CUDA in forked subprocess", or it hangs. ``spawn`` and ``forkserver``
    start a fresh interpreter and are always safe.

    Raises:
        ConfigError: ``start_method`` is ``"fork"`` and CUDA is initialised in this process; or
            ``start_method`` is not one this platform offers.
    """
    allowed = multiprocessing.get_all_start_methods()
    if start_method not in allowed:
        raise ConfigError(
            f"unknown start method: start_method={start_method!r}. Allowed here: "
            f"{', '.join(allowed)}."
        )
    if start_method == "fork" and torch.cuda.is_initialized():
        raise ConfigError(
            "refusing to fork workers: CUDA is already initialised in this process, and forked "
            "children cannot use it ('Cannot re-initialize CUDA in forked subprocess'). Use "
            "start_method='spawn', or move every CUDA call into the workers."
        )
