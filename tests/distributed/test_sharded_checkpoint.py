"""Sharded checkpoints through torch.distributed.checkpoint (DCP), for ``fsdp`` and ``zero1``.

Every rank writes its own shard; the step folder appears complete or not at all; a resume is
bitwise exact mid-epoch on the same world size, and reshards to another one (2 -> 3, 3 -> 2)
with the model and optimizer state exactly as saved and the losses going on as the
uninterrupted run's; ``ddpkit checkpoint export`` turns one into a plain state-dict file.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.checkpoint.lock import LOCK_NAME
from ddpkit.testing import DistributedTestError, run_distributed
from tests.helpers import run_cli

NUM_SAMPLES, GLOBAL_BATCH = 60, 12  # 5 optimizer steps per epoch at any world size
TOTAL_STEPS, STOP = 8, 3  # stopped mid-epoch 1, continued into epoch 2
# The largest |loss - uninterrupted| / |uninterrupted| over the steps after a resize (pytest -s
# prints it; 2 cores, torch 2.13.0+cpu; docs/checkpoints.md gives the figures): the bound
# leaves 10x room for other CPUs' kernels.
RESIZE_LOSS_RTOL = 1e-6  # measured: 9.3e-8


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, 8, generator=gen)
    return TensorDataset(x, x[:, :4].argmax(dim=1))


def _net() -> nn.Module:
    torch.manual_seed(0)  # rows of 33 and 17: uneven shards on 2 and 3 ranks
    return nn.Sequential(
        nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 4)
    )


def _full_optimizer(model, optimizer, strategy: str, rt):
    """The whole optimizer state on rank 0 (None elsewhere), the same keys at any world size."""
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(model, [optimizer], options=options)[1] or None
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if rt.is_rank_zero else None


def _snapshot(model, optimizer, strategy: str, rt) -> dict:
    """Copies (training goes on in place) of rank 0's full model and optimizer state."""
    return copy.deepcopy(
        {
            "model": ddpkit.model_state_dict(model),
            "optimizer": _full_optimizer(model, optimizer, strategy, rt),
            "lr": optimizer.param_groups[0]["lr"],
        }
    )


