"""The model changes after wrap_model, or a backward bypasses DDP: caught at the next step.

Each fault below is silent under plain DDP in torch 2.13 (every rank trains on its own
gradients and exits 0), or fails there with a message that names neither the cause nor the fix
(freezing or replacing a head: "Expected to have finished reduction"; models that differ: one
rank's shape error and a "Connection closed by peer" on the others).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import ddpkit
from ddpkit.guards.wrapped import WrappedModelError
from ddpkit.testing import run_distributed


class Net(nn.Module):
    def __init__(self, checkpointing: str = "none") -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.fc = nn.Linear(8, 3)
        self.checkpointing = checkpointing

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "none":
            return torch.tanh(self.b(torch.tanh(self.a(x))))
        reentrant = self.checkpointing.startswith("reentrant")
        h = torch.tanh(checkpoint(self.a, x, use_reentrant=reentrant))
        if self.checkpointing == "reentrant_twice":  # the same block, checkpointed twice
            h = torch.tanh(checkpoint(self.a, h, use_reentrant=True))
        return torch.tanh(self.b(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(self.features(x))
        return out * self.scale if hasattr(self, "scale") else out


def _batch(runtime, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + runtime.rank)  # each rank its own data
    return torch.randn(4, 8, generator=gen, requires_grad=True), torch.randint(0, 3, (4,))


def _step(runtime, model, optimizer, step: int, call=None) -> None:
    x, y = _batch(runtime, step)
    optimizer.zero_grad()
    F.cross_entropy((call or model)(x), y).backward()
    optimizer.step()


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def _fault(runtime, case: str) -> str:
    """Train two good steps, cause ``case``, train on; the error message, or "no error"."""
    torch.manual_seed(0)
    net = Net("reentrant_twice" if case == "reentrant_twice" else "none")
    if case == "unfreeze":
        net.a.weight.requires_grad_(False)
    model = ddpkit.wrap_model(net, runtime, find_unused_parameters=case == "head_after_hint")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = ddpkit.unwrap_model(model)
    calls = {
        "bypass_module": lambda x: model.module(x),
        "bypass_method": lambda x: model.module.fc(model.module.features(x)),
        "bypass_unwrap": lambda x: ddpkit.unwrap_model(model)(x),
    }
    calls["bypass_first"] = calls["bypass_module"]
    try:
        for step in range(4):
            if step == 2:
                if case == "unfreeze":
                    inner.a.weight.requires_grad_(True)
                elif case == "freeze":
                    inner.b.requires_grad_(False)
                elif case in ("head", "head_after_hint"):
                    inner.fc = nn.Linear(8, 3)
                    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                elif case == "new_parameter":
                    inner.scale = nn.Parameter(torch.ones(3))
                    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            bypass = step >= 2 or case == "bypass_first"
            _step(runtime, model, optimizer, step, calls.get(case) if bypass else None)
    except WrappedModelError as exc:
        return f"step {step}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "unfreeze",
            "requires_grad changed after wrap_model: unfrozen (never all-reduced; each "
            "rank would train them on its own gradients): a.weight.",
        ),
        ("freeze", "frozen (DDP still waits for their gradients): b.weight, b.bias."),
        (
            "head",
            "model changed after wrap_model: replaced (new parameter objects DDP never "
            "saw): fc.weight, fc.bias. DDP all-reduces only",
        ),
        ("head_after_hint", "replaced (new parameter objects DDP never saw): fc.weight, fc.bias"),
        ("new_parameter", "model changed after wrap_model: added: scale."),
    ],
)
def test_model_changed_after_wrapping_raises_at_the_next_step(case, expected):
    messages = run_distributed(_fault, world_size=2, args=(case,))
    for rank, message in enumerate(messages):
        assert message.startswith(f"step 2: [rank {rank}/2] "), message
        assert expected in message, message
        assert "ddpkit.wrap_model(ddpkit.unwrap_model(model), runtime)" in message
        assert "\n" not in message


@pytest.mark.parametrize(
    "case, step",
    [("bypass_module", 2), ("bypass_method", 2), ("bypass_unwrap", 2), ("bypass_first", 0)],
)
def test_backward_around_the_wrapper_raises_in_that_backward(case, step):
    messages = run_distributed(_fault, world_size=2, args=(case,))
    for rank, message in enumerate(messages):
        assert message.startswith(f"step {step}: [rank {rank}/2] gradient of fc."), message
        assert "computed without a new forward of the DDP wrapper" in message
        assert "call the wrapper, model(x)" in message and "torch.no_grad()" in message


def test_reentrant_checkpoint_of_one_block_twice_is_caught():
    # plain DDP syncs only one of the two gradients of block a: the ranks' grads differ
    messages = run_distributed(_fault, world_size=2, args=("reentrant_twice",))
    for rank, message in enumerate(messages):
        assert message.startswith(f"step 0: [rank {rank}/2] gradient of a."), message
        assert "use_reentrant=False" in message


def _differ_at_wrap(runtime, same_shapes: bool) -> str:
    net = Net()
    if same_shapes:  # a and b have equal shapes: DDP's own shape check cannot see this
        (net.a if runtime.rank == 0 else net.b).requires_grad_(False)
    elif runtime.rank == 1:
        net.a.weight.requires_grad_(False)
    try:
        ddpkit.wrap_model(net, runtime)
    except WrappedModelError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("same_shapes", [True, False])
def test_ranks_with_different_trainable_parameters_fail_at_wrap(same_shapes):
    messages = run_distributed(_differ_at_wrap, world_size=3, args=(same_shapes,))
    for rank, message in enumerate(messages):
        assert message.startswith(f"[rank {rank}/3] model differs across ranks at wrap_model: ")
        if same_shapes:
            assert (
                "rank 1 trains a.weight, a.bias, freezes b.weight, b.bias (compared with "
                "rank 0); rank 2 trains a.weight, a.bias, freezes b.weight, b.bias" in message
            )
        else:
            assert "rank 1 freezes a.weight (compared with rank 0)" in message
            assert "rank 2 " not in message.split("] ", 1)[1]
        assert "freeze by name, never by rank" in message


def _correct_uses(runtime) -> dict[str, object]:
    """Everything here is legitimate: no guard may fire, and the replicas must agree."""
    torch.manual_seed(0)
    model = ddpkit.wrap_model(Net(), runtime)
    inner = ddpkit.unwrap_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulator = ddpkit.GradientAccumulator(model, runtime, num_micro_steps=2)
    batches = [_batch(runtime, step) for step in range(4)]
    for window in accumulator.windows(batches):
        optimizer.zero_grad()
        for micro in window:
            x, y = micro.batch
            with micro:
                micro.backward(F.cross_entropy(model(x), y))
        optimizer.step()
    with torch.no_grad():
        inner(batches[0][0])  # the inner module without gradients
    inner.eval()
    inner(batches[0][0])  # evaluation that forgot no_grad: nothing is back-propagated
    inner.train()
    # the inner module's head in the same loss as the wrapper's output: one backward, synced
    x, y = _batch(runtime, 7)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y) + inner.fc(torch.ones(2, 8)).square().mean()
    loss.backward()
    optimizer.step()
    inner.drop = nn.Dropout(0.0)  # a submodule without parameters
    inner.fc.weight = inner.fc.weight  # the same parameter assigned again
    ema = copy.deepcopy(inner)  # an EMA copy, trained on its own: not guarded
    F.cross_entropy(ema(x), y).backward()
    torch.save(inner, io.BytesIO())  # the whole module pickles (no guard inside)
    _step(runtime, model, optimizer, 8)
    inner.a.weight.requires_grad_(False)  # a change, followed by the documented fix
    model = ddpkit.wrap_model(ddpkit.unwrap_model(model), runtime)
    optimizer = torch.optim.SGD((p for p in model.parameters() if p.requires_grad), lr=0.1)
    for step in (9, 10):
        _step(runtime, model, optimizer, step)
    for checkpointing in ("reentrant", "non_reentrant"):  # activation checkpointing, once each
        torch.manual_seed(0)
        ckpt = ddpkit.wrap_model(Net(checkpointing), runtime)
        _step(runtime, ckpt, torch.optim.SGD(ckpt.parameters(), lr=0.1), 11)
    flat = _flat(model.module)
    gathered = [torch.zeros_like(flat) for _ in range(runtime.world_size)]
    dist.all_gather(gathered, flat)
    return {"agree": all(torch.equal(g, gathered[0]) for g in gathered)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_correct_uses_raise_nothing_and_replicas_agree(world_size):
    results = run_distributed(_correct_uses, world_size=world_size, timeout_s=90)
    assert all(r == {"agree": True} for r in results), results


def _gan_freezing_the_discriminator(runtime) -> bool:
    """pix2pix/CycleGAN's set_requires_grad(D, False) for the generator step: correct in DDP.

    With every parameter of D frozen, no gradient hook of DDP's reducer fires, so nothing is left
    waiting; plain DDP trains this with replicas that agree (checked by hand under torchrun, also
    with find_unused_parameters=True).
    """
    torch.manual_seed(0)
    gen = ddpkit.wrap_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), runtime)
    disc = ddpkit.wrap_model(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)), runtime)
    opt_g = torch.optim.Adam(gen.parameters(), 1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + runtime.rank)
        real, z = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        fake = gen(z)
        disc.requires_grad_(True)
        opt_d.zero_grad()
        (F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()).backward()
        opt_d.step()
        disc.requires_grad_(False)
        opt_g.zero_grad()
        F.softplus(-disc(fake)).mean().backward()
        opt_g.step()
    flat = torch.cat([_flat(gen.module), _flat(disc.module)])
    gathered = [torch.zeros_like(flat) for _ in range(runtime.world_size)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(t, gathered[0]) for t in gathered)


def test_freezing_every_parameter_for_a_step_is_allowed():
    assert run_distributed(_gan_freezing_the_discriminator, world_size=2) == [True, True]
