"""The import direction between ddpkit's packages: each layer imports only itself and below.

An AST walk over every module of ``src/ddpkit`` (imports inside functions count too). The core
library must stay usable in a user's own loop without the launcher, the CLI, the MNIST app, the
benchmarks or the test helpers; a new upward import fails here with the file, line and names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ddpkit

PACKAGE = Path(ddpkit.__file__).resolve().parent

# lowest first; a module may import from its own layer and any layer before it. Inside the
# library each package has a layer of its own, so an import cycle between two packages fails here.
LAYERS = (
    ("errors", "files", "settings", "env", "wrappers"),  # wrappers: what wraps a module
    # the library: what a user's own loop imports (``ddpkit/__init__.py`` is its public face)
    ("log",),
    ("security",),  # the rendezvous token and bind checks, the allow-list unpickler
    ("watchdog",),  # each rank's position in its stack, the hang verdicts and reports
    ("diagnostics",),  # torch's errors translated, a peer's failure recognised, disk checks
    ("live",),  # live fault tolerance: the worker's membership and the launcher's lighthouse
    ("runtime",),  # the process group, rendezvous, collectives, the agreed stop
    ("data",),  # sharded samplers and loaders, seeding, the same-data check
    # step timing, the slow rank named, the Prometheus endpoint, experiment trackers
    ("monitoring",),
    ("guards",),
    ("parallel",),
    ("training",),
    ("checkpoint",),
    ("__init__",),
    ("launch",),  # ddpkit run, the worker bootstrap, the process spawner, doctor
    ("app",),  # the MNIST job of ddpkit train
    ("cli", "bench", "testing", "__main__"),
)
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}


def _top(module: str) -> str | None:
    """``ddpkit.runtime.stop`` -> ``runtime``; ``ddpkit`` -> ``__init__``; else None."""
    parts = module.split(".")
    if parts[0] != "ddpkit":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` (a module under ``root``), relative resolved."""
    package = ["ddpkit", *path.relative_to(root).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module))
    return found


def upward_imports(root: Path = PACKAGE) -> list[str]:
    """Every import from a higher layer, as ``file:line: pkg (layer) imports mod (layer)``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        own = relative.parts[0].removesuffix(".py")
        assert own in LAYER_OF, f"{relative}: put its package in a layer of LAYERS"
        for line, module in _imports(path, root):
            target = _top(module)
            if target is not None and LAYER_OF[target] > LAYER_OF[own]:
                problems.append(
                    f"{relative}:{line}: {own} (layer {LAYER_OF[own]}) imports {module} "
                    f"(layer {LAYER_OF[target]})"
                )
    return problems


def test_no_package_imports_from_a_higher_layer():
    assert upward_imports() == []


def test_an_upward_import_is_reported_even_inside_a_function(tmp_path):
    # the usual way an upward import sneaks in is deferred or relative; the walk must see both
    core = tmp_path / "runtime"
    core.mkdir()
    (core / "x.py").write_text(
        "from ddpkit.errors import ConfigError\n"
        "def f():\n    from ddpkit.launch import worker\n"
        "def g():\n    from ..cli import main\n"
    )
    assert upward_imports(tmp_path) == [
        "runtime/x.py:3: runtime (layer 6) imports ddpkit.launch (layer 14)",
        "runtime/x.py:5: runtime (layer 6) imports ddpkit.cli (layer 16)",
    ]


def test_a_rank_that_loads_no_sharded_checkpoint_imports_no_dcp():
    # torch.distributed.checkpoint pulls in DTensor and sympy: 0.6 CPU-s of each rank's
    # start-up on the CI machine, for DDP ranks that never load a sharded checkpoint.
    heavy = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy")
    code = (
        "import sys, ddpkit, ddpkit.launch.worker, ddpkit.app.mnist.job, ddpkit.checkpoint; "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
