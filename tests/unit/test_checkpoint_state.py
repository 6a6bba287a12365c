"""Checkpointed state beyond the model: extra objects, failed saves, partial loads, torch.compile.

One process (world size 1). The cross-rank parts (comparison at save, ZeroRedundancyOptimizer)
are in tests/distributed/test_replicated_state.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint.io import load_checkpoint
from ddpkit.checkpoint.lock import LOCK_NAME
from ddpkit.env import ProcessInfo
from ddpkit.errors import DataError
from ddpkit.runtime.process_group import Runtime


def _runtime() -> Runtime:
    return Runtime(ProcessInfo())


class _Ema:
    """An EMA of a model's parameters kept outside the model (what users write by hand)."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    def update(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(param.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": {n: t.clone() for n, t in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.shadow = {n: t.clone() for n, t in state["shadow"].items()}


def _leftovers(directory) -> list[str]:
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name != LOCK_NAME)  # the job's lock


def test_tensor_in_extra_is_refused_naming_the_key_and_nothing_is_written(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError) as info:
        ddpkit.CheckpointManager(
            tmp_path / "ck",
            _runtime(),
            state={"model": model},
            extra={"lr": 0.1, "ema": torch.ones(2)},
        )
    message = str(info.value)
    assert "extra['ema']" in message and "Tensor" in message
    assert "state={'ema': ...}" in message  # says where such state goes
    assert _leftovers(tmp_path / "ck") == []


def test_a_failing_save_leaves_nothing_half_written(tmp_path):
    class Unpicklable:
        def state_dict(self):
            return {"fn": lambda: 0}  # torch.save cannot pickle a lambda

        def load_state_dict(self, state):
            pass

    model = nn.Linear(2, 2)
    ddpkit.CheckpointManager(tmp_path, _runtime(), state={"model": model}).save(1)
    bad = ddpkit.CheckpointManager(
        tmp_path, _runtime(), state={"model": model, "bad": Unpicklable()}
    )
    with pytest.raises(Exception, match="lambda|pickle"):
        bad.save(2)
    assert _leftovers(tmp_path) == ["step-00000001"]  # no .tmp-step-00000002-* folder


