"""One object per strategy (issue #25): options checked when built, ``auto`` resolved in one
place, ``problems()``, the string shim of ``wrap_model``, and the examples of the modules.

On real ranks (objects and strings wrap alike): tests/distributed/test_sharded_strategies.py.
"""

from __future__ import annotations

import copy
import dataclasses
import doctest
import gc
import logging
import pickle
import weakref

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import wrappers
from ddpkit.env import ProcessInfo
from ddpkit.parallel import choices, syncbn
from ddpkit.parallel import strategy as strategy_module
from ddpkit.parallel import wrap as wrap_module
from ddpkit.runtime.process_group import Runtime

SINGLE = Runtime(ProcessInfo())


@pytest.mark.parametrize("module", [strategy_module, wrap_module, wrappers, syncbn, choices])
def test_the_docstring_examples_run(module):
    results = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0 and results.failed == 0, results


@pytest.mark.parametrize(
    "strategy,name",
    [
        (ddpkit.Auto(), "auto"),
        (ddpkit.Single(), "single"),
        (ddpkit.DDP(), "ddp"),
        (ddpkit.ZeRO1(), "zero1"),
        (ddpkit.FSDP(), "fsdp"),
        (ddpkit.DataParallel(), "dp"),
        (ddpkit.Live(), "live"),
    ],
)
def test_each_strategy_has_its_name_and_is_immutable(strategy, name):
    assert strategy.name == name
    assert isinstance(strategy, ddpkit.Strategy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.name = "other"


def test_ddp_options_are_kept_and_passed_on_only_when_given():
    stats = ddpkit.CommStats()
    ddp = ddpkit.DDP(
        bucket_cap_mb=5, grad_compression="fp16", comm_stats=stats, find_unused_parameters=True
    )
    assert ddp.ddp_kwargs() == {"bucket_cap_mb": 5, "find_unused_parameters": True}
    assert ddpkit.DDP().ddp_kwargs() == {}
    assert ddp.comm_stats is stats
    assert ddp.given() == [
        ("grad_compression", "fp16"),
        ("bucket_cap_mb", 5),
        ("find_unused_parameters", True),
    ]
    assert ddpkit.ZeRO1(bucket_cap_mb=5) != ddpkit.DDP(bucket_cap_mb=5)  # another strategy
    assert ddpkit.DDP(bucket_cap_mb=5) == ddpkit.DDP(bucket_cap_mb=5)


@pytest.mark.parametrize(
    "build,expected",
    [
        (
            lambda: ddpkit.DDP(grad_compression="int8"),
            "invalid gradient compression: grad_compression='int8' is not one of none, fp16",
        ),
        (
            lambda: ddpkit.ZeRO1(powersgd_rank=0),
            "invalid gradient compression: powersgd_rank=0 must be an integer >= 1",
        ),
        (lambda: ddpkit.DDP(bucket_capmb=5), "unknown DDP option for wrap_model: bucket_capmb=5."),
        (
            lambda: ddpkit.FSDP(precision="16-mixed"),
            "precision='16-mixed' with strategy='fsdp'. Its loss scaler does not handle",
        ),
        (lambda: ddpkit.FSDP(precision="64"), "precision for strategy='fsdp': precision='64'."),
        (lambda: ddpkit.FSDP(wrap_policy=3), "invalid FSDP wrap policy: wrap_policy=3."),
        (
            lambda: ddpkit.FSDP(reshard_after_forward="yes"),
            "invalid reshard_after_forward='yes'. It must be True",
        ),
    ],
)
def test_a_bad_option_is_refused_when_the_object_is_built_in_one_line(build, expected):
    with pytest.raises(ddpkit.ConfigError) as info:
        build()
    assert str(info.value).startswith(expected), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "build",
    [
        lambda: ddpkit.FSDP(grad_compression="fp16"),
        lambda: ddpkit.FSDP(bucket_cap_mb=25),
        lambda: ddpkit.DDP(precision="bf16-mixed"),
        lambda: ddpkit.DDP(wrap_policy=nn.Linear),
        lambda: ddpkit.Single(sync_batchnorm=True),
        lambda: ddpkit.DataParallel(grad_compression="fp16"),
        lambda: ddpkit.Live(bucket_cap_mb=25),
    ],
)
def test_an_option_of_another_strategy_cannot_be_passed(build):
    with pytest.raises((TypeError, ddpkit.ConfigError)):
        build()


