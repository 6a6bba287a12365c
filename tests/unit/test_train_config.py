"""The typed settings of ``ddpkit train``: :func:`check` alone (no CLI), the resume keys marked
on the fields, and the TOML file (round trip, and one line naming key and file per mistake)."""

from __future__ import annotations

import dataclasses

import pytest

from ddpkit.app.mnist.config import SECTIONS, TrainConfig, check, resume_settings
from ddpkit.errors import ConfigError
from ddpkit.settings import read_toml, to_toml

# the hand-written list of resume_settings before the keys were marked on the fields
OLD_RESUME_KEYS = (
    "epochs",
    "batch_size",
    "lr",
    "optimizer",
    "seed",
    "max_steps",
    "sync_every",
    "grad_accum",
    "precision",
)


def _old_resume_settings(config: TrainConfig) -> dict:
    return {key: getattr(config, key) for key in OLD_RESUME_KEYS}


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(),
        TrainConfig(
            epochs=3,
            batch_size=32,
            lr=0.1,
            optimizer="sgd",
            seed=7,
            max_steps=9,
            sync_every=4,
            grad_accum=2,
            precision="bf16-mixed",
            nproc=3,
        ),
    ],
)
def test_resume_keys_are_the_old_list(config):
    settings = resume_settings(config)
    assert settings == _old_resume_settings(config)
    assert list(settings) == list(OLD_RESUME_KEYS)  # same order in the manifest as before


# (flat settings, world size or None, the words the one error must hold)
RULES = [
    (
        {"precision": "16-mixed", "on_nonfinite": "skip"},
        None,
        "precision='16-mixed' with on_nonfinite='skip'. The loss scaler already skips",
    ),
    (
        {"static_graph": True, "grad_accum": 2},
        None,
        "static_graph=True with grad_accum=2. torch's DDP breaks no_sync",
    ),
    (
        {"sync_every": 2, "grad_compression": "fp16"},
        None,
        "sync_every=2 with grad_compression='fp16'. Local SGD sends no gradients",
    ),
    (
        {"sync_every": 2, "static_graph": True},
        None,
        "sync_every=2 with static_graph=True. DDP fails in static-graph mode",
    ),
    ({"sync_every": 2, "join": True}, None, "sync_every=2 with join=True. Join cannot stand in"),
    (
        {"sync_every": 4, "check_replicas_every": 6},
        None,
        "check_replicas_every=6 with sync_every=4. It must be a multiple of sync_every",
    ),
    (
        {"sync_every": 4, "checkpoint_every": 10},
        None,
        "checkpoint_every=10 with sync_every=4. It must be a multiple of sync_every",
    ),
    ({"strategy": "single"}, 2, "strategy='single' with world_size=2. It runs in one process"),
    ({"strategy": "dp", "nproc": 3}, None, "strategy='dp' with world_size=3. It runs in one"),
    ({"strategy": "ddp"}, 1, "strategy='ddp' with world_size=1. It needs 2 or more processes"),
    (
        {"grad_compression": "fp16", "sync_batchnorm": True},
        1,
        "grad_compression='fp16', sync_batchnorm=True with strategy='single' (world_size=1). "
        "These configure DDP's gradient sync",
    ),
]


@pytest.mark.parametrize("settings,world_size,expected", RULES)
def test_each_cross_field_rule_is_raised_by_check_alone(settings, world_size, expected):
    config = TrainConfig(**settings)
    with pytest.raises(ConfigError) as caught:
        check(config, world_size=world_size)
    message = str(caught.value)
    assert message.startswith("invalid config: ") and expected in message, message
    assert "\n" not in message and message.endswith(".")
    if world_size is None and "nproc" not in settings:  # the values one at a time are fine
        for name, value in settings.items():
            check(TrainConfig(**{name: value}))
    else:  # the same config on a world size that fits it is fine
        check(config, world_size=2 if (world_size or config.nproc) == 1 else 1)