def _run(rt, strategy: str, directory: str, stop_after: int | None, resume: bool) -> dict:
    """Train to TOTAL_STEPS (or save at ``stop_after`` and stop). Returns the global loss of
    every step, and rank 0's full model and optimizer state when it stops or right after the
    resume."""
    torch.manual_seed(0 if not resume else 99)  # a resumed run must not depend on its seed
    model = ddpkit.wrap_model(_net(), rt, strategy=strategy)
    if strategy == "zero1":
        optimizer = ddpkit.build_zero_optimizer(
            model.parameters(), rt, optimizer_class=torch.optim.AdamW, lr=1e-2
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    loader = ddpkit.build_train_loader(
        _dataset(), rt, batch_size=GLOBAL_BATCH // rt.world_size, seed=3
    )
    state = {"model": model, "optimizer": optimizer, "scheduler": schedule, "loader": loader}
    ckpt = ddpkit.CheckpointManager(directory, rt, state=state, keep_last=2)
    step = ckpt.resume() if resume else 0
    out: dict = {"resumed_at": step, "losses": {}}
    if resume:
        out.update(_snapshot(model, optimizer, strategy, rt))
    train_step = ddpkit.TrainStep(model, optimizer, runtime=rt, start_step=step)
    while step < TOTAL_STEPS:
        for result in ddpkit.train_epoch(train_step, loader):
            step = result.step
            schedule.step()
            total = ddpkit.all_reduce_sum([result.loss_sum], rt)[0]
            out["losses"][step] = float(total) / result.num_samples_global
            if step == stop_after:
                ckpt.save(step)
                return {**out, **_snapshot(model, optimizer, strategy, rt)}
            if step == TOTAL_STEPS:
                break
    out["final"] = ddpkit.model_state_dict(model)
    return out


def _same(a, b) -> bool:
    """Bitwise equality of nested state (tensors, numbers, lists, dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """``get(strategy, world_size)``: the uninterrupted run (``_run`` to TOTAL_STEPS, no
    resume) that several tests compare with, launched once per module: the same launch."""
    runs: dict[tuple[str, int], list] = {}

    def get(strategy: str, world_size: int) -> list:
        if (strategy, world_size) not in runs:
            directory = str(tmp_path_factory.mktemp(f"ref-{strategy}-{world_size}"))
            args = (strategy, directory, None, False)
            runs[strategy, world_size] = run_distributed(_run, world_size, args=args, timeout_s=150)
        return runs[strategy, world_size]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_resume_mid_epoch_is_bitwise_and_every_rank_wrote_its_shard(
    tmp_path, strategy, reference_run
):
    run = str(tmp_path / "run")
    reference = reference_run(strategy, 2)
    first = run_distributed(_run, 2, args=(strategy, run, STOP, False), timeout_s=120)
    folder = tmp_path / "run" / f"step-{STOP:08d}"
    manifest = json.loads((folder / "manifest.json").read_text())
    names = sorted(p.name for p in (folder / "dcp").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank
    assert set(manifest["files"]) == {"state.pt", *(f"dcp/{n}" for n in names)}
    layout = {
        "fsdp": {"model": "fsdp_model", "optimizer": "fsdp_optimizer"},
        "zero1": {"optimizer": "zero_optimizer"},
    }[strategy]
    assert manifest["sharded"] == layout
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".tmp")]
    resumed = run_distributed(_run, 2, args=(strategy, run, None, True), timeout_s=120)
    assert resumed[0]["resumed_at"] == STOP
    assert _same(resumed[0]["model"], first[0]["model"])
    assert _same(resumed[0]["optimizer"], first[0]["optimizer"])
    for step in range(STOP + 1, TOTAL_STEPS + 1):  # mid-epoch 1 into epoch 2, bit for bit
        assert resumed[0]["losses"][step] == reference[0]["losses"][step], step
    assert _same(resumed[0]["final"], reference[0]["final"])


def _resize(tmp_path, strategy: str, before: int, after: int, reference_run) -> float:
    directory = str(tmp_path / f"{strategy}-{before}-{after}")
    reference = reference_run(strategy, before)
    first = run_distributed(_run, before, args=(strategy, directory, STOP, False), timeout_s=150)
    resumed = run_distributed(_run, after, args=(strategy, directory, None, True), timeout_s=150)
    assert resumed[0]["resumed_at"] == STOP
    # resharded exactly: the whole model and optimizer state, as saved on `before` ranks
    assert _same(resumed[0]["model"], first[0]["model"])
    assert _same(resumed[0]["optimizer"], first[0]["optimizer"])
    assert resumed[0]["lr"] == first[0]["lr"]
    ref = reference[0]["losses"]
    rel = max(abs(resumed[0]["losses"][s] - ref[s]) / abs(ref[s]) for s in range(STOP + 1, 9))
    print(f"{strategy} {before}->{after}: largest relative loss difference {rel:.3g}")
    return rel


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_a_checkpoint_saved_on_n_ranks_resumes_on_m(tmp_path, strategy, reference_run):
    for before, after in ((2, 3), (3, 2)):
        assert _resize(tmp_path, strategy, before, after, reference_run) <= RESIZE_LOSS_RTOL


def _killed_writer(rt, directory: str, kill_at: int) -> None:
    """Save at steps 1 and 2; at ``kill_at`` rank 1 dies while DCP writes its shard."""
    import torch.distributed.checkpoint as dcp

    model = ddpkit.wrap_model(_net(), rt, strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = ddpkit.CheckpointManager(directory, rt, state={"model": model, "optimizer": optimizer})
    write = dcp.FileSystemWriter.write_data

    def dying(self, plan, planner):
        os._exit(9)  # like SIGKILL: no cleanup, no exception

    for step in range(1, kill_at + 1):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        if step == kill_at and rt.rank == 1:
            dcp.FileSystemWriter.write_data = dying
        ckpt.save(step)
    dcp.FileSystemWriter.write_data = write


def _resume_step(rt, directory: str) -> int:
    model = ddpkit.wrap_model(_net(), rt, strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ddpkit.CheckpointManager(
        directory, rt, state={"model": model, "optimizer": optimizer}
    ).resume()


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_no_complete_folder_and_resume_falls_back(tmp_path):
    with pytest.raises(DistributedTestError, match="rank 1 died with exit code 9"):
        run_distributed(_killed_writer, 2, args=(str(tmp_path), 3), timeout_s=90)
    complete = sorted(p.name for p in tmp_path.iterdir() if (p / "manifest.json").is_file())
    assert complete == ["step-00000001", "step-00000002"]
    assert not (tmp_path / "step-00000003").exists()  # only a .tmp- folder, never a step-
    assert run_distributed(_resume_step, 2, args=(str(tmp_path),), timeout_s=90) == [2, 2]
    # a corrupted shard of the newest one: resume falls back to the previous, saying so
    shard = tmp_path / "step-00000002" / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8])
    assert run_distributed(_resume_step, 3, args=(str(tmp_path),), timeout_s=90) == [1, 1, 1]


def _peer_lost_mid_save(rt, directory: str, async_save: bool) -> None:
    """Save at step 1; at step 2 rank 1 stops answering inside DCP's write (a peer hung or
    killed: rank 0's collectives fail). Rank 1 stays hung after rank 0 has cleaned up, until the
    harness kills it on rank 0's error: were it to raise once the folder is gone, its error could
    reach the harness before rank 0's (which the test expects)."""
    import time

    import torch.distributed.checkpoint as dcp

    model = ddpkit.wrap_model(_net(), rt, strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = ddpkit.CheckpointManager(
        directory, rt, state={"model": model, "optimizer": optimizer}, async_save=async_save
    )
    ckpt.save(1)
    ckpt.wait()

    def lost(self, plan, planner):
        time.sleep(60)  # hung: rank 0's collective times out (5 s), it cleans up and raises
        raise RuntimeError("rank 1 lost")  # only if rank 0 never did (the harness kills us)

    if rt.rank == 1:
        dcp.FileSystemWriter.write_data = lost
    ckpt.save(2)
    ckpt.wait()


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_a_peer_lost_mid_save_leaves_no_temporary_folder(tmp_path, async_save):
    with pytest.raises(DistributedTestError, match="rank 0 raised"):
        run_distributed(
            _peer_lost_mid_save, 2, args=(str(tmp_path), async_save), timeout_s=90, pg_timeout_s=5
        )
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME)  # the job's lock
    assert left == ["step-00000001"]  # no .tmp- left


@pytest.mark.slow
def test_export_gives_a_plain_state_dict_file(tmp_path):
    saved = {
        "fsdp": run_distributed(
            _run, 2, args=("fsdp", str(tmp_path / "fsdp"), STOP, False), timeout_s=120
        )[0]["model"],
        "zero1": run_distributed(
            _run, 3, args=("zero1", str(tmp_path / "zero1"), STOP, False), timeout_s=120
        )[0]["model"],
    }
    for strategy in ("fsdp", "zero1"):
        out = tmp_path / f"{strategy}.pt"
        done = run_cli(
            ["-m", "ddpkit", "checkpoint", "export", str(tmp_path / strategy), "--output", str(out)]
        )
        assert done.returncode == 0, done.output
        assert done.stderr == ""  # torch's no-process-group warning is for an accidental load
        source = "dcp" if strategy == "fsdp" else "state.pt"
        assert (
            f"exported state['model'] of {tmp_path / strategy / 'step-00000003'} ({source})"
            in done.stdout
        )
        net = _net()
        net.load_state_dict(torch.load(out, weights_only=True))  # strict: every key, no prefix
        assert _same(net.state_dict(), saved[strategy])
    exported = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    assert exported["0.weight"].shape == (33, 8)
    shard = tmp_path / "fsdp" / "step-00000003" / "dcp" / "__0_0.distcp"
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    bad = run_cli(
        [
            "-m",
            "ddpkit",
            "checkpoint",
            "export",
            str(shard.parent.parent),
            "--output",
            str(tmp_path / "x.pt"),
        ]
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("ddpkit checkpoint: error: corrupt checkpoint: path=")
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.pt").exists()


def _async_run(rt, directory: str) -> dict:
    """Save step STOP asynchronously, train two more steps while it is written, then commit."""
    model = ddpkit.wrap_model(_net(), rt, strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    loader = ddpkit.build_train_loader(
        _dataset(), rt, batch_size=GLOBAL_BATCH // rt.world_size, seed=3
    )
    state = {"model": model, "optimizer": optimizer, "scheduler": schedule, "loader": loader}
    ckpt = ddpkit.CheckpointManager(directory, rt, state=state, async_save=True)
    train_step = ddpkit.TrainStep(model, optimizer, runtime=rt)
    out: dict = {}
    for result in ddpkit.train_epoch(train_step, loader):
        schedule.step()
        if result.step == STOP:
            folder = ckpt.save(STOP)
            out.update(_snapshot(model, optimizer, "fsdp", rt))
            out["folder_before_wait"] = folder.exists()
        if result.step == STOP + 2:  # the parameters changed while the shards were written
            out["committed"] = str(ckpt.wait())
            out["folder_after_wait"] = folder.exists()
            out["wait_again"] = ckpt.wait()
            return out
    raise AssertionError("the epoch ended early")


@pytest.mark.slow
def test_async_save_commits_at_wait_and_resumes_bitwise(tmp_path, reference_run):
    reference = reference_run("fsdp", 2)
    saved = run_distributed(_async_run, 2, args=(str(tmp_path / "run"),), timeout_s=120)
    assert saved[0]["folder_before_wait"] is False  # never a step- folder before the commit
    assert saved[0]["folder_after_wait"] is True and saved[0]["wait_again"] is None
    assert saved[0]["committed"] == str(tmp_path / "run" / f"step-{STOP:08d}")
    resumed = run_distributed(
        _run, 2, args=("fsdp", str(tmp_path / "run"), None, True), timeout_s=120
    )
    assert resumed[0]["resumed_at"] == STOP
    assert _same(resumed[0]["model"], saved[0]["model"])  # as at save time, not 2 steps later
    assert _same(resumed[0]["optimizer"], saved[0]["optimizer"])
    for step in range(STOP + 1, TOTAL_STEPS + 1):
        assert resumed[0]["losses"][step] == reference[0]["losses"][step], step