def test_auto_is_resolved_in_one_place_by_world_size():
    ddp = ddpkit.DDP(bucket_cap_mb=5)
    assert ddpkit.Auto(ddp=ddp).resolve(2) is ddp
    assert ddpkit.Auto().resolve(3) == ddpkit.DDP()
    assert ddpkit.Auto(ddp=ddp).resolve(1) == ddpkit.Single()
    assert ddpkit.Auto(ddp=ddpkit.ZeRO1()).resolve(2) == ddpkit.ZeRO1()
    for strategy in (ddpkit.DDP(), ddpkit.FSDP(), ddpkit.Single(), ddpkit.DataParallel()):
        assert strategy.resolve(1) is strategy and strategy.resolve(4) is strategy


@pytest.mark.parametrize(
    "strategy,world_size,expected",
    [
        (ddpkit.Auto(), 1, []),
        (ddpkit.Auto(), 4, []),
        (ddpkit.DDP(), 2, []),
        (ddpkit.Single(), 1, []),
        (ddpkit.Live(), 3, []),
        (
            ddpkit.DDP(),
            1,
            [
                "strategy='ddp' with world_size=1. It needs 2 or more processes. Use "
                "strategy='single', or start 2 or more processes (ddpkit run -n 2, ddpkit train "
                "--nproc 2, torchrun --nproc-per-node 2)"
            ],
        ),
        (ddpkit.ZeRO1(), 1, ["strategy='zero1' with world_size=1. It needs 2 or more ..."]),
        (ddpkit.FSDP(), 1, ["strategy='fsdp' with world_size=1. It needs 2 or more ..."]),
        (
            ddpkit.Single(),
            2,
            [
                "strategy='single' with world_size=2. It runs in one process. Use nproc=1 "
                "(--nproc 1), or strategy='ddp' for several processes"
            ],
        ),
        (ddpkit.DataParallel(), 3, ["strategy='dp' with world_size=3. It runs in one ..."]),
    ],
)
def test_problems_name_what_does_not_fit_the_world_size(strategy, world_size, expected):
    problems = strategy.problems(world_size)
    assert len(problems) == len(expected)
    for problem, want in zip(problems, expected, strict=True):
        assert problem.startswith(want.removesuffix("...")), problem


def test_wrap_model_takes_an_object_and_records_it():
    single = ddpkit.Single()
    net = nn.Linear(2, 2)
    assert ddpkit.wrap_model(net, SINGLE, strategy=single) is net
    assert ddpkit.wrapped_strategy(net) is single
    other = nn.Linear(2, 2)
    assert ddpkit.wrapped_strategy(ddpkit.wrap_model(other, SINGLE)) == ddpkit.Single()
    assert ddpkit.wrapped_strategy(nn.DataParallel(nn.Linear(2, 2))) == ddpkit.DataParallel()
    with pytest.raises(
        ddpkit.DistributedError, match="strategy='zero1' with world_size=1. It needs 2 or more"
    ):
        ddpkit.wrap_model(nn.Linear(2, 2), SINGLE, strategy=ddpkit.ZeRO1())
    with pytest.raises(ddpkit.ConfigError, match="model is already wrapped in DataParallel"):
        ddpkit.wrap_model(nn.DataParallel(nn.Linear(2, 2)), SINGLE, strategy=single)


def test_an_auto_object_at_one_process_names_its_ddp_options_in_the_info_line(caplog):
    auto = ddpkit.Auto(ddp=ddpkit.DDP(grad_compression="bf16", sync_batchnorm=True))
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        ddpkit.wrap_model(nn.Linear(2, 2), SINGLE, strategy=auto)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ddpkit.parallel"]
    assert line.endswith(
        " grad_compression='bf16', sync_batchnorm=True: DDP options, in effect with 2 or more "
        "processes; at world_size=1 they do nothing."
    ), line


def test_options_next_to_a_strategy_object_are_refused():
    with pytest.raises(ddpkit.ConfigError) as info:
        ddpkit.wrap_model(nn.Linear(2, 2), SINGLE, strategy=ddpkit.DDP(), bucket_cap_mb=5)
    assert str(info.value).startswith("wrap_model options bucket_cap_mb=5 given with strategy=")
    assert "Pass them to it (DDP(...))" in str(info.value)


