"""Replicated state compared across ranks at save time, so "rank 0's copy silently wins" is said.

Rank 0 alone writes a checkpoint of replicated state. That is right only while every rank holds
the same state; when one does not, the others' copies are dropped without a word, and a resume
gives every rank rank 0's. So each save compares, across ranks, exact checksums
(:func:`ddpkit.guards.replicas.tensor_digests` for tensors, CRC-32 of the value for numbers and
strings) of:

- ``<name> parameters`` of every ``nn.Module`` in the manager's state (the model, an
  ``AveragedModel``): DDP keeps them bitwise identical; a difference is a bug, and the save is
  refused on every rank (:class:`ReplicaDivergenceError`) before anything is written. Not for
  an FSDP model, whose parameters are shards (its buffers are compared);
- ``<name> buffers`` that DDP does not overwrite with rank 0's at the next forward (only with
  ``broadcast_buffers=False``; synced ones differ between forwards by design);
- every other entry, ``state['<name>']`` (optimizer, scheduler, scaler, an EMA, ...), except a
  ``ZeroRedundancyOptimizer`` or an optimizer over FSDP's shards (their state is sharded) and
  keys named like a synced buffer
  (``AveragedModel`` copies or averages them: they differ too).

A difference in these is reported in one warning naming the state, its keys and the ranks, and
recorded in the checkpoint's manifest (``differs_across_ranks``); rank 0's copy is saved.
Not compared: the loader position (the step, equal by construction) and the RNG states, which
are per rank and saved for every rank. The checksums travel in the all-gather that already
collects every rank's RNG state: no extra collective.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ddpkit.checkpoint.objects import is_zero_optimizer
from ddpkit.data.sampler import ShardedLoader
from ddpkit.guards.replicas import ReplicaDivergenceError, synced_buffers, tensor_digests
from ddpkit.parallel.fsdp import is_fsdp, is_sharded_tensor
from ddpkit.parallel.wrap import unwrap_model

PARAMETERS_OF = "parameters"  # section "<name> parameters" of each nn.Module in the state
BUFFERS_OF = "buffers"
_PLAIN = (int, float, str, bool, bytes, type(None))

Digests = dict[str, dict[str, tuple]]


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, leaf)`` for every leaf of nested dicts, lists and tuples."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}.{index}" if path else str(index))
    else:
        yield path, value


def digest_tree(tree: Any) -> dict[str, tuple]:
    """``{dotted path: checksum}`` of a (nested) state dict: tensors by content, dtype and
    shape; numbers and strings by value; any other object by its type only."""
    leaves = list(_leaves(tree))
    tensors = [(p, v) for p, v in leaves if isinstance(v, torch.Tensor)]
    rows = tensor_digests([v for _, v in tensors]).tolist()
    out = {
        p: (str(v.dtype), tuple(v.shape), *row) for (p, v), row in zip(tensors, rows, strict=True)
    }
    for path, value in leaves:
        if not isinstance(value, torch.Tensor):
            text = repr(value) if isinstance(value, _PLAIN) else type(value).__qualname__
            out[path] = (zlib.crc32(text.encode()),)
    return out


def replicated_digests(state: Mapping[str, Any]) -> Digests:
    """This rank's checksums of the replicated state, by section (see the module docstring).

    Args:
        state: the manager's ``{name: object}``. An ``nn.Module`` gives two sections,
            ``"<name> parameters"`` and ``"<name> buffers"`` (without the buffers DDP
            broadcasts); any other object one, ``"state['<name>']"``, from its ``state_dict()``.
            Left out: a ``ZeroRedundancyOptimizer`` (sharded: one part per rank) and a
            :class:`~ddpkit.ShardedLoader` (its position is the step, equal by construction).
    """
    modules = {n: o for n, o in state.items() if isinstance(o, torch.nn.Module)}
    synced: set[str] = set()
    digests: Digests = {}
    for name, module in modules.items():
        inner, skipped = unwrap_model(module), synced_buffers(module)
        synced |= {n for n, b in inner.named_buffers() if id(b) in skipped}
        if not is_fsdp(inner):  # FSDP parameters are shards: different on every rank
            digests[f"{name} {PARAMETERS_OF}"] = digest_tree(dict(inner.named_parameters()))
        digests[f"{name} {BUFFERS_OF}"] = digest_tree(
            {n: b for n, b in inner.named_buffers() if id(b) not in skipped}
        )
    copies = [f"{name} {BUFFERS_OF}" for name in modules]  # an EMA module's buffers, ...
    for name, obj in state.items():
        if name not in modules and not _per_rank(obj):
            digests[section_name(name)] = digest_tree(obj.state_dict())
            if not isinstance(obj, torch.optim.Optimizer):
                copies.append(section_name(name))
    for section in copies if synced else ():  # copies of DDP-synced buffers differ by design
        tree = digests[section]
        digests[section] = {k: v for k, v in tree.items() if not _copies_synced(k, synced)}
    return digests


def section_name(name: str) -> str:
    """How a non-module entry of the manager's state is named in warnings and the manifest."""
    return f"state[{name!r}]"


