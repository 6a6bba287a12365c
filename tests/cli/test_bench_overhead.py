"""``ddpkit bench overhead``: every form runs the same work, the ratios are per-round medians,
and bad input is one line with exit status 2.

The small run (1 round, 1 warm-up + 4 timed steps, 2 processes per form, local SGD averaging
every 5 steps) is shared by the tests that read its JSON; it starts 2 x 6 fresh processes.
"""

from __future__ import annotations

import csv
import json
import re

import pytest

from ddpkit.bench import options, overhead, steploop
from ddpkit.errors import DistributedError
from tests.helpers import run_cli, run_main

pytestmark = pytest.mark.slow  # each test runs whole benchmark rounds


FORMS = ("raw_ddp", "ddpkit", "accelerate", "fabric", "no_sync")
SMALL = ["--rounds", "1", "--steps", "4", "--warmup", "1", "--sync-every", "5"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    table = tmp_path_factory.mktemp("bench") / "overhead.csv"
    args = ["-m", "ddpkit", "bench", "overhead", *SMALL, "--json", "--csv", str(table)]
    done = run_cli(args, timeout_s=200)
    assert done.returncode == 0, done.output
    return json.loads(done.stdout), table


def test_json_holds_every_form_with_per_round_ratios(small_run):
    report, table = small_run
    assert set(FORMS) <= set(report) and report["skipped"] == {}
    raw, no_sync = report["raw_ddp"], report["no_sync"]
    assert raw["ratio_to_raw_ddp"] == 1.0 and no_sync["ratio_to_no_sync"] == 1.0
    for form in (*FORMS, "ddpkit_local_sgd"):
        entry = report[form]
        assert entry["samples_per_s"] > 0
        assert entry["samples_per_s_per_round"] == [entry["samples_per_s"]]  # 1 round
        rate = entry["samples_per_s"]
        assert entry["ratio_to_raw_ddp"] == pytest.approx(rate / raw["samples_per_s"], rel=1e-12)
        assert entry["ratio_to_no_sync"] == pytest.approx(rate / no_sync["samples_per_s"], 1e-12)
    settings = report["settings"]
    assert settings["nproc"] == 2 and settings["batch_size_per_rank"] == 64
    assert settings["local_sgd_period"] == 5
    assert (settings["num_steps"], settings["num_warmup_steps"], settings["rounds"]) == (4, 1, 1)
    assert settings["data"].startswith("random MNIST-shaped") and settings["omp_num_threads"] >= 1
    assert report["machine"]["torch"]
    rows = list(csv.DictReader(table.open()))
    assert [row["form"] for row in rows] == [*FORMS, "ddpkit_local_sgd"]
    assert float(rows[0]["samples_per_s"]) == pytest.approx(raw["samples_per_s"])


def test_forms_do_the_same_work_and_no_sync_does_not_sync(small_run):
    # Same seed, data order, batch and optimizer: after 1 + 4 steps every synced form holds the
    # same parameters on every rank (Accelerate splits each global batch across the ranks in
    # another order, so the float sums differ in the last digits). A form that skipped the
    # gradient sync would have differing replicas; one with another batch or data order ends
    # far away (no_sync, which trains each rank on its own half, is the proof that it shows).
    report, _ = small_run
    raw = report["raw_ddp"]["param_checksum_per_rank"]
    assert raw[0] == pytest.approx(raw[1], abs=1e-9)
    for form in ("ddpkit", "accelerate", "fabric"):
        sums = report[form]["param_checksum_per_rank"]
        assert sums[0] == pytest.approx(sums[1], abs=1e-9), form
        assert sums[0] == pytest.approx(raw[0], rel=1e-6, abs=0), form
    alone = report["no_sync"]["param_checksum_per_rank"]
    assert abs(alone[0] - alone[1]) > 1e-3
    assert abs(alone[0] - raw[0]) > 1e-3
    # local SGD: each rank steps on its own gradients, parameters averaged after step 5 (the
    # last of 1 + 4): replicas equal, and neither the synced path nor one rank alone
    local = report["ddpkit_local_sgd"]["param_checksum_per_rank"]
    assert local[0] == pytest.approx(local[1], abs=1e-9)
    assert abs(local[0] - raw[0]) > 1e-4 and min(abs(local[0] - a) for a in alone) > 1e-4


def test_ratios_are_medians_of_the_per_round_quotients():
    def result(rate):
        return {"samples_per_s": rate, "param_checksums": [0.0, 0.0]}

    rounds = [
        {"raw_ddp": result(100.0), "ddpkit": result(110.0), "no_sync": result(200.0)},
        {"raw_ddp": result(50.0), "ddpkit": result(45.0), "no_sync": result(60.0)},
        {"raw_ddp": result(80.0), "ddpkit": result(84.0), "no_sync": result(90.0)},
    ]
    summary = overhead.summarize(rounds, ["raw_ddp", "ddpkit", "no_sync"])
    assert summary["ddpkit"]["samples_per_s"] == 84.0
    assert summary["ddpkit"]["ratio_to_raw_ddp"] == pytest.approx(1.05)  # 1.1, 0.9, 1.05
    # quotients .55, .75, .93: the median is .75, the quotient of the medians 84/90 = .93
    assert summary["ddpkit"]["ratio_to_no_sync"] == pytest.approx(0.75)
    assert summary["raw_ddp"]["ratio_to_raw_ddp"] == 1.0
    assert summary["raw_ddp"]["ratio_to_no_sync"] == pytest.approx(50.0 / 60.0)  # not 80/90
    assert summary["ddpkit"]["samples_per_s_per_round"] == [110.0, 45.0, 84.0]
    assert [overhead.rotated(["a", "b", "c"], i)[0] for i in range(3)] == ["a", "b", "c"]


def test_missing_optional_package_is_skipped_with_the_install_hint(monkeypatch):
    monkeypatch.setattr(options, "is_installed", lambda form: form != "fabric")
    forms, skipped = options.check_forms(None, "fp16", local_sgd=True)
    assert forms == [
        *("raw_ddp", "ddpkit", "accelerate", "no_sync"),
        "ddpkit_fp16",
        "ddpkit_local_sgd",
    ]
    assert skipped == {"fabric": "not installed: pip install 'ddpkit[bench]'"}


def test_a_failing_form_is_one_line_naming_it():
    settings = steploop.StepLoopSettings(num_steps=1, num_warmup_steps=0, timeout_s=60)
    with pytest.raises(DistributedError) as info:
        steploop.run_form("ddpkit_nosuch", 2, settings)  # wrap_model refuses the compression
    message = str(info.value)
    # both ranks raise; the first failure stops the other, which may not have reported yet
    expected = r"form ddpkit_nosuch failed on 2 process\(es\) \([12] of 2 rank\(s\) failed\)"
    assert re.match(expected, message), message
    assert "grad_compression='nosuch'" in message and "\n" not in message


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--forms", "raw_ddp", "horovod"], "unknown form 'horovod'"),
        (["--rounds", "0", "--steps", "0"], "--rounds 0 must be >= 1; --steps 0 must be >= 1"),
        (["--steps", "100000"], "= 12801280 samples exceed 60000 (MNIST's training set"),
        (["--nproc", "1"], "--nproc 1 must be >= 2"),
        (["--sync-every", "1"], "--sync-every 1 must be >= 2 (1 is plain DDP)"),
        (["--data-dir", "{tmp}/no-such-dir"], "data dir not found"),
        (["--forms", "fabric"], "form fabric asked for but not installed: pip install"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, extra, expected):
    monkeypatch.setattr(options, "is_installed", lambda form: form != "fabric")
    argv = ["bench", "overhead", *[e.format(tmp=tmp_path) for e in extra]]
    code, err = run_main(argv, capsys)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err
