"""Buffers, state outside the model and evaluation tell the truth across ranks.

BatchNorm models trained on per-rank data (rank r's inputs scaled by 1 + 2 r and shifted by 4 r)
so the ranks' running statistics really differ: evaluation scores rank 0's model (the saved one),
the replica check accepts DDP's default buffer broadcast and names unsynced buffers, a save names
replicated state that differs on some rank, and ZeroRedundancyOptimizer state resumes exactly.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ddpkit
from ddpkit.checkpoint.lock import LOCK_NAME
from ddpkit.env import ProcessInfo
from ddpkit.guards.nonfinite import ReplicaDivergenceError, check_replicas
from ddpkit.runtime.process_group import Runtime
from ddpkit.testing import DistributedTestError, run_distributed

NUM_STEPS = 6


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _labels(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def _test_set() -> TensorDataset:
    x = torch.randn(90, 4, generator=torch.Generator().manual_seed(7))
    return TensorDataset(x, _labels(x))


def _train(runtime, model: nn.Module, after_step=None) -> None:
    """SGD steps on rank-dependent data: the ranks' BatchNorm batch statistics differ."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(1, NUM_STEPS + 1):
        z = torch.randn(16, 4, generator=torch.Generator().manual_seed(100 * runtime.rank + step))
        x = z * (1 + 2 * runtime.rank) + 4.0 * runtime.rank  # the same task, shifted inputs
        optimizer.zero_grad()
        F.cross_entropy(model(x), _labels(z)).backward()
        optimizer.step()
        if after_step is not None:
            after_step(step)


def _own_statistics_metrics(module: nn.Module, loader, runtime) -> dict:
    """What evaluate reported before: each rank's shard scored with its own buffers."""
    module.eval()
    with torch.no_grad():
        loss = correct = count = 0.0
        for x, y in loader:
            logits = module(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += float((logits.argmax(1) == y).sum())
            count += len(y)
    module.train()
    loss, correct, count = ddpkit.all_reduce_sum([loss, correct, count], runtime).tolist()
    return {"loss": loss / count, "accuracy": correct / count}


def _evaluate_rank(runtime, ddp_options: dict) -> dict:
    model = ddpkit.wrap_model(_bn_net(), runtime, **ddp_options)
    _train(runtime, model)
    module = ddpkit.unwrap_model(model)
    buffers_before = {n: b.clone() for n, b in module.named_buffers()}
    loader = ddpkit.build_eval_loader(_test_set(), runtime, batch_size=8)
    metrics = ddpkit.evaluate(model, loader, runtime)
    restored = all(torch.equal(b, buffers_before[n]) for n, b in module.named_buffers())
    return {
        "metrics": metrics,
        "state": {k: v.clone() for k, v in ddpkit.model_state_dict(model).items()},
        "own_statistics": _own_statistics_metrics(module, loader, runtime),
        "buffers_restored": restored,
        "still_training": module.training,
    }


@pytest.mark.parametrize(
    "world_size,ddp_options",
    [(2, {}), (3, {}), (2, {"broadcast_buffers": False})],
    ids=["2-default", "3-default", "2-no-broadcast"],
)
def test_evaluate_scores_the_saved_model(world_size, ddp_options):
    results = run_distributed(_evaluate_rank, world_size, args=(ddp_options,), timeout_s=120)
    saved = _bn_net()
    saved.load_state_dict(results[0]["state"])  # what rank 0 saves
    whole = DataLoader(_test_set(), batch_size=90)
    reference = ddpkit.evaluate(saved, whole, Runtime(ProcessInfo()))
    for rank, result in enumerate(results):
        metrics = result["metrics"]
        assert metrics["num_samples"] == 90
        assert metrics["accuracy"] == reference["accuracy"], rank
        assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-6, abs=0), rank
        assert result["buffers_restored"] and result["still_training"]  # training unaffected
    # the test can fail: the ranks' own statistics score something else
    own = results[0]["own_statistics"]  # 0.68, 0.57, 0.58 here against 0.72, 0.68, 0.72
    assert own["accuracy"] != reference["accuracy"] and abs(own["loss"] - reference["loss"]) > 1e-3


def _replica_check_rank(runtime, ddp_options: dict, compiled: bool = False) -> list[str]:
    model = ddpkit.wrap_model(_bn_net(), runtime, **ddp_options)
    if compiled:  # torch.compile(DDP(m)): DDP's buffer broadcast is found under the wrapper
        model = torch.compile(model, backend="eager")
    outcomes = []

    def check(step: int) -> None:
        try:
            check_replicas(model, runtime, step=step)
            outcomes.append("ok")
        except ReplicaDivergenceError as exc:
            outcomes.append(str(exc))

    _train(runtime, model, after_step=check)
    return outcomes


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ddp", "compiled-ddp"]
)
def test_replica_check_accepts_ddp_default_batchnorm(compiled):
    for outcomes in run_distributed(_replica_check_rank, 2, args=({}, compiled), timeout_s=120):
        assert outcomes == ["ok"] * NUM_STEPS


