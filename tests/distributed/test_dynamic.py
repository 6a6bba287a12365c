"""Dynamic models: DDP's unfinished-reduction error names the parameters and the fix; a model
that skips a branch trains with find_unused_parameters (or static_graph) and its replicas agree.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.testing import run_distributed
from ddpkit.training.accumulation import GradientAccumulator
from ddpkit.training.dynamic import UnusedParameterError


class TwoHeads(nn.Module):
    """A trunk and two heads; forward returns both heads' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 2)
        self.branch = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_branch: bool = True):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head_a(h), self.head_b(h)


def _batches(num: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 4, generator=gen), torch.randint(0, 3, (4,), generator=gen))] * num


def _train(runtime, model, num_micro_steps: int, use_branch, loss_uses_b: bool):
    """Steps with a GradientAccumulator; returns per-step (flat grads, flat params)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulator = GradientAccumulator(model, runtime, num_micro_steps=num_micro_steps)
    history = []
    for window in accumulator.windows(_batches(4 * num_micro_steps, seed=runtime.rank)):
        optimizer.zero_grad()
        for micro in window:
            x, y = micro.batch
            with micro:
                out_a, out_b = model(x, use_branch(window.index, runtime.rank))
                loss = F.cross_entropy(out_a, y)
                if loss_uses_b:
                    loss = loss + out_b.square().mean()
                micro.backward(loss)
        grads = torch.cat(
            [
                torch.zeros(p.numel()) if p.grad is None else p.grad.flatten()
                for p in model.parameters()
            ]
        )
        optimizer.step()
        history.append((grads, torch.cat([p.detach().flatten() for p in model.parameters()])))
    return history


def _always(step: int, rank: int) -> bool:
    return True


def _skip_odd_steps(step: int, rank: int) -> bool:
    return step % 2 == 0


def _skip_odd_steps_on_rank_1(step: int, rank: int) -> bool:
    return not (rank == 1 and step % 2 == 1)


def _error_rank(runtime, num_micro_steps: int, case: str, find_unused: bool = False):
    torch.manual_seed(0)
    model = ddpkit.wrap_model(TwoHeads(), runtime, find_unused_parameters=find_unused)
    use_branch = _always if case == "head_b_not_in_loss" else _skip_odd_steps
    try:
        _train(
            runtime, model, num_micro_steps, use_branch, loss_uses_b=case != "head_b_not_in_loss"
        )
    except UnusedParameterError as exc:
        return str(exc)
    return None


def _error_cases_rank(runtime, cases: list[tuple]):
    """Several cases in one spawn (each on a fresh DDP model), to keep the suite short."""
    return [_error_rank(runtime, *case) for case in cases]


def test_output_not_in_the_loss_is_named_with_its_fix():
    cases = [(1, "head_b_not_in_loss"), (2, "head_b_not_in_loss")]
    # and what the message's "also tolerates it" rests on: find_unused_parameters=True copes
    # with an output left out of the loss (pytorch/pytorch#57081, torch >= 1.9)
    cases.append((1, "head_b_not_in_loss", True))
    for rank, (k1, k2, tolerated) in enumerate(
        run_distributed(_error_cases_rank, 2, args=(cases,))
    ):
        for message in (k1, k2):  # without accumulation, and with K = 2
            assert message is not None and message.startswith(f"[rank {rank}/2] DDP: ")
            assert (
                "returned by forward but not part of the loss: head_b.weight, head_b.bias -> "
                "use that output in the loss, or do not return it" in message
            )
            assert "not used in forward" not in message
        assert tolerated is None


def test_branch_skipped_in_forward_is_named_with_find_unused_parameters():
    # every rank skips the branch at step 1, so every rank's next forward fails
    for message in run_distributed(_error_rank, 2, args=(1, "branch_skipped")):
        assert message is not None
        assert "not used in forward: branch.weight, branch.bias -> wrap with " in message
        assert "find_unused_parameters=True (ddpkit train --find-unused-parameters)" in message
        assert "head_b" not in message


def _dynamic_rank(runtime, ddp_option: str):
    torch.manual_seed(0)
    model = ddpkit.wrap_model(TwoHeads(), runtime, **{ddp_option: True})
    use_branch = _skip_odd_steps_on_rank_1 if ddp_option == "find_unused_parameters" else None
    refused = None
    if use_branch is None:  # static_graph: the branch is never used, the same every step

        def use_branch(step, rank):
            return False

        try:  # torch's DDP breaks no_sync under static_graph (pytorch/pytorch#143580)
            GradientAccumulator(model, runtime, num_micro_steps=2)
        except ddpkit.ConfigError as exc:
            refused = str(exc)
    return _train(runtime, model, 1, use_branch, loss_uses_b=True), refused


@pytest.mark.parametrize("ddp_option", ["find_unused_parameters", "static_graph"])
def test_model_skipping_a_branch_trains_and_replicas_agree(ddp_option):
    (rank0, refused), (rank1, _) = run_distributed(_dynamic_rank, 2, args=(ddp_option,))
    if ddp_option == "static_graph":
        assert "invalid gradient accumulation: static_graph=True with num_micro_steps=2" in refused
    assert len(rank0) == len(rank1) == 4
    for (grads0, params0), (grads1, params1) in zip(rank0, rank1, strict=True):
        assert torch.equal(grads0, grads1)  # all-reduced: the same averaged gradient
        assert torch.equal(params0, params1)
    initial, final = rank0[0][1], rank0[-1][1]
    assert (final - initial).abs().max() > 1e-3  # it trained
    if ddp_option == "find_unused_parameters":
        # the branch was used on every step by rank 0 and on even steps by rank 1: its
        # gradient is the average, so it is non-zero on every step
        sizes = {name: p.numel() for name, p in TwoHeads().named_parameters()}
        offset = sum(sizes[n] for n in list(sizes)[: list(sizes).index("branch.weight")])
        num_branch = sizes["branch.weight"] + sizes["branch.bias"]
        for grads, _ in rank0:
            assert grads[offset : offset + num_branch].abs().sum() > 0
