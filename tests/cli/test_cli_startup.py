"""``ddpkit --help``, ``--version`` and flag errors answer without importing torch (issue 26);
so do ``ddpkit train --help``, ``--print-config`` and its flag and config errors.

Each command runs as ``python -m ddpkit ...`` in a fresh interpreter; an ``atexit`` hook there
writes whether ``torch`` was ever imported. The texts and exit codes are the usual ones: the
subcommands ``ddpkit --help`` lists come from a static table, checked here against the modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import run_cli

# python -m ddpkit ARGS; at exit, the file named in argv[1] gets the modules imported
AS_DDPKIT = (
    "import atexit, runpy, sys\n"
    "out = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(out, 'w').write('\\n'.join(sys.modules)))\n"
    "sys.argv[0] = 'ddpkit'\n"
    "runpy.run_module('ddpkit', run_name='__main__', alter_sys=True)\n"
)
COMMANDS = ("train", "run", "doctor", "bench", "plot", "checkpoint")


def _ddpkit(args: list[str], tmp_path: Path) -> tuple[int, str, str, set[str]]:
    """``(exit status, stdout, stderr, modules imported)`` of ``ddpkit ARGS``."""
    probe = tmp_path / "modules"
    done = run_cli(["-c", AS_DDPKIT, str(probe), *args], timeout_s=60)
    return done.returncode, done.stdout, done.stderr, set(probe.read_text().splitlines())


@pytest.mark.parametrize(
    "args,status,expected",
    [
        (["--help"], 0, "usage: ddpkit [-h] [--version] {" + ",".join(COMMANDS) + "} ..."),
        (["-h"], 0, "PyTorch distributed data-parallel training, correct by default."),
        (["--version"], 0, "ddpkit 0.1.0 with torch "),
        (["run", "--help"], 0, "ddpkit run -n 2 -m mypackage.train --lr 0.1"),
        (
            ["run", "-n", "zero", "x.py"],
            2,
            "ddpkit run: error: argument -n/--nproc: invalid int value: 'zero'. "
            "See 'ddpkit run --help'.",
        ),
        (
            ["run"],
            2,
            "ddpkit run: error: the following arguments are required: -n/--nproc. "
            "See 'ddpkit run --help'.",
        ),
        (
            ["run", "-n", "2", "--bogus-flag", "x.py"],
            2,
            "ddpkit run: error: unrecognized arguments: --bogus-flag. See 'ddpkit run --help'.",
        ),
        (
            ["run", "-n", "2", "--nnodes", "2-3", "x.py"],
            2,
            "ddpkit run: error: invalid --nnodes: nnodes='2-3'. Give a number of nodes N",
        ),
        (
            ["run", "-n", "2"],
            2,
            "ddpkit run: error: invalid launch: no script given (ddpkit run -n 2 train.py "
            "[args], or -m package.module).",
        ),
        (
            ["run", "-n", "0", "no-such-script.py"],
            2,
            "ddpkit run: error: invalid launch: nproc=0 must be >= 1; "
            "script='no-such-script.py' does not exist.",
        ),
        (["train", "--help"], 0, "usage: ddpkit train [-h] [--config FILE] [--print-config]"),
        (["train", "--print-config", "--epochs", "2"], 0, "[run]  # the training run\n"),
        (
            ["train", "--bogus"],
            2,
            "ddpkit train: error: unrecognized arguments: --bogus. See 'ddpkit train --help'.",
        ),
        (
            ["train", "--batch-size", "x"],
            2,
            "ddpkit train: error: argument --batch-size: invalid int value: 'x'. "
            "See 'ddpkit train --help'.",
        ),
        (
            ["train", "--strategy", "nope"],
            2,
            "ddpkit train: error: argument --strategy: invalid choice: 'nope' (choose from ",
        ),
        (
            ["train", "--nproc", "0"],
            2,
            "ddpkit train: error: invalid config: nproc=0 must be >= 1.",
        ),
        (
            ["train", "--batch-size", "0", "--stop-signals", "SIGKILL"],
            2,
            "ddpkit train: error: invalid config: batch_size=0 must be >= 1. "
            "stop_signals='SIGKILL' is not usable: invalid stop signals: SIGKILL. Use signal names "
            "such as SIGTERM,SIGINT,SIGUSR1 (SIGKILL and SIGSTOP cannot be caught), or none.",
        ),
        (  # a rule between two values: torch waits when --nproc is given (no GPU count needed)
            ["train", "--strategy", "single", "--nproc", "2"],
            2,
            "ddpkit train: error: invalid config: strategy='single' with world_size=2.",
        ),
        (
            ["train", "--config", "/nonexistent/ddpkit-train.toml"],
            2,
            "ddpkit train: error: config file unreadable: path='/nonexistent/ddpkit-train.toml'.",
        ),
        (
            ["bogus"],
            2,
            "ddpkit: error: argument command: invalid choice: 'bogus' (choose from "
            + ", ".join(f"'{name}'" for name in COMMANDS)
            + "). See 'ddpkit --help'.",
        ),
        ([], 2, "ddpkit: error: the following arguments are required: command."),
    ],
)
def test_help_version_and_flag_errors_answer_without_torch(args, status, expected, tmp_path):
    code, out, err, modules = _ddpkit(args, tmp_path)
    assert code == status, (out, err)
    assert expected in (out if status == 0 else err), (out, err)
    if status:
        assert not out and len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert "torch" not in modules, f"ddpkit {' '.join(args)} imported torch"


def test_top_level_help_lists_every_subcommand_with_its_help(tmp_path):
    from ddpkit.cli import build_parser

    code, out, _, _ = _ddpkit(["--help"], tmp_path)
    assert code == 0
    assert out == build_parser().format_help()  # the parser with every subcommand loaded


def test_the_static_table_matches_the_subcommand_modules():
    from ddpkit.cli import SUBCOMMANDS, build_parser

    full = build_parser()  # imports every subcommand module
    subparsers = next(a for a in full._actions if a.dest == "command")
    real = {action.dest: action.help for action in subparsers._choices_actions}
    assert real == SUBCOMMANDS and list(real) == list(SUBCOMMANDS)


def test_only_the_named_subcommand_is_imported(tmp_path):
    code, out, _, modules = _ddpkit(["doctor", "--help"], tmp_path)
    assert code == 0 and out.startswith("usage: ddpkit doctor")
    assert {m for m in modules if m.startswith("ddpkit.cli.")} == {"ddpkit.cli.doctor"}
    assert "torch" not in modules


def test_public_names_still_import_on_first_use():
    import ddpkit

    assert "TrainStep" in dir(ddpkit) and ddpkit.TrainStep.__name__ == "TrainStep"
    assert set(ddpkit._API_MODULES) == set(ddpkit.__all__)
    # what type checkers see (the imports under `if TYPE_CHECKING:`) is what __getattr__ gives
    tree = ast.parse(Path(ddpkit.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n))
    eager = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module != "__future__"]
    imports = [n for n in [*guarded.body, *eager] if isinstance(n, ast.ImportFrom)]
    seen = {alias.name: node.module for node in imports for alias in node.names}
    assert {name: seen.get(name) for name in ddpkit.__all__} == ddpkit._API_MODULES
    from ddpkit import init_runtime, wrap_model  # noqa: F401

    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ddpkit.no_such_name  # noqa: B018