@pytest.mark.parametrize(
    "name,options,expected",
    [
        ("auto", {"bucket_cap_mb": 5}, ddpkit.Auto(ddp=ddpkit.DDP(bucket_cap_mb=5))),
        ("single", {}, ddpkit.Single()),
        (
            "ddp",
            {"grad_compression": "fp16", "static_graph": True},
            ddpkit.DDP(grad_compression="fp16", static_graph=True),
        ),
        ("zero1", {"sync_batchnorm": True}, ddpkit.ZeRO1(sync_batchnorm=True)),
        (
            "fsdp",
            {"precision": "bf16-mixed", "sync_batchnorm": True},
            ddpkit.FSDP(precision="bf16-mixed", sync_batchnorm=True),
        ),
        ("dp", {"device_ids": [0, 1]}, ddpkit.DataParallel(device_ids=(0, 1))),
    ],
)
def test_a_strategy_name_with_keyword_options_builds_the_same_object(name, options, expected):
    assert wrap_module._as_strategy(name, options) == expected


@pytest.mark.parametrize(
    "name,options,expected",
    [
        ("fsdp3", {}, "unknown strategy: strategy='fsdp3'. Allowed: auto, single, ddp"),
        ("single", {"sync_batchnorm": True}, "sync_batchnorm=True with strategy='single'. These"),
        ("dp", {"grad_compression": "fp16"}, "grad_compression='fp16' with strategy='dp'. These"),
        ("ddp", {"precision": "bf16-mixed"}, "precision='bf16-mixed' with strategy='ddp'. These"),
        ("fsdp", {"bucket_cap_mb": 1}, "bucket_cap_mb=1 with strategy='fsdp'. These configure"),
        ("auto", {"grad_compression": "int8"}, "invalid gradient compression: grad_compression="),
        # fsdp: PowerSGD's settings are checked (as before the objects), and refused when given
        ("fsdp", {"powersgd_rank": 0}, "invalid gradient compression: powersgd_rank=0 must be"),
        ("fsdp", {"powersgd_rank": 4}, "powersgd_rank=4 with strategy='fsdp'. These configure"),
        (
            "fsdp",
            {"powersgd_start_step": 20, "comm_stats": ddpkit.CommStats()},
            "comm_stats=CommStats(...), powersgd_start_step=20 with strategy='fsdp'. These",
        ),
    ],
)
def test_the_shim_keeps_the_refusals_of_the_keyword_form(name, options, expected):
    with pytest.raises(ddpkit.ConfigError) as info:
        ddpkit.wrap_model(nn.Linear(2, 2), SINGLE, strategy=name, **options)
    assert str(info.value).startswith(expected), str(info.value)


def test_live_needs_a_live_runtime():
    with pytest.raises(ddpkit.ConfigError, match=r"strategy=Live\(\) without live fault"):
        ddpkit.wrap_model(nn.Linear(2, 2), SINGLE, strategy=ddpkit.Live())


def test_sharded_strategies_refuse_an_optimizer_that_undoes_them():
    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ddpkit.ConfigError, match="strategy='zero1' with a SGD: ZeRO-1 shards"):
        ddpkit.ZeRO1().check_optimizer(sgd, loss_scaled=False)
    with pytest.raises(ddpkit.ConfigError, match="strategy='fsdp': the optimizer holds param"):
        ddpkit.FSDP().check_optimizer(sgd, loss_scaled=False)
    for strategy in (ddpkit.DDP(), ddpkit.Single(), ddpkit.Live()):
        strategy.check_optimizer(sgd, loss_scaled=True)  # nothing to refuse


@pytest.mark.parametrize("cls", [ddpkit.DDP, ddpkit.ZeRO1])
def test_a_ddp_object_is_replaced_rebuilt_and_copied_through_its_init_and_stays_frozen(cls):
    ddp = cls(bucket_cap_mb=5, static_graph=True)
    wider = dataclasses.replace(ddp, bucket_cap_mb=10)
    assert wider == cls(bucket_cap_mb=10, static_graph=True)
    assert wider.ddp_kwargs() == {"bucket_cap_mb": 10, "static_graph": True}
    assert cls(bucket_cap_mb=5, extra={"static_graph": True}) == ddp  # what the repr names
    assert cls(extra={"static_graph": True}, find_unused_parameters=True).ddp_kwargs() == {
        "static_graph": True,
        "find_unused_parameters": True,
    }
    assert pickle.loads(pickle.dumps(ddp)) == ddp and copy.deepcopy(ddp) == ddp
    with pytest.raises(TypeError):
        ddp.extra["static_graph"] = False  # type: ignore[index]
    with pytest.raises(ddpkit.ConfigError, match="unknown DDP option for wrap_model: bogus=1"):
        cls(extra={"bogus": 1})


@pytest.mark.parametrize("ddp", [ddpkit.FSDP(), "ddp", ddpkit.Single(), None])
def test_auto_takes_only_a_ddp_object(ddp):
    with pytest.raises(ddpkit.ConfigError) as info:
        ddpkit.Auto(ddp=ddp)
    assert str(info.value).startswith(f"invalid Auto option: ddp={ddp!r}. Auto runs DDP")
    assert "\n" not in str(info.value)


