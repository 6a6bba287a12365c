"""wrap_model in one process (``python train.py``): DDP options do nothing and say so (#16 §4).

The same script on 2 ranks: tests/e2e/test_readme_example.py (a BatchNorm CNN with
``sync_batchnorm=True``), tests/distributed/test_sync_batchnorm.py.
"""

from __future__ import annotations

import logging

import pytest
from torch import nn

import ddpkit
from ddpkit.env import ProcessInfo
from ddpkit.runtime.process_group import Runtime

SINGLE = Runtime(ProcessInfo())


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def test_ddp_options_at_one_process_are_a_no_op_with_one_info_line(caplog):
    net = _cnn()
    options = {
        "sync_batchnorm": True,
        "grad_compression": "fp16",
        "bucket_cap_mb": 5,
        "find_unused_parameters": True,
        "static_graph": True,
    }
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        model = ddpkit.wrap_model(net, SINGLE, comm_stats=ddpkit.CommStats(), **options)
    assert model is net and type(model[1]) is nn.BatchNorm2d  # not converted, not wrapped
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ddpkit.parallel"]
    assert line.endswith(
        " grad_compression='fp16', sync_batchnorm=True, bucket_cap_mb=5, "
        "find_unused_parameters=True, static_graph=True: DDP options, in effect with 2 or "
        "more processes; at world_size=1 they do nothing."
    ), line
    assert line.startswith("wrap_model: world_size=1, so the module itself is returned")


def test_without_ddp_options_the_info_line_does_not_mention_them(caplog):
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        ddpkit.wrap_model(_cnn(), SINGLE)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ddpkit.parallel"]
    assert "DDP options" not in line


def test_an_unknown_ddp_keyword_fails_at_one_process_too():
    with pytest.raises(ddpkit.ConfigError) as info:
        ddpkit.wrap_model(_cnn(), SINGLE, bucket_capmb=5)
    message = str(info.value)
    assert message.startswith("unknown DDP option for wrap_model: bucket_capmb=5. ")
    assert "bucket_cap_mb" in message and message.endswith("Fix the name or drop it.")


def test_an_explicit_single_strategy_still_refuses_ddp_options():
    with pytest.raises(ddpkit.ConfigError, match=r"sync_batchnorm=True with strategy='single'\. "):
        ddpkit.wrap_model(_cnn(), SINGLE, strategy="single", sync_batchnorm=True)
