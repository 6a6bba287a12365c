"""``wrap_model(compile=...)`` on real gloo ranks: compiled DDP trains exactly like eager DDP,
checkpoints never carry ``_orig_mod.``, the guards still work, and gradients that DDP did not
all-reduce are caught before the first step (where plain torch diverges silently).

Compiling is slow on this 2-core machine, so the models are tiny and most tests use the
``aot_eager`` backend (dynamo and AOTAutograd trace forward and backward as in the default,
DDPOptimizer splits the graph the same way; only inductor's code generation is skipped: ~3 s
per compile instead of ~25 s). One test runs inductor, the default, and states its tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.guards.grad_sync import GradSyncError
from ddpkit.guards.replicas import ReplicaDivergenceError
from ddpkit.guards.wrapped import WrappedModelError
from ddpkit.testing import run_distributed

pytestmark = pytest.mark.slow
FAST = {"backend": "aot_eager"}
NUM_STEPS = 4
ACCUM = 2


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear (no dropout: eager and compiled runs comparable)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def _batches(rank: int, num: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [
        (torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(num)
    ]


def _local_gradients(state, bucket):
    """A DDP comm hook that hands each bucket back without an all-reduce: what a reducer whose
    collective was no-oped (pytorch/pytorch#152735) leaves, each rank its own gradients."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _train(rt, compile_, *, num_steps=NUM_STEPS, accum=ACCUM, broken=False, **wrap_kwargs):
    """SGD steps of BatchNormNet through TrainStep (accumulation: no_sync on all but the last
    micro-step); returns the parameters, the check's state and what the step raised."""
    torch.manual_seed(0)
    model = ddpkit.wrap_model(BatchNormNet(), rt, compile=compile_, **wrap_kwargs)
    if broken:
        model.register_comm_hook(None, _local_gradients)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ddpkit.TrainStep(model, optimizer, runtime=rt, num_micro_steps=accum)
    before = [p.detach().clone() for p in model.parameters()]
    error = None
    try:
        for window in step.windows(_batches(rt.rank, num_steps * accum)):
            step(window)
    except GradSyncError as exc:
        error = str(exc)
    params = {n: p.detach().clone() for n, p in ddpkit.unwrap_model(model).named_parameters()}
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return model, {"params": params, "error": error, "unchanged": unchanged}


def _compiled_vs_eager(rt, backend: str):
    eager = _train(rt, False)[1]["params"]
    model, compiled = _train(rt, {"backend": backend})
    ddpkit.check_replicas(model, rt, step=NUM_STEPS)  # replicas identical; BN buffers skipped
    return {
        "eager": eager,
        "compiled": compiled["params"],
        "is_ddp": type(model) is DistributedDataParallel,
        "keys": list(model.state_dict()),
    }


@pytest.mark.parametrize(
    "world_size,backend,atol",
    [
        (2, "aot_eager", 0.0),  # a sum of two is the same in any order: bitwise equal
        (3, "aot_eager", 1e-6),  # measured at most 1.5e-8: gradients ready in another order
        (2, "inductor", 1e-6),  # the default; fused kernels: measured at most 3e-8
    ],
)
def test_compiled_ddp_with_accumulation_equals_eager(world_size, backend, atol):
    """4 SGD steps of 2 micro-steps (no_sync on the first) of a BatchNorm model; ``eager``
    backend (dynamo alone) was bitwise equal at 3 ranks too, aot_eager was not: AOTAutograd's
    backward hands DDP the gradients in another order, so its buckets and the 3-rank ring's
    summation order change."""
    args = (backend,)
    for rank in run_distributed(_compiled_vs_eager, world_size, args=args, timeout_s=400):
        assert rank["is_ddp"]  # compiled in place: still a DistributedDataParallel
        assert all(k.startswith("module.") and "_orig_mod" not in k for k in rank["keys"])
        for name, value in rank["eager"].items():
            torch.testing.assert_close(rank["compiled"][name], value, atol=atol, rtol=0)


OPTION_SETS = [  # (wrap_model options, precision): each trained eager and compiled
    ({"static_graph": True}, "32"),
    ({"sync_batchnorm": True}, "32"),  # ddpkit's CPU SyncBatchNorm: a graph break at .item()
    ({"grad_compression": "fp16"}, "32"),
    ({}, "bf16-mixed"),
]


def _options_compiled_vs_eager(rt):
    differences = []
    for options, precision in OPTION_SETS:
        params = []
        for compile_ in (False, FAST):
            torch.manual_seed(0)
            model = ddpkit.wrap_model(BatchNormNet(), rt, compile=compile_, **options)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            mixed = ddpkit.MixedPrecision(precision, rt)
            step = ddpkit.TrainStep(model, optimizer, runtime=rt, precision=mixed)
            for window in step.windows(_batches(rt.rank, 3)):
                step(window)
            params.append([p.detach().clone() for p in model.parameters()])
        differences.append(max((a - b).abs().max().item() for a, b in zip(*params, strict=True)))
    return differences


def test_ddp_options_and_precision_under_compile_train_like_eager():
    """static_graph (DDPOptimizer with it: pytorch/pytorch#109261 feared a failure), SyncBatchNorm,
    fp16 compression and bf16 autocast: bitwise the eager parameters after 3 steps, 2 ranks."""
    for differences in run_distributed(_options_compiled_vs_eager, 2, timeout_s=300):
        assert differences == [0.0] * len(OPTION_SETS)


def _unsynced(rt, check: bool):
    kwargs = {} if check else {"grad_sync_check_steps": 0}
    model, result = _train(rt, FAST, broken=True, **kwargs)
    try:
        ddpkit.check_replicas(model, rt, step=NUM_STEPS)
        result["replicas"] = "equal"
    except ReplicaDivergenceError as exc:
        result["replicas"] = str(exc)
    del result["params"]
    return result


def _plain_torch_unsynced(rt):
    """The same fault without ddpkit: torch.compile(DDP(m)) and a loop of torch's own."""
    torch.manual_seed(0)
    model = torch.compile(DistributedDataParallel(BatchNormNet()), backend="aot_eager")
    model.register_comm_hook(None, _local_gradients)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(rt.rank, NUM_STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()  # no error: every rank steps on its own gradients
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_unsynced_gradients_raise_at_the_first_step_where_plain_torch_diverges(world_size):
    plain = run_distributed(_plain_torch_unsynced, world_size, timeout_s=240)
    assert not all(torch.equal(a, b) for a, b in zip(plain[0], plain[1], strict=True))

    unchecked = run_distributed(_unsynced, world_size, args=(False,), timeout_s=240)
    for rank in unchecked:  # the check off: silent, only the replica check sees it afterwards
        assert rank["error"] is None
        assert "replicas diverged" in rank["replicas"]

    for rank in run_distributed(_unsynced, world_size, args=(True,), timeout_s=240):
        assert (
            "gradients differ across ranks at optimizer step 1 under torch.compile"
            in (rank["error"])
        )
        assert "rank 1 differs in fc1.weight" in rank["error"]
        assert "pytorch/pytorch#152735" in rank["error"]
        assert rank["unchanged"]  # raised before the step: no replica moved
        assert rank["replicas"] == "equal"


def _check_lifecycle(rt):
    """The check on a correct compiled run: 3 steps compared, then the global hook is gone."""
    from ddpkit.guards import grad_sync

    model = ddpkit.wrap_model(BatchNormNet(), rt, compile=FAST)
    (check,) = grad_sync._CHECKS
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)  # not the model's
    seen = []
    for x, y in _batches(rt.rank, 5):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        other.step()  # holds none of the model's parameters: not counted, no collective
        optimizer.step()
        seen.append((check.num_checked, bool(grad_sync._HOOK)))
    return seen


def test_the_check_compares_three_steps_then_removes_its_hook():
    for seen in run_distributed(_check_lifecycle, 2, timeout_s=240):
        assert seen == [(1, True), (2, True), (3, False), (3, False), (3, False)]


def _guards_under_compile(rt):
    results = {}
    model = ddpkit.wrap_model(BatchNormNet(), rt, compile=FAST)
    x, y = _batches(rt.rank, 1)[0]
    F.cross_entropy(model(x), y).backward()
    try:  # a backward around the wrapper: DDP would not sync it
        F.cross_entropy(ddpkit.unwrap_model(model)(x), y).backward()
    except WrappedModelError as exc:
        results["bypass"] = str(exc)
    ddpkit.unwrap_model(model).fc2.weight.requires_grad_(False)
    try:
        model(x)
    except WrappedModelError as exc:
        results["frozen"] = str(exc)
    return results


def test_wrap_guard_still_catches_changes_under_compile():
    for rank in run_distributed(_guards_under_compile, 2, timeout_s=240):
        assert "computed without a new forward of the DDP wrapper" in rank["bypass"]
        assert "requires_grad changed after wrap_model" in rank["frozen"]
        assert "fc2.weight" in rank["frozen"]


def _save_and_resume(rt, directory: str, save_compiled: bool, load_compiled: bool):
    torch.manual_seed(0)
    source = ddpkit.wrap_model(BatchNormNet(), rt, compile=FAST if save_compiled else False)
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    step = ddpkit.TrainStep(source, optimizer, runtime=rt)
    for window in step.windows(_batches(rt.rank, 2)):
        step(window)
    state = {"model": source, "optimizer": optimizer}
    ddpkit.CheckpointManager(directory, rt, state=state).save(2)
    saved = torch.load(f"{directory}/step-00000002/state.pt", weights_only=False)  # our own
    keys = list(saved["state"]["model"])

    torch.manual_seed(1)  # other initial values: the resume must overwrite them
    target = ddpkit.wrap_model(BatchNormNet(), rt, compile=FAST if load_compiled else False)
    target_opt = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
    ddpkit.CheckpointManager(
        directory, rt, state={"model": target, "optimizer": target_opt}
    ).resume()
    params = zip(source.parameters(), target.parameters(), strict=True)
    buffers = zip(source.buffers(), target.buffers(), strict=True)  # rank 0's are saved
    same = [torch.equal(a, b) for a, b in params]
    same += [torch.equal(a, b) for a, b in buffers] if rt.rank == 0 else []
    resumed = ddpkit.TrainStep(target, target_opt, runtime=rt, start_step=2)
    going_on = ddpkit.TrainStep(source, optimizer, runtime=rt, start_step=2)
    more = _batches(rt.rank + 10, 2)
    for a, b in zip(resumed.windows(more), going_on.windows(more), strict=True):
        resumed(a)
        going_on(b)
    after = [
        torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters(), strict=True)
    ]
    return {"keys": keys, "same": all(same), "after": all(after)}