def _per_rank(obj: Any) -> bool:
    """State that is not replicated: a ZeRO optimizer's shard, an optimizer over FSDP's
    sharded parameters, the loader's position."""
    if isinstance(obj, torch.optim.Optimizer) and any(
        is_sharded_tensor(p) for group in obj.param_groups for p in group["params"]
    ):
        return True
    return is_zero_optimizer(obj) or isinstance(obj, ShardedLoader)


def _copies_synced(key: str, synced: set[str]) -> bool:
    """True for a key named like a DDP-synced buffer of a model (an EMA's
    ``module.1.running_mean``: a copy or average of buffers that differ by design)."""
    parts = key.split(".")
    return any(".".join(parts[i:]) in synced for i in range(len(parts)))


def differences(per_rank: list[Digests]) -> dict[str, dict[int, list[str]]]:
    """``{section: {rank: [keys that differ from rank 0's]}}`` for the sections that differ."""
    reference = per_rank[0]
    found: dict[str, dict[int, list[str]]] = {}
    for rank, digests in enumerate(per_rank[1:], start=1):
        for section in list(reference) + [s for s in digests if s not in reference]:
            ours, theirs = reference.get(section, {}), digests.get(section, {})
            keys = [k for k in {**ours, **theirs} if ours.get(k) != theirs.get(k)]
            if keys:
                found.setdefault(section, {})[rank] = keys
    return found


def _keys(by_rank: dict[int, list[str]], limit: int = 6) -> str:
    keys = list(dict.fromkeys(k for ks in by_rank.values() for k in ks))
    more = f", and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _ranks(by_rank: dict[int, list[str]]) -> str:
    return ", ".join(str(r) for r in by_rank)


def raise_if_parameters_differ(found: dict[str, dict[int, list[str]]], step: int) -> None:
    """Refuse the save on every rank when model parameters differ (the decision is the same
    everywhere: every rank compares the same gathered checksums).

    Raises:
        ReplicaDivergenceError: names each rank and its differing parameters.
    """
    sections = [s for s in found if s.endswith(f" {PARAMETERS_OF}")]
    if not sections:
        return
    listing = "; ".join(
        f"rank {r} differs in {', '.join(ks)}" for s in sections for r, ks in found[s].items()
    )
    raise ReplicaDivergenceError(
        f"checkpoint step {step} not written: {', '.join(sections)} differ across ranks: "
        f"{listing} "
        "(compared with rank 0). Saving rank 0's copy would hide that the replicas trained "
        "apart. Something changed one replica outside DDP (a rank-dependent update, a skipped "
        "all-reduce, a parameter changed on one rank); make every rank take the same steps."
    )


def describe(
    found: dict[str, dict[int, list[str]]], folder_name: str, notes: Mapping[str, str]
) -> str:
    """One warning naming every differing section, its keys and ranks, and the fix.

    ``notes`` gives the explanation for a section (model buffers: the buffer fix; a local-SGD
    optimizer: why its state is per rank); other sections get the generic one.
    """
    parts = [
        f"{s} {'differs' if s.startswith('state[') else 'differ'} on rank(s) {_ranks(r)} "
        f"({_keys(r)})"
        for s, r in found.items()
    ]
    fixes = list(dict.fromkeys(notes[s] for s in found if s in notes))
    if set(found) - set(notes):
        fixes.append(
            "State every rank must hold the same was changed on some ranks only (updated on one "
            "rank, or from rank-local data): update it identically on every rank, or keep it on "
            "one rank and save it yourself."
        )
    return (
        f"checkpoint {folder_name}: replicated state differs across ranks: {'; '.join(parts)}; "
        f"rank 0's copy was saved and a resume gives it to every rank. {' '.join(fixes)}"
    )