def test_replica_check_accepts_sync_batchnorm_without_buffer_broadcast():
    options = {"sync_batchnorm": True, "broadcast_buffers": False}
    for outcomes in run_distributed(_replica_check_rank, 2, args=(options,)):
        assert outcomes == ["ok"] * NUM_STEPS


@pytest.mark.parametrize("world_size", [2, 3])
def test_replica_check_names_unsynced_buffers_and_the_fix(world_size):
    results = run_distributed(_replica_check_rank, world_size, args=({"broadcast_buffers": False},))
    for outcomes in results:
        assert len(outcomes) == NUM_STEPS and "ok" not in outcomes
        first = outcomes[0]
        for rank in range(1, world_size):
            names = "module.1.running_mean, module.1.running_var"
            assert f"rank {rank} differs in buffers {names}" in first
        assert first.startswith("replicas diverged at step 1: ")
        assert "broadcast_buffers=False" in first and "sync_batchnorm=True" in first


def _save_unsynced_buffers_rank(runtime, directory: str) -> list[str]:
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("ddpkit").addHandler(handler)
    model = ddpkit.wrap_model(_bn_net(), runtime, broadcast_buffers=False)
    _train(runtime, model)
    ddpkit.CheckpointManager(directory, runtime, state={"model": model}).save(NUM_STEPS)
    return messages


def test_save_names_unsynced_buffers_and_saves_rank_zero_statistics(tmp_path):
    messages = run_distributed(_save_unsynced_buffers_rank, 2, args=(str(tmp_path),))[0]
    (warning,) = [m for m in messages if "differs across ranks" in m]
    assert "model buffers differ on rank(s) 1 (1.running_mean, 1.running_var)" in warning
    assert "sync_batchnorm=True" in warning


def _save_ema_of_batchnorm_rank(runtime, directory: str, use_buffers: bool) -> list[str]:
    """torch's AveragedModel copies (or averages) the model's BatchNorm buffers, which DDP's
    default broadcast lets differ between forwards by design: not a difference to warn about."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("ddpkit").addHandler(handler)
    model = ddpkit.wrap_model(_bn_net(), runtime)
    ema = AveragedModel(
        ddpkit.unwrap_model(model), multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=use_buffers
    )
    _train(runtime, model, after_step=lambda step: ema.update_parameters(model.module))
    state = {"model": model, "ema": ema}
    ddpkit.CheckpointManager(directory, runtime, state=state).save(NUM_STEPS)
    return messages


@pytest.mark.parametrize("use_buffers", [False, True])
def test_save_accepts_an_ema_of_ddp_synced_buffers(tmp_path, use_buffers):
    results = run_distributed(_save_ema_of_batchnorm_rank, 2, args=(str(tmp_path), use_buffers))
    assert not [m for m in results[0] if "differs" in m], results[0]
    manifest = json.loads((tmp_path / "step-00000006" / "manifest.json").read_text())
    assert "differs_across_ranks" not in manifest


class _Ema:
    """An EMA of the parameters kept outside the DDP module."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    def update(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            self.shadow[name].lerp_(param.detach(), 0.1)

    def state_dict(self) -> dict:
        return {"shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = {n: t.clone() for n, t in state["shadow"].items()}


def _save_divergent_rank(runtime, directory: str, fault: str) -> list[str]:
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("ddpkit").addHandler(handler)
    torch.manual_seed(0)
    model = ddpkit.wrap_model(nn.Linear(3, 2), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = _Ema(ddpkit.unwrap_model(model))
    F.mse_loss(model(torch.ones(4, 3) * runtime.rank), torch.zeros(4, 2)).backward()
    optimizer.step()
    last = runtime.world_size - 1
    if fault == "ema" and runtime.rank != 0:  # the EMA is updated on ranks 1.. only
        ema.update(ddpkit.unwrap_model(model))
    if fault == "params" and runtime.rank == last:
        with torch.no_grad():
            ddpkit.unwrap_model(model).bias[1] += 1e-7
    state = {"model": model, "optimizer": optimizer, "ema": ema}
    ddpkit.CheckpointManager(directory, runtime, state=state).save(1)
    return messages


@pytest.mark.parametrize("world_size", [2, 3])
def test_save_reports_replicated_state_that_differs(tmp_path, world_size):
    results = run_distributed(_save_divergent_rank, world_size, args=(str(tmp_path), "ema"))
    warning = [m for m in results[0] if "differs across ranks" in m]
    ranks = ", ".join(str(r) for r in range(1, world_size))
    assert len(warning) == 1, results[0]
    assert f"state['ema'] differs on rank(s) {ranks} (shadow.weight, shadow.bias)" in warning[0]
    assert "rank 0's copy was saved" in warning[0]
    manifest = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())
    assert manifest["differs_across_ranks"] == {"state['ema']": list(range(1, world_size))}
    clean = run_distributed(_save_divergent_rank, world_size, args=(str(tmp_path / "c"), "none"))
    assert not [m for m in clean[0] if "differs" in m]
    assert "differs_across_ranks" not in json.loads(
        (tmp_path / "c" / "step-00000001" / "manifest.json").read_text()
    )


def test_save_refuses_diverged_parameters_and_writes_nothing(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_save_divergent_rank, 3, args=(str(tmp_path), "params"))
    message = str(info.value)
    assert "checkpoint step 1 not written: model parameters differ across ranks: " in message
    assert "rank 2 differs in bias" in message
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]  # the job's lock alone


