"""``strategy="fsdp"`` (FSDP2 ``fully_shard``) and ``strategy="zero1"`` (DDP +
``ZeroRedundancyOptimizer``) compute what one process computes on the global batch, and every
part of the training step works with them or refuses in one line.

Each spawn checks several facts, to keep the suite inside its time budget on two cores.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime
from ddpkit.testing import run_distributed

NUM_STEPS = 6
PER_RANK_BATCH = 4
NUM_MICRO_STEPS = 2
CLIP = 0.2  # below the gradients' norm: clipping acts on every step


def _dataset(num_samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, 6, generator=gen)
    return TensorDataset(x, torch.randint(0, 3, (num_samples,), generator=gen))


def _net() -> nn.Module:
    torch.manual_seed(0)  # 17 rows: shards of unequal size on 2 and 3 ranks
    return nn.Sequential(
        nn.Linear(6, 17), nn.Tanh(), nn.Linear(17, 17), nn.Tanh(), nn.Linear(17, 3)
    )


def _optimizer(model: nn.Module, runtime: Runtime, strategy: str) -> torch.optim.Optimizer:
    if strategy == "zero1":
        return ddpkit.build_zero_optimizer(
            model.parameters(), runtime, optimizer_class=torch.optim.AdamW, lr=0.05
        )
    return torch.optim.AdamW(model.parameters(), lr=0.05)


def _train(runtime: Runtime, strategy: str, batch_size: int, num_samples: int) -> dict:
    """NUM_STEPS optimizer steps of K micro-steps with clipping; the full state and norms."""
    model = ddpkit.wrap_model(_net(), runtime, strategy=strategy)
    optimizer = _optimizer(model, runtime, strategy)
    loader = ddpkit.build_train_loader(
        _dataset(num_samples), runtime, batch_size=batch_size, seed=7
    )
    step = ddpkit.TrainStep(
        model, optimizer, runtime=runtime, num_micro_steps=NUM_MICRO_STEPS, clip_grad_norm=CLIP
    )
    norms, losses = [], []
    while step.num_steps < NUM_STEPS:  # crosses an epoch boundary
        for result in ddpkit.train_epoch(step, loader):
            norms.append(result.grad_norm)
            losses.append(result.loss)
            if step.num_steps == NUM_STEPS:
                break
    state = {k: v.detach().clone() for k, v in ddpkit.model_state_dict(model).items()}
    local_norm = None
    if strategy == "fsdp":  # what a shard-local norm would be: must differ from the total
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        local_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    return {"state": state, "norms": norms, "local_norm": local_norm, "losses": losses}


def _train_rank(runtime: Runtime, strategy: str, num_samples: int) -> dict:
    return _train(runtime, strategy, PER_RANK_BATCH, num_samples)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_sharded_strategies_match_one_process_on_the_global_batch(strategy, world_size):
    # 4 windows of K=2 micro-batches per epoch: 6 steps cross an epoch boundary
    num_samples = 8 * PER_RANK_BATCH * world_size
    single = _train(Runtime(ProcessInfo()), "single", PER_RANK_BATCH * world_size, num_samples)
    per_rank = run_distributed(_train_rank, world_size, args=(strategy, num_samples), timeout_s=120)
    full = per_rank[0]["state"]
    assert full.keys() == single["state"].keys()
    for name, value in full.items():
        torch.testing.assert_close(value, single["state"][name], rtol=0, atol=1e-5)
    assert (full["0.weight"] - _net().state_dict()["0.weight"]).abs().max() > 1e-2  # it trained
    for rank, result in enumerate(per_rank[1:], start=1):
        if strategy == "fsdp":  # the full state is gathered to rank 0 only
            assert result["state"] == {}, f"rank {rank} got a full state dict"
        else:  # zero1: every rank holds the whole (replicated) model
            assert all(torch.equal(result["state"][k], full[k]) for k in full)
    # clipping acted on the total norm of all ranks' gradients: the unsharded norm
    first, reference = per_rank[0]["norms"][0], single["norms"][0]
    assert first > CLIP
    assert abs(first - reference) <= 1e-6 * reference, (first, reference)
    assert all(r["norms"] == per_rank[0]["norms"] for r in per_rank)  # one decision everywhere
    if strategy == "fsdp":
        assert abs(per_rank[0]["local_norm"] - per_rank[0]["norms"][-1]) > 1e-3


def _count_collectives(runtime: Runtime, num_micro_steps: int) -> list[dict[str, int]]:
    """FSDP's collectives per optimizer step: torch.distributed's reduce_scatter_single and
    all_gather_single (what torch 2.13's FSDP2 calls) wrapped with a counter, in this test."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    originals = {
        name: getattr(dist, name) for name in ("reduce_scatter_single", "all_gather_single")
    }

    def counting(name: str):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return call

    model = ddpkit.wrap_model(_net(), runtime, strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ddpkit.TrainStep(model, optimizer, runtime=runtime, num_micro_steps=num_micro_steps)
    loader = ddpkit.build_train_loader(_dataset(64), runtime, batch_size=2, seed=0)
    per_step = []
    try:
        for name in originals:
            setattr(dist, name, counting(name))
        for window in step.windows(loader):
            counts.clear()
            step(window)
            per_step.append(dict(counts))
            if len(per_step) == 2:
                break
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return per_step


def _reduce_scatters(counts: dict[str, int]) -> int:
    return counts.get("reduce_scatter_single", 0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulation_reduce_scatters_once_per_optimizer_step(world_size):
    one = run_distributed(_count_collectives, world_size, args=(1,), timeout_s=90)
    three = run_distributed(_count_collectives, world_size, args=(3,), timeout_s=90)
    units = 3  # one FSDP unit per Linear; the root holds no parameter of its own
    for per_step in one[0] + three[0]:
        assert _reduce_scatters(per_step) == units, per_step
    # and the micro-steps did run: each forward all-gathers every unit again
    gathers = [c.get("all_gather_single", 0) for c in three[0]]
    assert all(g >= 3 * units for g in gathers), three[0]


class _Batchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _one_step(step: ddpkit.TrainStep, batch) -> ddpkit.StepResult:
    for window in step.windows([batch]):  # the window lives while its generator does
        return step(window)
    raise AssertionError("no window")


def _guards_rank(runtime: Runtime) -> dict:
    """Non-finite guard, evaluation, check_replicas and the state dicts under fsdp."""
    out: dict = {}
    model = ddpkit.wrap_model(_net(), runtime, strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(
        torch.randn(5, 6, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 0, 1])
    )
    test = ddpkit.build_eval_loader(data, runtime, batch_size=1)  # 5 samples: uneven shards
    out["eval_before"] = ddpkit.evaluate(model, test, runtime)  # before any training forward
    out["full_before"] = ddpkit.model_state_dict(model)
    guard = ddpkit.NonFiniteGuard(runtime, mode="skip")
    step = ddpkit.TrainStep(model, optimizer, runtime=runtime, guard=guard)
    gen = torch.Generator().manual_seed(runtime.rank)
    x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    bad = x.clone()
    if runtime.rank == 1:
        bad[0, 0] = math.nan
    shards = [p.detach().to_local().clone() for p in model.parameters()]
    skipped = _one_step(step, (bad, y))
    out["skipped"] = skipped.skipped
    out["unchanged"] = all(
        torch.equal(a, p.detach().to_local())
        for a, p in zip(shards, model.parameters(), strict=True)
    )
    out["taken"] = not _one_step(step, (x, y)).skipped
    raising = ddpkit.TrainStep(
        model, optimizer, runtime=runtime, guard=ddpkit.NonFiniteGuard(runtime, mode="raise")
    )
    try:
        _one_step(raising, (bad, y))
    except ddpkit.NonFiniteError as exc:
        out["raised"] = str(exc)
    out["eval_after"] = ddpkit.evaluate(model, test, runtime)
    out["full_after"] = ddpkit.model_state_dict(model)
    sharded = ddpkit.model_state_dict(model, sharded=True)
    out["sharded_local_rows"] = sharded["0.weight"].to_local().shape[0]
    ddpkit.check_replicas(model, runtime, step=2)  # no buffers: nothing replicated, no error
    out.update(_buffer_checks(runtime))
    return out


def _buffer_checks(runtime: Runtime) -> dict:
    out = {}
    for sync in (False, True):
        model = ddpkit.wrap_model(_Batchy(), runtime, strategy="fsdp", sync_batchnorm=sync)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(runtime.rank))
        model(x).sum().backward()  # BatchNorm statistics of this rank's own batch
        try:
            ddpkit.check_replicas(model, runtime, step=1)
            out[f"replicas_sync_{sync}"] = "equal"
        except ddpkit.ReplicaDivergenceError as exc:
            out[f"replicas_sync_{sync}"] = str(exc)
    return out


def _evaluate_full(state: dict) -> dict:
    net = _net()
    net.load_state_dict(state)
    data = TensorDataset(
        torch.randn(5, 6, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 0, 1])
    )
    rt = Runtime(ProcessInfo())
    return ddpkit.evaluate(net, ddpkit.build_eval_loader(data, rt, batch_size=5), rt)