def test_stateful_objects_round_trip_and_missing_state_is_an_error(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema, ema_module = _Ema(model), torch.optim.swa_utils.AveragedModel(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    ema_module.update_parameters(model)
    state = {"model": model, "ema": ema, "swa": ema_module}
    ddpkit.CheckpointManager(tmp_path, _runtime(), state=state).save(4)
    assert set(load_checkpoint(tmp_path / "step-00000004")["state"]) == {"model", "ema", "swa"}

    torch.manual_seed(1)
    fresh = nn.Linear(3, 2)
    fresh_ema, fresh_swa = _Ema(fresh), torch.optim.swa_utils.AveragedModel(fresh)
    state = {"model": fresh, "ema": fresh_ema, "swa": fresh_swa}
    assert ddpkit.CheckpointManager(tmp_path, _runtime(), state=state).resume() == 4
    for name, tensor in ema.shadow.items():
        assert torch.equal(fresh_ema.shadow[name], tensor)
    for (name, a), b in zip(
        ema_module.state_dict().items(), fresh_swa.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    other = {"model": fresh, "other": _Ema(fresh)}
    with pytest.raises(DataError, match=r"has no state for state\['other'\]"):
        ddpkit.CheckpointManager(tmp_path, _runtime(), state=other).resume()


def test_stateful_without_state_dict_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"state\['ema'\] is a Tensor"):
        ddpkit.CheckpointManager(
            tmp_path, _runtime(), state={"model": nn.Linear(2, 2), "ema": torch.ones(2)}
        )
    assert _leftovers(tmp_path) == []


def test_partial_load_returns_and_logs_the_keys(caplog):
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    state = {"0.weight": torch.ones(2, 3), "0.bias": torch.ones(2), "head.w": torch.ones(1)}
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        result = ddpkit.load_model_state(model, state, strict=False)
    assert result.missing_keys == ["1.weight", "1.bias"]
    assert result.unexpected_keys == ["head.w"]
    assert torch.equal(model[0].weight, torch.ones(2, 3))
    assert "partial load into Sequential: 2 of 4 keys loaded" in caplog.text
    assert "missing ['1.weight', '1.bias']" in caplog.text
    assert "unexpected ['head.w']" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        full = ddpkit.load_model_state(
            model, nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).state_dict(), strict=False
        )
    assert full.missing_keys == [] and full.unexpected_keys == [] and caplog.text == ""


def _compiled(module: nn.Module) -> nn.Module:
    compiled = torch.compile(module, backend="eager")  # the real OptimizedModule, compiled fast
    compiled(torch.randn(2, module.in_features))
    return compiled


def test_torch_compile_prefix_is_handled_everywhere(tmp_path):
    torch.manual_seed(0)
    inner = nn.Linear(3, 2)
    compiled = _compiled(inner)
    assert type(compiled).__name__ == "OptimizedModule"
    assert list(compiled.state_dict()) == ["_orig_mod.weight", "_orig_mod.bias"]
    assert ddpkit.unwrap_model(compiled) is inner
    assert list(ddpkit.model_state_dict(compiled)) == ["weight", "bias"]

    for prefix in ("_orig_mod.", "module._orig_mod.", "_orig_mod.module."):
        target = nn.Linear(3, 2)
        state = {prefix + k: v for k, v in inner.state_dict().items()}
        result = ddpkit.load_model_state(target, state)
        assert result.missing_keys == [] and torch.equal(target.weight, inner.weight), prefix
    into_compiled = _compiled(nn.Linear(3, 2))  # plain keys into a compiled model
    ddpkit.load_model_state(into_compiled, inner.state_dict())
    assert torch.equal(ddpkit.unwrap_model(into_compiled).weight, inner.weight)

    ddpkit.CheckpointManager(tmp_path, _runtime(), state={"model": compiled}).save(3)
    assert set(load_checkpoint(tmp_path / "step-00000003")["state"]["model"]) == {"weight", "bias"}
    torch.manual_seed(5)
    resumed = _compiled(nn.Linear(3, 2))
    assert ddpkit.CheckpointManager(tmp_path, _runtime(), state={"model": resumed}).resume() == 3
    assert torch.equal(ddpkit.unwrap_model(resumed).weight, inner.weight)


def test_a_raw_compiled_state_dict_loads_into_a_plain_model():
    """What torch.save(compiled.state_dict()) wrote: ``_orig_mod.`` keys, loaded strictly."""
    source = _compiled(nn.Linear(3, 2))
    target = nn.Linear(3, 2)
    ddpkit.load_model_state(target, source.state_dict())
    assert torch.equal(target.bias, ddpkit.unwrap_model(source).bias)


def test_tensor_digests_are_exact_and_position_sensitive():
    from ddpkit.guards.replicas import tensor_digests

    gen = torch.Generator().manual_seed(0)
    for n in (5, 4096, 10_001):  # the batched small path, one full row, rows plus a tail
        a = torch.randn(n, generator=gen)
        swapped, nudged = a.clone(), a.clone()
        swapped[[1, 3]] = swapped[[3, 1]]
        nudged[n // 2] = torch.nextafter(nudged[n // 2], torch.tensor(float("inf")))
        rows = tensor_digests([a, a.clone(), swapped, nudged])
        assert torch.equal(rows[0], rows[1]), n
        assert not torch.equal(rows[0], rows[2]) and not torch.equal(rows[0], rows[3]), n
    nan, zero = torch.tensor([float("nan")]), torch.tensor([0.0])
    rows = tensor_digests([nan, nan.clone(), zero, -zero, torch.ones(3, dtype=torch.bool)])
    assert torch.equal(rows[0], rows[1])  # bit patterns: the same NaN is equal to itself
    assert not torch.equal(rows[2], rows[3])  # and -0.0 is not 0.0
    assert tensor_digests([]).shape == (0, 3)


def test_bad_state_is_refused_when_the_manager_is_built(tmp_path):
    # refused at the first run, not hours later at the first resume that finds a checkpoint
    with pytest.raises(TypeError, match=r"state\['ema'\] is a int"):
        ddpkit.CheckpointManager(tmp_path, _runtime(), state={"model": nn.Linear(2, 2), "ema": 3})
    with pytest.raises(TypeError, match=r"state is a list: pass a dict"):
        ddpkit.CheckpointManager(tmp_path, _runtime(), state=[nn.Linear(2, 2)])
    empty = ddpkit.CheckpointManager(tmp_path, _runtime())  # fine for load_latest() alone
    with pytest.raises(ddpkit.ConfigError, match=r"holds no state.*state=\{'model': model"):
        empty.save(1)
    with pytest.raises(ddpkit.ConfigError, match="holds no state"):
        empty.resume()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "saved,job,refused",
    [
        (None, "module", False),
        (None, "other", False),
        (None, "zero_optimizer", False),
        (None, "fsdp_model", True),
        (None, "fsdp_optimizer", True),
        ("fsdp_model", "fsdp_model", False),
        ("fsdp_model", "module", False),
        ("fsdp_model", "other", True),
        ("fsdp_optimizer", "fsdp_optimizer", False),
        ("fsdp_optimizer", "other", False),
        ("fsdp_optimizer", "zero_optimizer", True),
        ("fsdp_optimizer", "module", True),
        ("zero_optimizer", "zero_optimizer", False),
        ("zero_optimizer", "other", False),
        ("zero_optimizer", "fsdp_optimizer", False),
        ("zero_optimizer", "fsdp_model", True),
    ],
)
def test_which_saved_layouts_resume_into_which_objects(tmp_path, saved, job, refused):
    from ddpkit.checkpoint.sharded import layout_refusal

    problem = layout_refusal(tmp_path, "x", saved, job, "a Thing")
    assert (problem is not None) == refused
    if refused:
        kind = saved or "unsharded (state.pt)"
        assert problem.startswith(f"checkpoint {tmp_path} holds state['x'] as {kind}; this job's ")
        assert "state['x'] is a Thing. Resume with the strategy it was saved with" in problem


def _saved_run(tmp_path, model: nn.Module, lr: float = 0.1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ddpkit.CheckpointManager(tmp_path, _runtime(), state={"model": model, "opt": opt}).save(20)


def test_a_model_that_changed_shape_is_one_line_naming_the_checkpoint_and_how_to_start_fresh(
    tmp_path,
):
    _saved_run(tmp_path, nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)))
    wider = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2), nn.Linear(2, 2))
    before = [p.detach().clone() for p in wider.parameters()]
    opt = torch.optim.SGD(wider.parameters(), lr=0.1)
    ckpt = ddpkit.CheckpointManager(tmp_path, _runtime(), state={"model": wider, "opt": opt})
    with pytest.raises(DataError) as refused:
        ckpt.resume()
    assert str(refused.value) == (
        f"checkpoint {tmp_path / 'step-00000020'} does not fit state['model'] (Sequential): "
        "3 of another shape: 0.weight [8, 3] in the checkpoint, [16, 3] in the model, 0.bias "
        "[8] in the checkpoint, [16] in the model, 2.weight [2, 8] in the checkpoint, [2, 16] in "
        "the model; 2 missing from the checkpoint: 3.weight, 3.bias. The model changed since "
        "it was saved: resume with the model it was saved from, or start fresh in another "
        "checkpoint folder (ddpkit train: another --output-dir, or --overwrite)."
    )
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters(), strict=True))