class _Unpicklable:
    def state_dict(self) -> dict:
        return {"fn": lambda: 0}  # torch.save cannot pickle a lambda

    def load_state_dict(self, state: dict) -> None:
        pass


def _failed_write_rank(runtime, directory: str) -> str:
    state = {"model": ddpkit.wrap_model(nn.Linear(2, 2), runtime), "bad": _Unpicklable()}
    try:
        ddpkit.CheckpointManager(directory, runtime, state=state).save(1)
    except Exception as exc:  # every rank must learn that nothing was written
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_failed_write_on_rank_zero_is_reported_on_every_rank(tmp_path):
    results = run_distributed(_failed_write_rank, 2, args=(str(tmp_path),))
    assert "lambda" in results[0]
    assert results[1].startswith(
        "DistributedError: checkpoint step 1 not written: rank 0 failed to write it ("
    )
    assert "lambda" in results[1] and "Nothing was left half-written" in results[1]
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]  # the job's lock alone


ZERO_STEPS = 8


def _zero_run(runtime, directory: str, stop_after: int | None, resume: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0 if not resume else 99)  # resumed state must not depend on the seed
    model = ddpkit.wrap_model(
        nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 2)), runtime
    )
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2
    )
    ckpt = ddpkit.CheckpointManager(
        directory, runtime, state={"model": model, "optimizer": optimizer}
    )
    step = ckpt.resume() if resume else 0
    while step < ZERO_STEPS:
        step += 1
        gen = torch.Generator().manual_seed(10 * runtime.rank + step)
        optimizer.zero_grad()
        x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 2, generator=gen)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if step == stop_after:
            ckpt.save(step)
            return None
    return [p.detach().clone() for p in model.parameters()]


def _zero_resume_rank(runtime, tmpdir: str) -> bool:
    reference = _zero_run(runtime, f"{tmpdir}/ref", None, resume=False)
    _zero_run(runtime, f"{tmpdir}/k", 3, resume=False)
    resumed = _zero_run(runtime, f"{tmpdir}/k", None, resume=True)
    return all(torch.equal(a, b) for a, b in zip(reference, resumed, strict=True))


def test_zero_redundancy_optimizer_resumes_bitwise(tmp_path):
    assert run_distributed(_zero_resume_rank, 2, args=(str(tmp_path),), timeout_s=180) == [
        True,
        True,
    ]


def test_check_replicas_is_a_top_level_name_as_the_readme_writes_it():
    assert ddpkit.check_replicas is check_replicas and "check_replicas" in ddpkit.__all__


def _scheduler_left_out(runtime, directory: str) -> dict:
    """Issue 23 §4 on 2 ranks: a loop saves model and optimizer but not its StepLR, resumes in
    the same processes with a fresh schedule; returns this rank's warnings and LRs."""
    import logging

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore
    logging.getLogger("ddpkit").addHandler(handler)
    torch.manual_seed(0)
    model = ddpkit.wrap_model(nn.Linear(3, 2), runtime)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ckpt = ddpkit.CheckpointManager(directory, runtime, state={"model": model, "optimizer": opt})
    for _ in range(6):
        opt.zero_grad()
        model(torch.ones(4, 3)).square().mean().backward()
        opt.step()
        sched.step()
    ckpt.save(6)
    lr_saved, position_saved = opt.param_groups[0]["lr"], sched.last_epoch
    fresh_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=4, gamma=0.5)
    resumed = ddpkit.CheckpointManager(
        directory, runtime, state={"model": model, "optimizer": fresh_opt}
    )
    resumed.resume()
    fresh_sched.step()  # where the loop goes on
    return {
        "warnings": [w for w in warnings if "no LR scheduler" in w],
        "lr_saved": lr_saved,
        "position_saved": position_saved,
        "position_resumed": fresh_sched.last_epoch,
    }


def test_a_scheduler_left_out_is_named_once_on_rank_zero_of_a_real_job(tmp_path):
    ranks = run_distributed(_scheduler_left_out, 2, args=(str(tmp_path / "ckpt"),))
    assert [len(r["warnings"]) for r in ranks] == [2, 0]  # rank 0: one per manager
    assert "StepLR" in ranks[0]["warnings"][0] and 'state["scheduler"]' in ranks[0]["warnings"][0]
    # the fault itself, which the warning names: the schedule restarted on every rank (the LR
    # itself comes back with the optimizer's param groups; the schedule's position does not)
    assert {r["lr_saved"] for r in ranks} == {0.05}
    assert {(r["position_saved"], r["position_resumed"]) for r in ranks} == {(6, 1)}
