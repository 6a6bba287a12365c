"""``ddpkit train`` refuses bad input with one line and exit status 2, writing nothing."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.helpers import run_cli, run_main


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--data-dir", "{tmp}/no-such-dir"], "data dir not found"),
        (["--dataset", "cifar"], "argument --dataset: invalid choice: 'cifar'"),
        (["--nproc", "0"], "nproc=0 must be >= 1"),
        (["--batch-size", "sixty-four"], "argument --batch-size: invalid int value"),
        (["--output-dir", "{tmp}/a-file/out"], "is a file, not a folder"),
        (["--epochs", "0", "--lr", "-1"], "epochs=0 must be >= 1. lr=-1.0 must be a finite"),
        (["--train-timeout", "inf"], "train_timeout=inf must be a finite number > 0"),
        (["--bogus", "1"], "ddpkit train: error: unrecognized arguments: --bogus 1"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, extra, expected):
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "out"
    argv = ["train", "--output-dir", str(out), *[e.format(tmp=tmp_path) for e in extra]]
    code, err = run_main(argv, capsys)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not out.exists()


def test_data_dir_without_mnist_files_names_them(tmp_path, capsys):
    code, err = run_main(
        ["train", "--data-dir", str(tmp_path), "--output-dir", str(tmp_path / "o")], capsys
    )
    assert code == 2
    assert "missing train-images-idx3-ubyte" in err and "t10k-labels-idx1-ubyte" in err


@pytest.mark.slow
def test_corrupt_data_is_refused_before_any_worker_starts(mnist_dir, tmp_path, capsys):
    import gzip
    import shutil

    data = tmp_path / "data"
    shutil.copytree(mnist_dir, data)
    good = gzip.decompress((data / "t10k-images-idx3-ubyte.gz").read_bytes())
    (data / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(good)[:-200])  # truncated
    out = tmp_path / "out"
    code, err = run_main(["train", "--data-dir", str(data), "--output-dir", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "t10k-images-idx3-ubyte.gz" in err and "download it again" in err
    assert not out.exists()


def test_slurm_task_trains_in_place_instead_of_launching(tmp_path, capsys, monkeypatch):
    # an srun task of a 2-task step must join that job, not start 2 ranks of its own
    for name, value in {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}.items():
        monkeypatch.setenv(name, value)
    code, err = run_main(
        ["train", "--dataset", "digits", "--output-dir", str(tmp_path / "o")], capsys
    )
    assert code == 2
    assert "MASTER_ADDR, MASTER_PORT not set (launcher=slurm). Under srun, export" in err


@pytest.mark.slow
def test_console_error_has_no_traceback(tmp_path):
    result = run_cli(
        ["-m", "ddpkit", "train", "--data-dir", str(tmp_path / "missing")], timeout_s=60
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("ddpkit train: error: data dir not found")


def test_resume_with_other_settings_is_refused_before_launch(tmp_path, capsys):
    import torch

    from ddpkit.checkpoint.io import write_checkpoint

    out = tmp_path / "run"
    settings = {
        "epochs": 1,
        "batch_size": 64,
        "lr": 0.003,
        "optimizer": "adam",
        "seed": 0,
        "max_steps": 0,
        "dataset": "digits",
    }
    write_checkpoint(out / "checkpoints", 8, {"step": 8}, {"world_size": 2, "extra": settings})
    (out / "summary.json").write_text("{}")
    code, err = run_main(
        [
            "train",
            "--dataset",
            "digits",
            "--nproc",
            "3",
            "--batch-size",
            "32",
            "--resume",
            "auto",
            "--output-dir",
            str(out),
        ],
        capsys,
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "batch_size 64 (this job: 32)" in err  # 32 x 3 is another global batch than 64 x 2
    assert (out / "summary.json").exists()  # nothing of the earlier run was removed
    assert torch.load(out / "checkpoints" / "step-00000008" / "state.pt")["step"] == 8


def _checkpoint_of_two_ranks(out, sharded=None, **settings):
    from ddpkit.app.mnist.config import TrainConfig
    from ddpkit.app.mnist.resume import BatchPlan, checkpoint_settings
    from ddpkit.checkpoint.io import write_checkpoint

    config = TrainConfig(**settings)
    requested = (config.batch_size, config.grad_accum)
    plan = BatchPlan(*requested, requested[0] * requested[1] * 2, requested)
    extra = checkpoint_settings(config, "digits", plan)
    meta = {"world_size": 2, "extra": extra, **({"sharded": sharded} if sharded else {})}
    write_checkpoint(out / "checkpoints", 8, {"step": 8}, meta)


def test_resume_on_processes_that_cannot_keep_the_global_batch_lists_those_that_can(
    tmp_path, capsys
):
    out = tmp_path / "run"
    _checkpoint_of_two_ranks(out)  # global batch 64 x 1 x 2 = 128
    argv = ["train", "--dataset", "digits", "--epochs", "1", "--nproc", "3", "--resume", "auto"]
    code, err = run_main([*argv, "--output-dir", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "on 3 process(es), written on 2" in err and "global_batch_size=128" in err
    assert "numbers of ranks: 1, 2, 4, 8, 16, 32, 64, 128" in err


def test_resume_that_splits_into_micro_steps_is_checked_like_a_fresh_config(tmp_path, capsys):
    out = tmp_path / "run"
    _checkpoint_of_two_ranks(out)  # 64 x 1 x 2; --static-graph is fine with 1 micro-step
    argv = ["train", "--dataset", "digits", "--epochs", "1", "--nproc", "1", "--static-graph"]
    code, err = run_main([*argv, "--resume", "auto", "--output-dir", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "static_graph=True with grad_accum=2" in err  # 64 x 2 on one process


def test_version_names_ddpkit_and_torch(capsys):
    import torch

    import ddpkit
    from ddpkit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"ddpkit {ddpkit.__version__} with torch {torch.__version__}"


@pytest.mark.parametrize(
    "saved,strategy,expected",
    [
        (
            {"model": "fsdp_model", "optimizer": "fsdp_optimizer"},
            "zero1",
            "holds state['optimizer'] as fsdp_optimizer; this job's state['optimizer'] is a "
            "ZeroRedundancyOptimizer (--strategy zero1)",
        ),
        (
            {"optimizer": "zero_optimizer"},
            "fsdp",
            "holds state['model'] as unsharded (state.pt); this job's state['model'] is an FSDP "
            "model (--strategy fsdp)",
        ),
        (None, "fsdp", "holds state['model'] as unsharded (state.pt)"),
    ],
)
def test_resume_with_a_strategy_the_checkpoint_cannot_load_is_refused_before_launch(
    tmp_path, capsys, saved, strategy, expected
):
    # the workers would refuse it after their start-up (exit 1, "job FAILED"): say it here
    out = tmp_path / "run"
    _checkpoint_of_two_ranks(out, sharded=saved)
    argv = ["train", "--dataset", "digits", "--epochs", "1", "--nproc", "2", "--resume", "auto"]
    code, err = run_main([*argv, "--strategy", strategy, "--output-dir", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert expected in err and "Resume with the strategy it was saved with" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # nothing written


def test_a_fresh_run_in_a_folder_holding_an_earlier_run_is_refused_and_nothing_is_lost(
    tmp_path, capsys
):
    out = tmp_path / "out"
    earlier = {  # an earlier run's checkpoints and outputs (or files of the user's own)
        "checkpoints/step-00000200/state.pt": b"200",
        "checkpoints/step-00000322/state.pt": b"322",
        "summary.json": b"{}",
        "model.pt": b"mine",
        "metrics.csv": b"epoch\n1\n",
    }
    for name, data in earlier.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    argv = [
        "train",
        "--dataset",
        "digits",
        "--nproc",
        "1",
        "--epochs",
        "1",
        "--max-steps",
        "2",
        "--output-dir",
        str(out),
        "--progress",
        "off",
    ]
    code, err = run_main(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        f"--output-dir {out} holds an earlier run (checkpoints/step-00000322, "
        "checkpoints/step-00000200, summary.json, model.pt and 1 more), which a fresh run would "
        "delete: continue it with --resume auto, or start afresh in another --output-dir, or "
        "pass --overwrite to delete it." in err
    )
    assert {n: (out / n).read_bytes() for n in earlier} == earlier  # nothing touched
    code, err = run_main([*argv, "--overwrite"], capsys)
    assert code == 0, err
    assert not (out / "checkpoints" / "step-00000322").exists()
    assert json.loads((out / "summary.json").read_text())["final_step"] == 2
    # that run saved no checkpoint: --resume auto has nothing to continue and would replace it
    code, err = run_main([*argv, "--resume", "auto"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        f"--output-dir {out} holds a finished run without checkpoints (summary.json, model.pt, "
    ) in err and ": --resume auto has nothing to continue, and a fresh run would delete it" in err


def test_what_the_workers_would_refuse_is_refused_before_they_start(tmp_path, capsys):
    import torch

    import ddpkit
    from ddpkit.env import ProcessInfo
    from ddpkit.runtime.process_group import Runtime

    model = torch.nn.Linear(4, 4)  # an own loop's checkpoint, not ddpkit train's
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    ddpkit.CheckpointManager(tmp_path / "ck", Runtime(ProcessInfo()), state=state).save(5)
    argv = ["train", "--dataset", "digits", "--nproc", "2", "--output-dir", str(tmp_path / "o")]
    code, err = run_main([*argv, "--resume", str(tmp_path / "ck" / "step-00000005")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"checkpoint {tmp_path / 'ck' / 'step-00000005'} was not written by ddpkit train" in err
    if not torch.cuda.is_available():
        code, err = run_main([*argv, "--backend", "nccl"], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "backend=nccl needs one CUDA device per local rank" in err
    assert not (tmp_path / "o").exists()  # no worker started, nothing written


def test_resume_auto_with_every_checkpoint_unreadable_keeps_them_aside(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "train",
        "--dataset",
        "digits",
        "--nproc",
        "1",
        "--epochs",
        "1",
        "--max-steps",
        "4",
        "--checkpoint-every",
        "2",
        "--output-dir",
        str(out),
        "--progress",
        "off",
    ]
    assert run_main(argv, capsys)[0] == 0
    torn = {}
    for folder in sorted((out / "checkpoints").glob("step-*")):
        (folder / "state.pt").write_bytes(
            torn.setdefault(folder.name, b"torn " + folder.name.encode())
        )
    code, err = run_main([*argv, "--resume", "auto"], capsys)
    assert code == 0, err  # it starts at step 0, saying why, and trains the run again
    assert err.count("nothing was deleted") == 2, err
    aside = out / "checkpoints" / "set-aside"
    assert {name: (aside / name / "state.pt").read_bytes() for name in torn} == torn
    assert json.loads((out / "summary.json").read_text())["final_step"] == 4


def test_a_one_process_run_that_fails_names_its_newest_checkpoint_and_the_resume(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "train",
        "--dataset",
        "digits",
        "--nproc",
        "1",
        "--epochs",
        "1",
        "--optimizer",
        "sgd",
        "--lr",
        "1e9",
        "--on-nonfinite",
        "raise",
        "--checkpoint-every",
        "1",
        "--output-dir",
        str(out),
        "--progress",
        "off",
    ]
    code, err = run_main(argv, capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err  # no launcher: this line
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    resume = shlex.join(["ddpkit", *argv, "--resume", "auto"])
    assert err.startswith("ddpkit train: error: non-finite loss at step "), err
    assert err.strip().endswith(
        f"skip such steps (mode='skip'); the newest complete checkpoint is {newest.name} in "
        f"{out / 'checkpoints'}; resume with: {resume}."
    ), err