def test_the_rules_the_library_checks_are_its_own_lines():
    from ddpkit.launch.config import LaunchConfig, launch_rules
    from ddpkit.launch.spec import LaunchSpec, validate_spec
    from ddpkit.training.rules import join_with_local_sgd, static_graph_with_accumulation

    (spares,) = launch_rules(LaunchConfig(spares=1))
    assert spares.startswith("spares=1 with fault_tolerance='restart'. Spares take over lost")
    with pytest.raises(ConfigError) as caught:
        validate_spec(LaunchSpec([__file__], 2, spares=1))  # ddpkit run's check
    assert str(caught.value) == f"invalid launch: {spares}."
    static = static_graph_with_accumulation(True, 2, name="grad_accum")
    join = join_with_local_sgd(True, 2)
    for settings, line in (
        ({"spares": 1}, spares),
        ({"static_graph": True, "grad_accum": 2}, static),
        ({"sync_every": 2, "join": True}, join),
    ):
        with pytest.raises(ConfigError) as caught:
            check(TrainConfig(**settings))
        assert str(caught.value) == f"invalid config: {line}.", settings


@pytest.mark.parametrize(
    "settings,world_size,rule,args",
    [
        ({"compile": True, "strategy": "dp"}, 1, "compile_with_strategy", ("dp",)),
        ({"compile": True, "bucket_cap_mb": 0.5}, None, "compile_with_small_buckets", (0.5,)),
        (
            {"sync_every": 2, "grad_compression": "fp16"},
            None,
            "local_sgd_with_comm_hook",
            (2, "grad_compression='fp16'"),
        ),
        ({"sync_every": 2, "static_graph": True}, None, "local_sgd_with_static_graph", (2,)),
        ({"sync_every": 2, "strategy": "zero1"}, None, "local_sgd_with_sharding", ("zero1", 2)),
        (
            {"fault_tolerance": "live", "strategy": "fsdp", "compile": True},
            None,
            "live_problem",
            ("fsdp", ["compile=True"]),
        ),
        (
            {"sync_batchnorm": True},
            1,
            "ddp_options_without_ddp",
            ("single", ["sync_batchnorm=True"], 1),
        ),
        (
            {"reshard_after_forward": False},
            2,
            "fsdp_options_without_fsdp",
            ("ddp", ["reshard_after_forward=False"]),
        ),
        (
            {"strategy": "fsdp", "static_graph": True},
            2,
            "ddp_options_with_fsdp",
            ("fsdp", ["static_graph=True"]),
        ),
        (
            {"strategy": "fsdp", "precision": "16-mixed"},
            2,
            "loss_scaler_with_fsdp",
            ("16-mixed", "fsdp"),
        ),
    ],
)
def test_the_strategy_rules_are_the_librarys_lines(settings, world_size, rule, args):
    """Each strategy rule of check() is the line ddpkit.parallel.rules gives the library."""
    from ddpkit.parallel import rules

    line = getattr(rules, rule)(*args)
    assert line
    with pytest.raises(ConfigError) as caught:
        check(TrainConfig(**settings), world_size=world_size)
    assert str(caught.value) == f"invalid config: {line}.", settings


def test_run_and_train_take_the_launch_flags_from_one_declaration():
    from ddpkit.cli import build_parser
    from ddpkit.launch.config import LaunchConfig
    from ddpkit.settings import fields_of, help_of

    parsers = build_parser().get_default("subcommand_parsers")
    run, train = ({a.dest: a for a in parsers[name]._actions} for name in ("run", "train"))
    for field in fields_of(LaunchConfig):
        ours, theirs = run[field.name], train[field.name]
        assert ours.option_strings[-1] == theirs.option_strings[-1], field.name
        for what in ("type", "choices", "metavar", "default"):
            assert getattr(ours, what) == getattr(theirs, what), (field.name, what)
        # the shared help, each command adding only what holds for it alone
        assert ours.help.startswith(help_of(field).replace("%", "%%")), field.name
        assert theirs.help.startswith(help_of(field).replace("%", "%%")), field.name
    assert run["nproc"].option_strings == ["-n", "--nproc"] and run["nproc"].required
    assert "GPU" in train["nproc"].help and "GPU" not in run["nproc"].help
    assert "--nnodes" in run["max_restarts"].help and "--nnodes" not in train["max_restarts"].help