@pytest.mark.parametrize("save_compiled,load_compiled", [(True, False), (False, True)])
def test_checkpoints_of_compiled_and_eager_runs_are_interchangeable(
    tmp_path, save_compiled, load_compiled
):
    eager_keys = list(BatchNormNet().state_dict())
    args = (str(tmp_path), save_compiled, load_compiled)
    for rank in run_distributed(_save_and_resume, 2, args=args, timeout_s=240):
        assert rank["keys"] == eager_keys  # no module., no _orig_mod.
        assert rank["same"]  # parameters (and rank 0's buffers) restored exactly
        assert rank["after"]  # and both go on to the same parameters


def _local_sgd_under_compile(rt):
    model = ddpkit.wrap_model(BatchNormNet(), rt, compile=FAST)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = ddpkit.enable_local_sgd(model, inner, runtime=rt, sync_every=2)
    for x, y in _batches(rt.rank, 4):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()  # gradients local by design: the check must stay quiet
    ddpkit.check_replicas(model, rt, step=4)  # averaged after step 4
    from ddpkit.guards import grad_sync

    return len(grad_sync._CHECKS)


def test_local_sgd_under_compile_is_not_mistaken_for_unsynced_gradients():
    assert run_distributed(_local_sgd_under_compile, 2, timeout_s=240) == [0, 0]


class _Blocks(nn.Module):
    """Two blocks in a ModuleList (fsdp's default policy shards each) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _fsdp_run(rt, compile_):
    torch.manual_seed(0)
    model = ddpkit.wrap_model(_Blocks(), rt, strategy="fsdp", compile=compile_)
    compiled = [type(b).__name__ for b in model.blocks if b._compiled_call_impl is not None]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rt.rank)
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    state = ddpkit.model_state_dict(model)  # collective: the full state on rank 0
    return compiled, {k: v.clone() for k, v in state.items()}


def test_fsdp_blocks_compiled_in_place_train_like_eager():
    eager = run_distributed(_fsdp_run, 2, args=(False,), timeout_s=200)
    compiled = run_distributed(_fsdp_run, 2, args=({"backend": "aot_eager"},), timeout_s=200)
    assert eager[0][0] == [] and compiled[0][0] == compiled[1][0] == ["FSDPLinear"] * 2
    assert sorted(compiled[0][1]) == sorted(eager[0][1])  # no _orig_mod. in the keys
    for key, value in eager[0][1].items():  # measured: bitwise (aot_eager, 2 ranks)
        assert torch.equal(compiled[0][1][key], value), key
