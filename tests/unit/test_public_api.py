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


KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "",
    inspect.Parameter.VAR_POSITIONAL: "*",
    inspect.Parameter.KEYWORD_ONLY: "kw ",
    inspect.Parameter.VAR_KEYWORD: "**",
}
NO_DEFAULT = object()


def _api_signatures() -> dict[str, str]:
    """``{name: "(a, b, *, c=1)"}``: the signature line under each heading of docs/api.md."""
    text = (ROOT / "docs" / "api.md").read_text()
    found = re.findall(r"^### `(\w+)`\n`\1(\([^`\n]*\))[^`\n]*`", text, flags=re.MULTILINE)
    return dict(found)


def _documented_parameters(signature: str) -> list[tuple[str, object]]:
    """``[(kind + name, default)]`` of a signature line, defaults as literals where they are."""
    args = ast.parse(f"def f{signature}: pass").body[0].args
    positional = args.posonlyargs + args.args
    defaults = [NO_DEFAULT] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [(a.arg, d) for a, d in zip(positional, defaults, strict=True)]
    params += [("*" + args.vararg.arg, NO_DEFAULT)] if args.vararg else []
    params += [
        ("kw " + a.arg, NO_DEFAULT if d is None else d)
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    params += [("**" + args.kwarg.arg, NO_DEFAULT)] if args.kwarg else []

    def literal(node: object) -> object:
        try:
            return NO_DEFAULT if node is NO_DEFAULT else ast.literal_eval(node)
        except ValueError:  # torch.device("cpu"), F.cross_entropy: not compared
            return ...

    return [(name, literal(default)) for name, default in params]


def test_api_reference_signatures_are_the_real_ones():
    signatures = _api_signatures()
    assert "init_runtime" in signatures and "CheckpointManager" in signatures
    wrong = []
    for name, documented in sorted(signatures.items()):
        signature = inspect.signature(getattr(ddpkit, name))
        real = [
            (KINDS[p.kind] + p.name, NO_DEFAULT if p.default is p.empty else p.default)
            for p in signature.parameters.values()
            if not p.name.startswith("_")  # a dataclass's private fields
        ]
        doc = _documented_parameters(documented)
        same = [n for n, _ in doc] == [n for n, _ in real] and all(
            d is ... or d == r for (_, d), (_, r) in zip(doc, real, strict=True)
        )
        if not same:
            wrong.append(f"{name}: docs/api.md {documented}, real {signature}")
    assert not wrong, "docs/api.md shows another signature:\n" + "\n".join(wrong)


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