@pytest.mark.parametrize("world_size", [2, 3])
def test_guard_evaluation_and_state_dicts_under_fsdp(world_size):
    results = run_distributed(_guards_rank, world_size, timeout_s=120)
    zero = results[0]
    assert zero["skipped"] and zero["unchanged"] and zero["taken"]
    assert all(r["skipped"] and r["unchanged"] and r["taken"] for r in results)
    assert zero["raised"].startswith("non-finite loss at step 1 on rank(s) 1.")
    assert all(r["raised"] == zero["raised"] for r in results)
    for key, full in (("eval_before", "full_before"), ("eval_after", "full_after")):
        expected = _evaluate_full(zero[full])  # one process scoring rank 0's full state
        for r in results:
            assert r[key]["num_samples"] == 5
            assert r[key]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
            assert r[key]["accuracy"] == expected["accuracy"]
    assert zero["eval_after"]["loss"] != zero["eval_before"]["loss"]  # the taken step counted
    assert all(r["full_after"] == {} for r in results[1:])
    assert zero["full_after"]["0.weight"].shape == (17, 6)
    assert results[0]["sharded_local_rows"] == math.ceil(17 / world_size)
    assert zero["replicas_sync_True"] == "equal"
    message = zero["replicas_sync_False"]
    assert message.startswith("replicas diverged at step 1: rank 1 differs in buffers ")
    assert "body.1.running_mean" in message and "FSDP does not broadcast buffers" in message