def test_an_edited_optimizer_setting_is_named_and_the_checkpoints_wins(tmp_path, capsys):
    model = nn.Linear(3, 2)
    _saved_run(tmp_path, model, lr=0.1)
    ddpkit.configure_logging(ProcessInfo())
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # edited: 0.1 -> 0.5
    ddpkit.CheckpointManager(tmp_path, _runtime(), state={"model": model, "opt": opt}).resume()
    err = capsys.readouterr().err
    assert opt.param_groups[0]["lr"] == 0.1  # torch restores the checkpoint's
    assert (
        "resuming step-00000020: state['opt']'s settings differ from the checkpoint's (lr 0.5 "
        "here, 0.1 in the checkpoint); the checkpoint's are restored"
    ) in err
    # a scheduler moves lr every step: the scheduled lr is no edit, its initial_lr would be
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = {"model": model, "opt": opt, "sched": sched}
    ckpt = ddpkit.CheckpointManager(tmp_path / "s", _runtime(), state=state)
    opt.step(), sched.step()
    ckpt.save(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = {**state, "opt": opt, "sched": sched}
    ckpt = ddpkit.CheckpointManager(tmp_path / "s", _runtime(), state=state)
    assert ckpt.resume() == 1 and opt.param_groups[0]["lr"] == 0.05
    assert "settings differ" not in capsys.readouterr().err
