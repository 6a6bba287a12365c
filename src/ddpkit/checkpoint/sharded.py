"""Sharded checkpoints: every rank writes its own shard through ``torch.distributed.checkpoint``.

Which state is sharded (the layouts of ``LAYOUTS``, recorded per name in the manifest's
``sharded``):

- ``fsdp_model``, ``fsdp_optimizer``: an FSDP model and the optimizer over its shards, as
  torch's ``get_state_dict(model, optimizer)`` gives them (``DTensor`` shards keyed by
  parameter name);
- ``zero_optimizer``: a ``ZeroRedundancyOptimizer``: each rank's optimizer state for the
  parameters it owns, keyed by the parameter's global index (every key on exactly one rank),
  plus the parameter groups; never consolidated on one rank.

Everything else (the replicated state: a DDP model, the scheduler, the scaler, the loader
position, every rank's RNG states, ...) keeps the single-writer path of
:class:`~ddpkit.CheckpointManager`: compared across ranks, then written by rank 0 to
``state.pt``.

One save, in order (:func:`save_sharded`; collective):

1. one all-gather: RNG states, checksums of the replicated state, rank 0's pid (which names the
   shared temporary folder ``.tmp-step-XXXXXXXX-<pid>``); parameters that differ refuse the save;
2. rank 0 creates the temporary folder (one all-gather: did it?);
3. ``torch.distributed.checkpoint.save`` into ``<tmp>/dcp``: each rank writes its file
   ``__<rank>_0.distcp`` in parallel (fsynced), rank 0 the ``.metadata`` (torch's own
   collectives: plans gathered, results gathered, any rank's exception raised on every rank);
   the replicated copies DCP finds on several ranks are written from the lowest rank;
4. each rank hashes its own files; one all-gather brings the hashes (and any error) to rank 0;
5. rank 0 writes ``state.pt`` and the manifest (SHA-256 of every file), renames the folder to
   ``step-XXXXXXXX`` and prunes; one all-reduce tells every rank it is complete.

A failure on any rank at any point leaves no ``step-`` folder: only the ``.tmp-`` one, removed
by rank 0 when it can, else by the next save. The folder must be on a filesystem every rank
sees (as for any ddpkit checkpoint).

A resume (:func:`load_sharded`) gives each rank its shards of the *current* layout:
``torch.distributed.checkpoint.load`` reshards a checkpoint written on N ranks for M ranks
(FSDP's ``DTensor`` shards from the global metadata; a ZeRO rank reads the state of the
parameters it owns in the new partition). At world size 1 (no process group) the same files
load into a plain model and optimizer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.checkpoint.io import (
    checkpoint_dir_name,
    commit_checkpoint,
    sha256_file,
    temporary_dir,
)
from ddpkit.diagnostics.disk import disk_full_explained
from ddpkit.errors import ConfigError, DistributedError
from ddpkit.parallel.fsdp import is_fsdp, is_sharded_tensor
from ddpkit.parallel.wrap import unwrap_model
from ddpkit.parallel.zero import is_zero_optimizer
from ddpkit.runtime.collectives import all_gather_object
from ddpkit.runtime.process_group import Runtime

SHARDED_DIR = "dcp"  # the DCP files, inside the step folder
LAYOUTS = ("fsdp_model", "fsdp_optimizer", "zero_optimizer")


def _fsdp_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) and any(
        is_sharded_tensor(p) for group in obj.param_groups for p in group["params"]
    )


def sharded_entries(state: Mapping[str, Any], runtime: Runtime) -> dict[str, str]:
    """``{name: layout}`` of the managed state saved through DCP (none at world size 1).

    Raises:
        ConfigError: optimizers over FSDP shards without exactly one FSDP model in the state, or
            more than one such optimizer (one ``get_state_dict(model, optimizer)`` each).
    """
    if runtime.process_group is None:
        return {}
    entries = {}
    for name, obj in state.items():
        if isinstance(obj, nn.Module) and is_fsdp(unwrap_model(obj)):
            entries[name] = "fsdp_model"
        elif is_zero_optimizer(obj):
            entries[name] = "zero_optimizer"
        elif _fsdp_optimizer(obj):
            entries[name] = "fsdp_optimizer"
    models = [n for n, kind in entries.items() if kind == "fsdp_model"]
    optimizers = [n for n, kind in entries.items() if kind == "fsdp_optimizer"]
    if optimizers and (len(models) != 1 or len(optimizers) > 1):
        raise ConfigError(
            f"sharded checkpoint: state holds FSDP model(s) {models} and optimizer(s) over FSDP "
            f"shards {optimizers}. A checkpoint takes one FSDP model and at most one optimizer "
            "over its parameters. Put other models' state in a separate CheckpointManager."
        )
    return entries


def _fsdp_pair(entries: dict[str, str]) -> tuple[str | None, str | None]:
    """The names of the FSDP model and of its optimizer (``None`` where absent)."""
    model = next((n for n, kind in entries.items() if kind == "fsdp_model"), None)
    optimizer = next((n for n, kind in entries.items() if kind == "fsdp_optimizer"), None)
    return model, optimizer


def _parameter_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``{id(param): global index}`` over the optimizer's parameter groups (torch's order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


def _param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The groups as ``Optimizer.state_dict()`` writes them: hyperparameters, global indices."""
    index = _parameter_index(optimizer)
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [index[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]


def zero_shard_state(optimizer: Any) -> dict[str, Any]:
    """This rank's part of a ``ZeroRedundancyOptimizer``: ``{"state": {str(global index):
    {name: value}}, "param_groups": [...]}`` for the parameters it owns (its local optimizer,
    ``optimizer.optim``, holds exactly those)."""
    index = _parameter_index(optimizer)
    owned = {str(index[id(p)]): dict(s) for p, s in optimizer.optim.state.items()}
    return {"state": owned, "param_groups": _param_groups(optimizer)}


def sharded_state(state: Mapping[str, Any], entries: dict[str, str]) -> dict[str, Any]:
    """What DCP saves: ``{name: state dict}`` for every sharded entry."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, Any] = {}
    model, optimizer = _fsdp_pair(entries)
    if model is not None:
        optimizers = [state[optimizer]] if optimizer else []
        out[model], optim_state = get_state_dict(unwrap_model(state[model]), optimizers)
        if optimizer:
            out[optimizer] = optim_state
    for name in (n for n, kind in entries.items() if kind == "zero_optimizer"):
        out[name] = zero_shard_state(state[name])
    return out


def _own_files(dcp_dir: Path, rank: int) -> dict[str, str]:
    """SHA-256 of the DCP files this rank wrote (``__<rank>_*``; rank 0: the metadata too)."""
    names = sorted(p.name for p in dcp_dir.glob(f"__{rank}_*"))
    if rank == 0:
        names.append(".metadata")
    return {f"{SHARDED_DIR}/{n}": sha256_file(dcp_dir / n) for n in names}


def raise_if_any(results: list[dict], step: int, what: str) -> None:
    """Raise on every rank when some rank reported an error (the same decision everywhere).

    Raises:
        DistributedError: names each failed rank and its error.
    """
    failed: dict[str, list[int]] = {}  # one error seen by several ranks (DCP's) said once
    for rank, result in enumerate(results):
        if result.get("error"):
            failed.setdefault(result["error"], []).append(rank)
    if failed:
        listing = "; ".join(
            f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {error}"
            for error, ranks in failed.items()
        )
        raise DistributedError(
            f"sharded checkpoint step {step} not written: {what} failed ({listing}). No "
            "complete step folder was left behind; resume falls back to the previous one."
        )


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]


@contextlib.contextmanager
def removed_on_failure(runtime: Runtime, tmp: Path) -> Iterator[None]:
    """Rank 0 removes the shared temporary folder ``tmp`` when anything escapes the block (a
    collective that fails because a peer died, a second stop signal), then re-raises."""
    try:
        yield
    except BaseException:
        if runtime.is_rank_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_folder(runtime: Runtime, tmp: Path, step: int) -> None:
    """Rank 0 creates the shared temporary folder ``tmp/dcp``; every rank learns whether it
    could. Collective (one all-gather).

    Raises:
        DistributedError: rank 0 could not create it (on every rank).
    """
    error = None
    if runtime.is_rank_zero:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / SHARDED_DIR).mkdir(parents=True)
        except OSError as exc:
            error = error_text(exc)
    raise_if_any(all_gather_object({"error": error}, runtime), step, "creating the folder")


def gather_hashes(runtime: Runtime, tmp: Path, step: int, error: str | None) -> dict[str, str]:
    """Each rank's SHA-256 of its own DCP files (or its ``error``), brought to every rank;
    returns them all. Collective (one all-gather).

    Raises:
        DistributedError: a rank failed (named); ``tmp`` is removed by rank 0.
    """
    hashes = {}
    if error is None:
        try:
            hashes = _own_files(tmp / SHARDED_DIR, runtime.rank)
        except OSError as exc:
            error = error_text(exc)
    results = all_gather_object({"error": error, "hashes": hashes}, runtime)
    try:
        raise_if_any(results, step, "writing the shards")
    except DistributedError:
        if runtime.is_rank_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {name: digest for res in results for name, digest in res["hashes"].items()}


def shard_writer(tmp: Path) -> tuple[Any, Any]:
    """``(storage_writer, planner)`` of a shard save into ``tmp/dcp``: torch's file-system
    writer (one file per rank, fsynced) and its default planner, with the copies it finds on
    several ranks written from the lowest rank (rank 0's buffers, as evaluation uses)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = dcp.FileSystemWriter(tmp / SHARDED_DIR)
    return writer, DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def write_shards(
    runtime: Runtime, tmp: Path, state: Mapping[str, Any], entries: dict[str, str], step: int
) -> dict[str, str]:
    """Steps 2-4 of the module docstring: every rank's DCP shard into ``tmp/dcp``; returns the
    SHA-256 of every file written, on every rank. Collective.

    Raises:
        DistributedError: a rank failed (named); ``tmp`` is removed by rank 0.
    """
    import torch.distributed.checkpoint as dcp

    prepare_folder(runtime, tmp, step)
    error, what = None, f"the shards of checkpoint {checkpoint_dir_name(step)}"
    try:
        writer, planner = shard_writer(tmp)
        watch = runtime.watch("torch.distributed.checkpoint.save")
        # DCP's CheckpointException is no Exception: a full disk becomes ddpkit's one line
        with watch, disk_full_explained(tmp.parent, what):
            dcp.save(
                sharded_state(state, entries),
                storage_writer=writer,
                planner=planner,
                process_group=runtime.process_group,
            )
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = error_text(exc)
    return gather_hashes(runtime, tmp, step, error)


def save_sharded(
    runtime: Runtime,
    directory: Path,
    state: Mapping[str, Any],
    entries: dict[str, str],
    step: int,
    *,
    replicated: Callable[[], dict[str, Any]],
    meta: dict[str, Any],
    prune: Callable[[], None],
) -> Path:
    """Write checkpoint ``step``: the ``entries`` of ``state`` through DCP, ``replicated()``
    (called on rank 0 only: the single-writer state, RNG per rank, the other objects' state
    dicts) to ``state.pt``, ``meta`` into the manifest; then ``prune()`` on rank 0.

    Collective: call on every rank (see the module docstring for the collectives).

    Raises:
        DistributedError: a rank failed to write (every rank raises, naming it).
    """
    pid = all_gather_object(os.getpid(), runtime)[0]
    tmp = temporary_dir(directory, step, pid)
    with removed_on_failure(runtime, tmp):
        files = write_shards(runtime, tmp, state, entries, step)
        error, folder = None, directory / checkpoint_dir_name(step)
        if runtime.is_rank_zero:
            try:
                saved = {**replicated(), "sharded": dict(entries)}
                saved.update(step=step, world_size=runtime.world_size, extra=meta.get("extra"))
                folder = commit_checkpoint(
                    tmp, directory, step, saved, {**meta, "sharded": dict(entries)}, files
                )
                prune()
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                shutil.rmtree(tmp, ignore_errors=True)
                error = error_text(exc)
        raise_if_any(all_gather_object({"error": error}, runtime), step, "rank 0's commit")
    return folder


_ONE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"  # torch 2.13


# ---- loading -----------------------------------------------------------------------------------


def _set_path(tree: dict, path: tuple, value: Any) -> None:
    """Put ``value`` at ``path`` in nested dicts; an int element makes a list there."""
    node: Any = tree
    for key, following in zip(path[:-1], path[1:], strict=True):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            node[key] = node[key] if node[key] is not None else empty
            node = node[key]
        else:
            node = node.setdefault(key, empty)
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def metadata_template(metadata: Any, keep: Any) -> dict[str, Any]:
    """Empty tensors (shape and dtype from the DCP metadata) at every saved path ``keep(path)``
    accepts; ``None`` where a non-tensor value was saved. What ``dcp.load`` fills in."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tree: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        path = tuple(metadata.planner_data[fqn])
        if not keep(path):
            continue
        if isinstance(item, TensorStorageMetadata):
            value: Any = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            value = None
        _set_path(tree, path, value)
    return tree


def _owned_indices(optimizer: Any) -> set[int]:
    """The global parameter indices whose state this rank keeps (all, for a plain optimizer)."""
    index = _parameter_index(optimizer)
    if not is_zero_optimizer(optimizer):
        return set(index.values())
    return {index[id(p)] for group in optimizer.optim.param_groups for p in group["params"]}


def _zero_template(metadata: Any, name: str, optimizer: Any) -> dict[str, Any]:
    owned = {str(i) for i in _owned_indices(optimizer)}

    def keep(path: tuple) -> bool:
        return path[0] == name and path[1] == "state" and path[2] in owned

    state = metadata_template(metadata, keep).get(name, {}).get("state", {})
    return {"state": state, "param_groups": _param_groups(optimizer)}


def _load_zero(optimizer: Any, loaded: dict[str, Any]) -> None:
    state = {int(index): value for index, value in loaded["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": loaded["param_groups"]})


def layout_of(obj: Any) -> str:
    """What a resume loads ``obj`` as: ``"fsdp_model"``, ``"module"``, ``"zero_optimizer"``,
    ``"fsdp_optimizer"`` or ``"other"`` (any other object with a state dict)."""
    if isinstance(obj, nn.Module):
        return "fsdp_model" if is_fsdp(unwrap_model(obj)) else "module"
    if is_zero_optimizer(obj):
        return "zero_optimizer"
    return "fsdp_optimizer" if _fsdp_optimizer(obj) else "other"


def layout_refusal(folder: Path, name: str, saved: str | None, job: str, what: str) -> str | None:
    """Why entry ``name`` saved as ``saved`` (``None``: unsharded, in ``state.pt``) cannot
    resume into an object of layout ``job`` (see :func:`layout_of`; ``what`` names it in the
    message), else ``None``. A ZeRO optimizer may take a consolidated state, as written before
    ddpkit sharded it; an FSDP model or optimizer never takes an unsharded one."""
    if saved is None:
        wrong, saved = job in ("fsdp_model", "fsdp_optimizer"), "unsharded (state.pt)"
    elif saved == "fsdp_model":
        wrong = job not in ("fsdp_model", "module")
    else:
        wrong = job in ("fsdp_model", "module") or (
            saved == "fsdp_optimizer" and job == "zero_optimizer"
        )
    if not wrong:
        return None
    return (
        f"checkpoint {folder} holds state[{name!r}] as {saved}; this job's state[{name!r}] is "
        f"{what}. Resume with the strategy it was saved with, or export the weights (ddpkit "
        "checkpoint export) and start fresh."
    )


def check_layouts(
    folder: Path, state: Mapping[str, Any], saved: dict[str, str], unsharded: set[str]
) -> None:
    """Before a resume loads anything: each sharded entry goes into an object of its kind,
    and no FSDP object is given state saved unsharded (``unsharded``: the names in
    ``state.pt``); the rule is :func:`layout_refusal`'s.

    Raises:
        ConfigError: names the entry, what was saved and what this job holds, and the fix.
    """
    for name, obj in state.items():
        if name not in saved and name not in unsharded:
            continue
        what = f"a {type(obj).__name__}"
        problem = layout_refusal(folder, name, saved.get(name), layout_of(obj), what)
        if problem:
            raise ConfigError(problem)


def load_in_this_process(template: dict[str, Any], reader: Any, planner: Any = None) -> None:
    """``dcp.load`` into ``template`` in this process alone (world size 1, an export), without
    torch's ``UserWarning`` that it assumes one process is meant: it is. Not a collective."""
    import torch.distributed.checkpoint as dcp

    from ddpkit.security.safe_dcp import refusals_unwrapped

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING, category=UserWarning)
        with refusals_unwrapped():
            dcp.load(template, storage_reader=reader, planner=planner, no_dist=True)


def safe_reader(folder: Path, unsafe_pickle: bool = False) -> tuple[Any, Any]:
    """``(storage reader, load planner)`` for ``folder``'s DCP files: torch's own with
    ``unsafe_pickle``, else ones that unpickle only allowed types
    (:mod:`ddpkit.security.safe_load`)."""
    import torch.distributed.checkpoint as dcp

    from ddpkit.security.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    if unsafe_pickle:
        return dcp.FileSystemReader(folder / SHARDED_DIR), None
    return SafeFileSystemReader(folder / SHARDED_DIR), SafeLoadPlanner()


def load_sharded(
    runtime: Runtime,
    folder: Path,
    state: Mapping[str, Any],
    saved: dict[str, str],
    unsafe_pickle: bool = False,
) -> None:
    """Restore the entries ``saved`` (``{name: layout}``) from ``folder/dcp`` into ``state``,
    resharded for this world size. Collective: call on every rank (``dcp.load``); at world size
    1 no collective runs.

    Raises:
        DataError: the checkpoint's DCP files cannot be read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ddpkit.security.safe_dcp import refusals_unwrapped

    reader, planner = safe_reader(folder, unsafe_pickle)
    metadata = reader.read_metadata()
    template: dict[str, Any] = {}
    model_name, optim_name = _fsdp_pair({n: k for n, k in saved.items() if n in state})
    if model_name is not None:
        model = unwrap_model(state[model_name])
        optimizers = [state[optim_name]] if optim_name else []
        template[model_name], optim_state = get_state_dict(model, optimizers)
        if optim_name:
            template[optim_name] = optim_state
    zero = [n for n, kind in saved.items() if kind == "zero_optimizer" and n in state]
    for name in zero:
        template[name] = _zero_template(metadata, name, state[name])
    if runtime.process_group is None:
        load_in_this_process(template, reader, planner)
    else:
        with runtime.watch("torch.distributed.checkpoint.load"), refusals_unwrapped():
            dcp.load(
                template,
                storage_reader=reader,
                planner=planner,
                process_group=runtime.process_group,
            )
    if model_name is not None:
        set_state_dict(
            model,
            optimizers,
            model_state_dict=template[model_name],
            optim_state_dict=template[optim_name] if optim_name else {},
        )
    for name in zero:
        _load_zero(state[name], template[name])