def _refusals_rank(runtime: Runtime) -> list[str]:
    """Every combination that does not apply to a sharded strategy, with its one line."""
    found = []

    def refused(fn) -> None:
        try:
            fn()
        except ddpkit.ConfigError as exc:
            found.append(str(exc))
        else:
            found.append("accepted")

    fsdp = ddpkit.wrap_model(_net(), runtime, strategy="fsdp")
    zero = ddpkit.wrap_model(_net(), runtime, strategy="zero1")
    sgd = torch.optim.SGD
    refused(lambda: ddpkit.wrap_model(_net(), runtime, strategy="fsdp", grad_compression="fp16"))
    refused(lambda: ddpkit.wrap_model(_net(), runtime, strategy="fsdp", bucket_cap_mb=1))
    refused(lambda: ddpkit.wrap_model(_net(), runtime, strategy="ddp", precision="bf16-mixed"))
    refused(lambda: ddpkit.wrap_model(_net(), runtime, strategy="fsdp", precision="16-mixed"))
    refused(lambda: ddpkit.wrap_model(_net(), runtime, strategy="fsdp", wrap_policy=3))
    refused(
        lambda: ddpkit.enable_local_sgd(
            fsdp, sgd(fsdp.parameters(), lr=0.1), runtime=runtime, sync_every=2
        )
    )
    refused(
        lambda: ddpkit.enable_local_sgd(
            zero, _optimizer(zero, runtime, "zero1"), runtime=runtime, sync_every=2
        )
    )
    refused(lambda: ddpkit.TrainStep(zero, sgd(zero.parameters(), lr=0.1), runtime=runtime))
    plain = _net()
    early = sgd(plain.parameters(), lr=0.1)  # built before wrapping: not the shards
    late = ddpkit.wrap_model(plain, runtime, strategy="fsdp")
    refused(lambda: ddpkit.TrainStep(late, early, runtime=runtime))
    fp16 = ddpkit.MixedPrecision("16-mixed", runtime)
    refused(
        lambda: ddpkit.TrainStep(
            fsdp, sgd(fsdp.parameters(), lr=0.1), runtime=runtime, precision=fp16
        )
    )
    return found


def test_what_does_not_apply_to_sharded_strategies_is_refused_in_one_line():
    results = run_distributed(_refusals_rank, 2, timeout_s=90)
    assert results[0] == results[1]
    expected_starts = [
        "grad_compression='fp16' with strategy='fsdp'. These configure DDP's gradient sync, "
        "and FSDP reduce-scatters",
        "bucket_cap_mb=1 with strategy='fsdp'. These configure DDP's",
        "precision='bf16-mixed' with strategy='ddp'. These configure FSDP's fully_shard",
        "precision='16-mixed' with strategy='fsdp'. Its loss scaler does not handle",
        "invalid FSDP wrap policy: wrap_policy=3.",
        "sync_every=2 with strategy='fsdp'. Local SGD averages whole replicas",
        "sync_every=2 with strategy='zero1'. Local SGD averages whole replicas",
        "strategy='zero1' with a SGD: ZeRO-1 shards the optimizer state",
        "strategy='fsdp': the optimizer holds parameters that are not the model's shards",
        "precision='16-mixed' with strategy='fsdp'. Its loss scaler does not handle",
    ]
    assert len(results[0]) == len(expected_starts)
    for message, start in zip(results[0], expected_starts, strict=True):
        assert message.startswith(start), message
        assert "\n" not in message


