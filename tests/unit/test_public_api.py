"""The public API is hard to misuse: keyword-only arguments, a complete reference, public torch.

- every callable in ``ddpkit.__all__`` (functions, classes' constructors and their public
  methods) takes at most two positional arguments; the rest are keyword-only;
- ``ddpkit.__all__`` and the ``### `name` `` headings of docs/api.md are the same set, and every
  name in ``__all__`` imports;
- ddpkit's own code never touches DDP's private ``require_backward_grad_sync`` switch (local SGD
  and Join go through the public ``no_sync()``).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import ddpkit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(ddpkit.__file__).resolve().parent
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

# callables allowed a third positional argument, each for a reason
ALLOWED_POSITIONAL = {
    # evaluate(model, loader, rt): three arguments of distinct types, always all given, in the
    # order of the nanoGPT-style loop the README shows; a keyword would only add noise
    "evaluate": 3,
}


def _positional(fn) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind in POSITIONAL and p.name not in ("self", "cls")]


def _public_callables():
    """``(qualified name, callable)`` for every name in ``__all__`` and public methods of its
    classes defined by ddpkit (exceptions excepted: they take a message)."""
    for name in ddpkit.__all__:
        obj = getattr(ddpkit, name)
        if inspect.isclass(obj):
            if issubclass(obj, BaseException):
                continue
            yield name, obj
            for attr, member in vars(obj).items():
                wrapped = isinstance(member, (staticmethod, classmethod))
                func = member.__func__ if wrapped else member
                if not attr.startswith("_") and inspect.isfunction(func):
                    yield f"{name}.{attr}", getattr(obj, attr)
        elif callable(obj):
            yield name, obj


def test_public_callables_take_at_most_two_positional_arguments():
    offenders = []
    for name, fn in _public_callables():
        positional = _positional(fn)
        if len(positional) > ALLOWED_POSITIONAL.get(name, 2):
            offenders.append(f"{name}({', '.join(positional)})")
    assert not offenders, (
        "make the arguments past the first two keyword-only (add `*,`): " + "; ".join(offenders)
    )


def test_the_walk_sees_constructors_and_methods():
    # the test above can fail: it reads the signatures it should
    names = dict(_public_callables())
    assert _positional(names["CheckpointManager"]) == ["directory", "runtime"]
    assert _positional(names["CheckpointManager.save"]) == ["step"]
    assert _positional(names["MixedPrecision.step"]) == ["optimizer", "model"]
    assert _positional(names["evaluate"]) == ["model", "loader", "runtime"]
    assert "DdpkitError" not in names and "check_replicas" in names


def _api_headings() -> list[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    return re.findall(r"^### `([A-Za-z_][A-Za-z_0-9]*)`\s*$", text, flags=re.MULTILINE)


def test_api_reference_and_all_name_the_same_set():
    headings = _api_headings()
    assert len(headings) == len(set(headings)), "a name has two entries in docs/api.md"
    documented, exported = set(headings), set(ddpkit.__all__)
    assert not exported - documented, f"add to docs/api.md: {sorted(exported - documented)}"
    assert not documented - exported, f"not in ddpkit.__all__: {sorted(documented - exported)}"


def test_every_exported_name_imports():
    assert len(ddpkit.__all__) == len(set(ddpkit.__all__))
    missing = [name for name in ddpkit.__all__ if not hasattr(ddpkit, name)]
    assert not missing
    namespace: dict = {}
    exec("from ddpkit import *", namespace)  # noqa: S102 - what a user's star import gets
    assert set(ddpkit.__all__) <= set(namespace)


def test_documented_features_are_top_level():
    for name in ("NonFiniteGuard", "check_replicas", "StallError", "DeadlockError", "explain"):
        assert name in ddpkit.__all__, name


def test_ddpkit_never_touches_ddps_private_sync_switch():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "require_backward_grad_sync":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value == "require_backward_grad_sync":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} (getattr/setattr)")
    assert not found, f"use DistributedDataParallel.no_sync() instead: {found}"