def test_a_live_job_ignores_the_gradient_sync_check_as_it_always_did():
    live = Runtime(ProcessInfo(), live=object())  # type: ignore[arg-type]  # a member alone
    net = nn.Linear(2, 2)
    assert ddpkit.wrap_model(net, live, grad_sync_check_steps=3) is net
    assert ddpkit.wrapped_strategy(net) == ddpkit.Live()


def test_each_rule_is_stated_once():
    from ddpkit.parallel import compile as compile_module
    from ddpkit.parallel import config as config_module
    from ddpkit.parallel.rules import loss_scaler_with_fsdp
    from ddpkit.settings import help_of

    with pytest.raises(ddpkit.ConfigError) as info:
        ddpkit.FSDP(precision="16-mixed")
    assert str(info.value) == f"{loss_scaler_with_fsdp('16-mixed', 'fsdp')}."
    for strategy in (ddpkit.DDP(), ddpkit.ZeRO1(), ddpkit.FSDP()):
        with pytest.raises(ddpkit.DistributedError) as raised:
            strategy.check_runtime(SINGLE)
        assert str(raised.value) == f"{strategy.problems(1)[0]}."
    two = Runtime(ProcessInfo(world_size=2, local_world_size=2))  # no process group
    ddpkit.Single().check_runtime(two)  # allowed, as before the strategy objects
    assert compile_module.DEFAULT_CHECK_STEPS is choices.DEFAULT_CHECK_STEPS
    help_text = help_of(config_module.WrapConfig.__dataclass_fields__["compile"])
    assert f"the first {choices.DEFAULT_CHECK_STEPS} optimizer steps" in help_text


def test_the_defaults_come_from_the_strategy_objects_and_the_job_builds_every_strategy():
    from ddpkit.app.mnist.config import TrainConfig
    from ddpkit.app.mnist.job import strategy_of

    assert wrap_module._FSDP_DEFAULTS == {
        "wrap_policy": None,
        "reshard_after_forward": choices.FSDP_RESHARD_AFTER_FORWARD,
        "precision": choices.FSDP_PRECISION,
    }
    assert set(wrap_module._HOOK_DEFAULTS) == {
        "grad_compression",
        "comm_stats",
        "powersgd_rank",
        "powersgd_start_step",
    }
    fsdp = TrainConfig(strategy="fsdp", reshard_after_forward=False, precision="bf16-mixed")
    assert strategy_of(fsdp, SINGLE) == ddpkit.FSDP(
        reshard_after_forward=False, precision="bf16-mixed"
    )
    assert strategy_of(TrainConfig(strategy="dp"), SINGLE) == ddpkit.DataParallel()
    assert strategy_of(TrainConfig(strategy="zero1", bucket_cap_mb=5), SINGLE) == ddpkit.ZeRO1(
        bucket_cap_mb=5
    )
    assert strategy_of(TrainConfig(), SINGLE) == ddpkit.Auto()


def test_the_recorded_strategy_does_not_keep_the_model_alive():
    from ddpkit.parallel import local_sgd

    net = nn.Linear(2, 2)
    freed = weakref.ref(net)
    strategy_module.record_strategy(net, ddpkit.FSDP(wrap_policy=lambda m, owner=net: m is owner))
    assert isinstance(ddpkit.wrapped_strategy(net), ddpkit.FSDP)
    del net
    gc.collect()
    assert freed() is None
    assert not hasattr(ddpkit.Strategy, "replicated") and not hasattr(ddpkit.Strategy, "compilable")
    assert not hasattr(local_sgd, "is_local_sgd_model")


def test_strategy_class_names_the_allowed_values_and_the_docstrings_say_what_wraps():
    with pytest.raises(ddpkit.ConfigError) as info:
        strategy_module.strategy_class("fsdp2")
    assert str(info.value).startswith(
        "unknown strategy: strategy='fsdp2'. Allowed: auto, single, ddp, dp, zero1, fsdp, live."
    )
    for wrap in (ddpkit.DDP.wrap, ddpkit.FSDP.wrap):
        assert "Collective: call on every rank" in (wrap.__doc__ or "")
        assert "WrappedModelError:" in (wrap.__doc__ or "")
    for cls in (ddpkit.DDP, ddpkit.FSDP, ddpkit.DataParallel):
        assert "ddpkit.wrapped_strategy(model)" in (cls.__doc__ or ""), cls