def test_sharded_strategies_need_a_process_group_and_options_are_checked_at_world_size_1():
    rt = Runtime(ProcessInfo())
    for strategy in ("fsdp", "zero1"):
        with pytest.raises(
            ddpkit.DistributedError, match=f"strategy='{strategy}' with world_size=1. It needs 2"
        ):
            ddpkit.wrap_model(_net(), rt, strategy=strategy)
    with pytest.raises(
        ddpkit.ConfigError, match="reshard_after_forward=False with strategy='auto'. These"
    ):
        ddpkit.wrap_model(_net(), rt, strategy="auto", reshard_after_forward=False)
    with pytest.raises(
        ddpkit.ConfigError, match="grad_compression='bf16' with strategy='fsdp'. These"
    ):
        ddpkit.wrap_model(_net(), rt, strategy="fsdp", grad_compression="bf16")
    opt = ddpkit.build_zero_optimizer(
        _net().parameters(), rt, optimizer_class=torch.optim.SGD, lr=0.1
    )
    assert type(opt) is torch.optim.SGD  # nothing to shard on one process


def _policy_rank(runtime: Runtime) -> list[list[str]]:
    """Which submodules the wrap policies make FSDP units."""
    from ddpkit.parallel.fsdp import fsdp_modules

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

        def forward(self, x):
            return self.mlp(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.layers = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(4, 2)

    def units(**kwargs) -> list[str]:
        model = ddpkit.wrap_model(Net(), runtime, strategy="fsdp", **kwargs)
        names = {id(m): n for n, m in model.named_modules()}
        return [names[id(m)] or "<root>" for m in fsdp_modules(model)]

    return [
        units(),
        units(wrap_policy=nn.Linear),
        units(wrap_policy=lambda m: isinstance(m, Block)),
        units(reshard_after_forward=False, wrap_policy=(Block, nn.Linear)),
    ]


def test_wrap_policies_pick_the_blocks():
    results = run_distributed(_policy_rank, 2, timeout_s=90)
    default, linear, blocks, mixed = results[0]
    assert default == ["<root>", "layers.0", "layers.1"]  # the ModuleList's elements
    assert linear == [
        "<root>",
        "embed",
        "layers.0.mlp.0",
        "layers.0.mlp.2",
        "layers.1.mlp.0",
        "layers.1.mlp.2",
        "head",
    ]
    assert blocks == ["<root>", "layers.0", "layers.1"]
    assert mixed == ["<root>", "embed", "layers.0", "layers.1", "head"]  # outermost match wins


OBJECT_CASES = {  # name -> (the keyword form's options, the same strategy as an object)
    "ddp": (
        {"grad_compression": "bf16", "bucket_cap_mb": 1},
        ddpkit.DDP(grad_compression="bf16", bucket_cap_mb=1),
    ),
    "zero1": ({}, ddpkit.ZeRO1()),
    "fsdp": ({"reshard_after_forward": False}, ddpkit.FSDP(reshard_after_forward=False)),
    "auto": (
        {"find_unused_parameters": True},
        ddpkit.Auto(ddp=ddpkit.DDP(find_unused_parameters=True)),
    ),
}


def _objects_rank(runtime: Runtime) -> dict[str, tuple]:
    """Each strategy wrapped by name and as an object: the wrapper, the recorded strategy and
    the state after one optimizer step on rank-dependent data (equal bitwise)."""
    x, y = _dataset(8 * runtime.world_size).tensors
    x, y = x[runtime.rank :: runtime.world_size], y[runtime.rank :: runtime.world_size]
    found = {}
    for name, (options, strategy) in OBJECT_CASES.items():
        states, seen = [], []
        for given, kwargs in ((name, options), (strategy, {})):
            model = ddpkit.wrap_model(_net(), runtime, strategy=given, **kwargs)
            recorded = ddpkit.wrapped_strategy(model)
            optimizer = _optimizer(model, runtime, recorded.name)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            states.append(ddpkit.model_state_dict(model))
            seen.append((type(model).__name__, recorded == strategy.resolve(runtime.world_size)))
        same = states[0].keys() == states[1].keys() and all(
            torch.equal(value, states[1][key]) for key, value in states[0].items()
        )
        found[name] = (*seen[1], seen[0][0], same)
    return found


def test_strategy_objects_wrap_and_train_as_their_names_do():
    results = run_distributed(_objects_rank, 2, timeout_s=90)
    assert results[0] == results[1]
    assert results[0] == {
        "ddp": ("DistributedDataParallel", True, "DistributedDataParallel", True),
        "zero1": ("DistributedDataParallel", True, "DistributedDataParallel", True),
        "fsdp": ("FSDPSequential", True, "FSDPSequential", True),
        "auto": ("DistributedDataParallel", True, "DistributedDataParallel", True),
    }
