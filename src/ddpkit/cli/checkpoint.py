"""``ddpkit checkpoint export``: one plain state-dict file from a checkpoint, for inference.

    ddpkit checkpoint export runs/mnist/checkpoints/step-00000120 --output model.pt
    ddpkit checkpoint export runs/mnist/checkpoints --output model.pt   # the newest complete one

Works for every checkpoint ddpkit writes: sharded (``--strategy fsdp``: the model is assembled
from every rank's DCP shard, in this one process) or not (``ddp``, ``zero1``, one process).
Every file is checked against the manifest's SHA-256 first. The output loads into the plain
module: ``net.load_state_dict(torch.load("model.pt"))``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddpkit.errors import ConfigError, DataError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ddpkit.cli.bench import plain_text

    parser = subparsers.add_parser(
        "checkpoint",
        help="export a checkpoint's model as one plain state-dict file",
        description=plain_text(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(
        dest="action", required=True, parser_class=type(parser), metavar="ACTION"
    )
    export = actions.add_parser(
        "export",
        help="write the model's state dict (sharded or not) to one .pt file",
        description="Write state[ENTRY] of a checkpoint as one plain state dict (tensors on "
        "CPU, no wrapper prefixes) to --output, atomically.",
    )
    export.add_argument(
        "checkpoint",
        metavar="PATH",
        help="a step-XXXXXXXX folder, or a checkpoints folder (its newest complete one)",
    )
    export.add_argument("--output", required=True, metavar="FILE", help="the .pt file to write")
    export.add_argument(
        "--entry",
        default="model",
        metavar="NAME",
        help="the name the model was checkpointed under (default %(default)s)",
    )
    export.add_argument(
        "--unsafe-pickle",
        action="store_true",
        help="UNSAFE: unpickle any object the checkpoint holds, running whatever code it "
        "says (only for a checkpoint you wrote and trust); default: tensors, numbers, strings, "
        "containers and numpy arrays only",
    )
    export.set_defaults(handler=run)


def resolve_checkpoint(path: Path, unsafe_pickle: bool = False) -> tuple[Path, dict]:
    """``path`` itself when it is a checkpoint folder, else its newest checkpoint that reads
    (a newer one that does not is skipped with a line on stderr, as a resume skips it); with
    its loaded state.

    Raises:
        DataError: no such folder, or no checkpoint in it; ``path`` (a step folder), or every
            checkpoint in it, is corrupt or incomplete (the newest one's error).
    """
    from ddpkit.checkpoint.io import MANIFEST, list_checkpoints, load_checkpoint

    if (path / MANIFEST).is_file():
        return path, load_checkpoint(path, unsafe_pickle=unsafe_pickle)
    complete = [p for p in list_checkpoints(path) if (p / MANIFEST).is_file()]
    if not complete:
        raise DataError(
            f"no checkpoint at path={path}: it is neither a step-XXXXXXXX folder with a "
            "manifest nor a folder holding one. Pass OUTPUT_DIR/checkpoints or one of its "
            "step folders."
        )
    errors = []
    for folder in complete:
        try:
            return folder, load_checkpoint(folder, unsafe_pickle=unsafe_pickle)
        except DataError as error:
            errors.append(error)
            print(
                f"ddpkit checkpoint export: skipping {folder.name}: {error} Falling back to the "
                "previous one.",
                file=sys.stderr,
            )
    raise errors[0]


def run(args: argparse.Namespace) -> int:
    from ddpkit.checkpoint.export import export_model

    output = Path(args.output)
    if not output.parent.is_dir():
        raise ConfigError(
            f"cannot write --output {output}: folder {output.parent} does not exist. Create it "
            "or pick another path."
        )
    folder, state = resolve_checkpoint(Path(args.checkpoint), args.unsafe_pickle)
    info = export_model(
        folder, output, entry=args.entry, unsafe_pickle=args.unsafe_pickle, state=state
    )
    print(
        f"exported state[{info['entry']!r}] of {folder} ({info['source']}): "
        f"{info['num_tensors']} tensors, {info['num_elements']} values, "
        f"{info['bytes'] / 2**20:.1f} MiB -> {output}"
    )
    return 0
