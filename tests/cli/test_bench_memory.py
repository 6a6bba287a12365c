"""``ddpkit bench memory``: per-rank bytes of ddp, zero1 and fsdp from the tensors themselves,
the collective payload of a step, and the goals of issue #15 checked on them."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli, run_main

WIDTH, DEPTH = 64, 4  # 4 x (64*64 + 64) float32 parameters: 66,560 bytes


@pytest.mark.slow
def test_sharded_strategies_hold_their_share_of_the_bytes(tmp_path):
    table = tmp_path / "memory.csv"
    args = [
        "-m",
        "ddpkit",
        "bench",
        "memory",
        "--max-nproc",
        "2",
        "--width",
        str(WIDTH),
        "--depth",
        str(DEPTH),
        "--rounds",
        "1",
        "--steps",
        "1",
        "--json",
        "--csv",
        str(table),
    ]
    done = run_cli(args, 240)
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    rows = {(r["strategy"], r["nproc"]): r for r in report["rows"]}
    assert sorted(rows) == [("ddp", 2), ("fsdp", 2), ("single", 1), ("zero1", 2)]
    full_mib = DEPTH * (WIDTH * WIDTH + WIDTH) * 4 / 2**20
    for key in (("single", 1), ("ddp", 2)):
        assert rows[key]["param_mib"] == pytest.approx(full_mib)
        assert rows[key]["grad_mib"] == pytest.approx(full_mib)
        assert rows[key]["optimizer_mib"] == pytest.approx(2 * full_mib + 0, rel=1e-3)  # + steps
    fsdp, zero1, ddp = rows["fsdp", 2], rows["zero1", 2], rows["ddp", 2]
    assert fsdp["param_mib"] == pytest.approx(full_mib / 2)  # 64 rows: even shards
    assert fsdp["state_fraction_of_ddp"] == pytest.approx(0.5, rel=1e-3)
    assert zero1["optimizer_fraction_of_ddp"] == pytest.approx(0.5, rel=1e-3)
    assert zero1["param_mib"] == pytest.approx(full_mib)  # ZeRO-1 keeps whole parameters
    # the payload of one step: DDP all-reduces every gradient once; ZeRO adds one broadcast of
    # the parameters; FSDP all-gathers every unit in forward and again in backward (ZeRO-3)
    # and reduce-scatters every gradient once
    assert ddp["comm_by_op_mib"] == {"ddp_all_reduce": pytest.approx(full_mib)}
    assert zero1["comm_by_op_mib"]["broadcast"] == pytest.approx(full_mib)
    assert fsdp["comm_by_op_mib"]["reduce_scatter_single"] == pytest.approx(full_mib)
    assert fsdp["comm_by_op_mib"]["all_gather_single"] >= full_mib
    assert all(r["samples_per_s"] > 0 and r["peak_rss_mib"] > 0 for r in rows.values())
    assert all(r["peak_rss_mib_default_malloc"] > 0 for r in rows.values())
    assert report["goals"] == [
        "zero1 x 2: optimizer state 0.500 of ddp's (goal <= 0.550): met",
        "fsdp x 2: params+grads+optimizer 0.500 of ddp's (goal <= 0.550): met",
    ]
    assert table.read_text().splitlines()[0].startswith("strategy,nproc,param_mib,")


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--strategies", "hsdp"], "unknown strategy 'hsdp'"),
        (["--max-nproc", "0", "--warmup", "0"], "--max-nproc 0 must be >= 1; --warmup 0 must be"),
        (["--timeout", "0"], "--timeout 0.0 must be > 0 seconds"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, extra, expected):
    code, err = run_main(["bench", "memory", *extra], capsys)
    assert code == 2
    assert expected in err and len(err.strip().splitlines()) == 1, err