def test_defaults_pass_and_world_size_rules_wait_for_a_world_size():
    check(TrainConfig())
    check(TrainConfig(), world_size=2)
    check(TrainConfig(strategy="single"))  # no world size known yet: nothing to compare
    check(TrainConfig(sync_every=2), world_size=2)


def test_every_bad_value_is_listed_in_one_line():
    with pytest.raises(ConfigError) as caught:
        check(TrainConfig(epochs=0, lr=-1.0, optimizer="lamb", stall_timeout=1.0, nproc=0))
    message = str(caught.value)
    for expected in (
        "epochs=0 must be >= 1",
        "lr=-1.0 must be a finite number > 0",
        "optimizer='lamb' must be one of 'adam', 'adamw', 'sgd'",
        "stall_timeout=1.0 must be 0 (off) or a number of seconds >= 2 (two watchdog heartbeats)",
        "nproc=0 must be >= 1",
    ):
        assert expected in message, message
    assert "\n" not in message


def test_wrong_types_from_python_are_refused():
    with pytest.raises(ConfigError, match="grad_accum='4' must be an integer"):
        check(TrainConfig(grad_accum="4"))
    with pytest.raises(ConfigError, match="static_graph=1 must be true or false"):
        check(TrainConfig(static_graph=1))


def test_toml_round_trip_gives_the_same_config_bitwise(tmp_path):
    config = TrainConfig(
        lr=0.1 + 0.2,
        grad_accum=3,
        bucket_cap_mb=2.5,
        step_timing=False,
        resume="auto",
        download=False,
        data_dir='/some where/"q"',
    )
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config, SECTIONS))
    assert TrainConfig(**read_toml(path, SECTIONS)) == config
    defaults = tmp_path / "defaults.toml"
    defaults.write_text(to_toml(TrainConfig(), SECTIONS))
    assert TrainConfig(**read_toml(defaults, SECTIONS)) == TrainConfig()
    assert "# bucket_cap_mb = unset" in defaults.read_text()


def test_every_field_is_in_exactly_one_section():
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(TrainConfig))
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[step]\ngrad_acum = 2\n", "[step] grad_acum is not a setting (the keys of [step]:"),
        ("[run]\ngrad_accum = 2\n", "[run] grad_accum belongs in [step]"),
        ("[steps]\ngrad_accum = 2\n", "steps is not a section (sections: run, data,"),
        ("grad_accum = 2\n", "grad_accum is outside any section: it belongs in [step]"),
        ('[step]\ngrad_accum = "2"\n', "[step] grad_accum='2' must be an integer"),
        ("[step]\ngrad_accum = 2.0\n", "[step] grad_accum=2.0 must be an integer"),
        ('[observe]\nstep_timing = "on"\n', "[observe] step_timing='on' must be true or false"),
        ("[step]\ngrad_accum = 0\n", "[step] grad_accum=0 must be >= 1"),
        ('[step]\nprecision = "8"\n', "[step] precision='8' must be one of '32',"),
        ("[step\n", "config file unreadable"),
    ],
)
def test_a_bad_file_is_one_error_naming_the_key_and_the_file(tmp_path, text, expected):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        read_toml(path, SECTIONS)
    message = str(caught.value)
    assert expected in message and str(path) in message and "\n" not in message, message


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file unreadable: path=.*nope.toml"):
        read_toml(tmp_path / "nope.toml", SECTIONS)
