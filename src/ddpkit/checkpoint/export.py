"""One plain state-dict file from a checkpoint, for inference: ``ddpkit checkpoint export``.

    ddpkit checkpoint export runs/mnist/checkpoints/step-00000120 --output model.pt
    python -c "import torch; net.load_state_dict(torch.load('model.pt'))"   # any nn.Module

Every file the manifest lists is checked against its SHA-256 first. A sharded model (``fsdp``)
is read from the DCP shards, in this one process and without a process group (each tensor
assembled from its shards at its full shape, as torch's ``dcp_to_torch_save`` does, but only
the entry asked for: no optimizer state in memory); an unsharded one (``ddp``, ``zero1``,
``single``) is taken from ``state.pt``. The output holds ``{parameter name: tensor}`` on CPU,
without ``module.``/``_orig_mod.`` prefixes, written atomically (a temporary file, then one
rename).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.io import load_checkpoint, read_manifest
from ddpkit.checkpoint.sharded import load_in_this_process, metadata_template, safe_reader
from ddpkit.checkpoint.state import strip_wrapper_prefixes
from ddpkit.errors import DataError


def read_sharded_entry(folder: Path, name: str, *, unsafe_pickle: bool = False) -> Any:
    """The whole saved state of one sharded entry, read in this process (no process group):
    an FSDP model's full state dict, an FSDP optimizer's (parameter names as keys), a ZeRO
    optimizer's consolidated ``{"state": {index: ...}, "param_groups": [...]}``. Not a
    collective. Checksums are not checked here (:func:`export_model` checks them).

    Raises:
        DataError: ``name`` is not a sharded entry of the checkpoint.
    """
    layout = read_manifest(folder).get("sharded", {})
    if name not in layout:
        raise DataError(
            f"checkpoint {folder} has no sharded state[{name!r}] (sharded: "
            f"{sorted(layout) or 'none'})."
        )
    reader, planner = safe_reader(folder, unsafe_pickle)
    template = metadata_template(reader.read_metadata(), lambda path: path[0] == name)
    load_in_this_process(template, reader, planner)
    entry = template[name]
    if layout[name] == "zero_optimizer":
        entry["state"] = {int(i): value for i, value in entry.get("state", {}).items()}
    return entry


def export_model(
    folder: Path,
    output: Path,
    *,
    entry: str = "model",
    unsafe_pickle: bool = False,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``state[entry]`` of checkpoint ``folder`` as one plain state dict to ``output``.

    Not a collective: run it in one process (``ddpkit checkpoint export``).

    Args:
        folder: a complete ``step-XXXXXXXX`` folder (sharded or not).
        output: the ``.pt`` file to write (its folder must exist).
        entry: the name the model was checkpointed under (``state={"model": model, ...}``).
        unsafe_pickle: unpickle any object (runs whatever code the files hold); default: only
            the allow-list of :mod:`ddpkit.security.safe_load`.
        state: ``load_checkpoint(folder)`` when the caller has it already (read once).

    Returns:
        ``{"entry", "source" ("dcp" or "state.pt"), "num_tensors", "num_elements", "bytes"}``.

    Raises:
        DataError: the checkpoint is incomplete or corrupt (a checksum differs), or it holds no
            ``entry``, or ``entry`` is not a model's state dict (tensors by name).
    """
    if state is None:
        state = load_checkpoint(folder, unsafe_pickle=unsafe_pickle)  # checks every file
    sharded = read_manifest(folder).get("sharded", {})
    if sharded.get(entry) == "fsdp_model":
        model_state = read_sharded_entry(folder, entry, unsafe_pickle=unsafe_pickle)
        source = "dcp"
    else:
        saved = state.get("state", {})
        if entry not in saved:
            raise DataError(
                f"checkpoint {folder} holds no state[{entry!r}] (it holds "
                f"{sorted(set(saved) | set(sharded)) or 'none'}). Pass --entry NAME, the name "
                "the model was checkpointed under."
            )
        model_state, source = saved[entry], "state.pt"
    if not isinstance(model_state, dict) or not all(
        isinstance(v, torch.Tensor) for v in model_state.values()
    ):
        raise DataError(
            f"checkpoint {folder}: state[{entry!r}] is not a model's state dict (tensors by "
            f"name). Pass --entry with the model's name (it holds {sorted(state['state'])})."
        )
    model_state = strip_wrapper_prefixes(dict(model_state))
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        torch.save(model_state, tmp)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return {
        "entry": entry,
        "source": source,
        "num_tensors": len(model_state),
        "num_elements": sum(t.numel() for t in model_state.values()),
        "bytes": sum(t.numel() * t.element_size() for t in model_state.values()),
    }
