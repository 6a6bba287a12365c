"""The MNIST CNN step loop in the forms ``ddpkit bench overhead`` and ``scaling`` compare.

Every form does the same work: :class:`~ddpkit.app.mnist.model.MnistCNN` from the same seed,
``ddpkit train``'s default optimizer (Adam, lr 3e-3, constant here), cross-entropy, ``batch_size``
samples per rank per step, the same data order (``DistributedSampler`` semantics, seed 0, epoch 0:
global step ``i`` trains on permutation positions ``[i*B*W, (i+1)*B*W)`` in every form), W
warm-up steps then K timed steps between two barriers. Each form is written the way its users
write it:

- ``raw_ddp``: ``init_process_group`` + ``DistributedDataParallel`` + ``DistributedSampler`` +
  ``DataLoader``, the tutorial loop;
- ``no_sync``: the same loop with forward and backward inside ``model.no_sync()`` every step:
  no gradient all-reduce at all, the ceiling (its replicas diverge: never train like this);
- ``ddpkit``: ``init_runtime`` (watchdog on, as ``ddpkit train``), ``build_model_and_optimizer``
  at ``ddpkit train``'s defaults (``wrap_model``: DDP's built-in all-reduce, no hook),
  ``build_train_loader`` and each step one call of :class:`~ddpkit.TrainStep`, the step
  ``ddpkit train`` runs (so the bench measures what the product runs);
  ``ddpkit_fp16|bf16|powersgd`` adds ``grad_compression``; ``ddpkit_local_sgd`` is local SGD
  with parameters averaged every ``local_sgd_period`` steps (``ddpkit train --sync-every H``);
- ``accelerate``: ``Accelerator()`` + ``prepare`` + ``accelerator.backward``;
- ``fabric``: ``Fabric(strategy="ddp")`` + ``setup`` + ``setup_dataloaders`` + ``fabric.backward``.

Accelerate and Fabric find the default process group already created from the run's
``FileStore`` and reuse it (``PartialState`` and Fabric's ``_init_dist_connection`` both skip
``init_process_group`` when ``torch.distributed.is_initialized()``), so no port is ever chosen.

Each call of :func:`run_form` starts fresh processes (``ddpkit.testing.run_distributed``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ddpkit.errors import ConfigError, DistributedError

BASE_FORMS = ("raw_ddp", "ddpkit", "accelerate", "fabric", "no_sync")
COMPRESSIONS = ("fp16", "bf16", "powersgd")
LOCAL_SGD_FORM = "ddpkit_local_sgd"
# each form's package, in the order tried (Fabric ships alone and inside the `lightning` package)
OPTIONAL_MODULES = {
    "accelerate": ("accelerate",),
    "fabric": ("lightning_fabric", "lightning.fabric"),
}
INSTALL_HINT = "not installed: pip install 'ddpkit[bench]'"
RANDOM_DATA_SEED = 1234


@dataclass(frozen=True)
class StepLoopSettings:
    """What one run of a form does.

    Attributes:
        batch_size: samples per rank per step.
        num_steps: K, timed optimizer steps.
        num_warmup_steps: W, steps before the timed region.
        data_dir: a folder with the MNIST IDX files (its training images are used), or ``None``
            for random MNIST-shaped tensors (1x28x28 float, 10 classes, fixed seed).
        num_threads: torch intra-op threads per process (OMP_NUM_THREADS), the same for every
            form.
        seed: model initialisation and shuffle seed.
        lr: Adam's learning rate (``ddpkit train``'s default peak LR).
        timeout_s: the whole run of one form is killed after this many seconds.
        local_sgd_period: H of the ``ddpkit_local_sgd`` form (parameters averaged after every
            H-th step); unused by the other forms.
    """

    batch_size: int = 64
    num_steps: int = 50
    num_warmup_steps: int = 10
    data_dir: str | None = None
    num_threads: int = 1
    seed: int = 0
    lr: float = 3e-3
    timeout_s: float = 300.0
    local_sgd_period: int = 8


def is_installed(form: str) -> bool:
    """Whether the package a form needs (accelerate, lightning_fabric) can be imported."""
    return form not in OPTIONAL_MODULES or _module_of(form) is not None


def _module_of(form: str) -> str | None:
    for name in OPTIONAL_MODULES[form]:
        with contextlib.suppress(ModuleNotFoundError):
            if importlib.util.find_spec(name) is not None:
                return name
    return None


def default_num_threads(nproc: int) -> int:
    """Threads per process so ``nproc`` processes share the cores: ``cores // nproc``, >= 1."""
    return max(1, (os.cpu_count() or 1) // nproc)


def data_description(settings: StepLoopSettings) -> str:
    if settings.data_dir is None:
        return "random MNIST-shaped tensors (1x28x28 float, 10 classes, fixed seed)"
    return f"MNIST training images from {settings.data_dir}"


def run_form(form: str, nproc: int, settings: StepLoopSettings) -> dict:
    """Run one form on ``nproc`` fresh processes; every rank is killed on the first failure.

    Returns:
        ``{"samples_per_s": world * batch * K / slowest rank's seconds, "seconds": [per rank],
        "param_checksums": [per rank float64 sum of the parameters after W + K steps]}``.

    Raises:
        DistributedError: a rank failed, died or timed out; one line naming the form.
    """
    results = run_ranks(
        form_worker,
        nproc,
        args=(form, settings),
        timeout_s=settings.timeout_s,
        pg_timeout_s=min(settings.timeout_s, 120.0),
        what=f"form {form}",
        hint="Rerun that form alone to see it (ddpkit bench overhead --forms ...).",
    )
    seconds = [result["seconds"] for result in results]
    samples = nproc * settings.batch_size * settings.num_steps
    return {
        "samples_per_s": samples / max(seconds),
        "seconds": seconds,
        "param_checksums": [result["param_checksum"] for result in results],
    }


def run_ranks(
    worker: Callable[..., Any],
    nproc: int,
    *,
    args: tuple,
    timeout_s: float,
    pg_timeout_s: float,
    what: str,
    hint: str,
) -> list[Any]:
    """``worker(store, *args)`` on ``nproc`` fresh processes; each rank's result.

    Raises:
        DistributedError: a rank failed, died or timed out: ``<what> failed on N process(es)
            (...): <first cause>. <hint>`` (one line).
    """
    from ddpkit.launch.spawn import DistributedTestError, run_distributed

    try:
        return run_distributed(
            worker, nproc, args=args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s, init=False
        )
    except DistributedTestError as exc:
        cause = exc.first_cause().rstrip(".")[:300]
        raise DistributedError(
            f"{what} failed on {nproc} process(es) ({exc.header}): {cause}. {hint}"
        ) from None


# ---- inside each rank ------------------------------------------------------------------------


def form_worker(store: dist.Store, form: str, settings: StepLoopSettings) -> dict:
    """One rank of one form (module level, so ``spawn`` can import it)."""
    os.environ["OMP_NUM_THREADS"] = str(settings.num_threads)
    torch.set_num_threads(settings.num_threads)
    data = _dataset(settings, int(os.environ["WORLD_SIZE"]))
    if form in ("raw_ddp", "no_sync"):
        return _raw_form(store, data, settings, sync=form == "raw_ddp")
    if form == LOCAL_SGD_FORM:
        return _ddpkit_form(store, data, settings, "none", settings.local_sgd_period)
    if form == "ddpkit" or form.startswith("ddpkit_"):
        return _ddpkit_form(store, data, settings, form.partition("_")[2] or "none")
    if form == "accelerate":
        return _accelerate_form(store, data, settings)
    if form == "fabric":
        return _fabric_form(store, data, settings)
    raise ConfigError(f"unknown form {form!r}")


def timed_steps(
    batches: Iterator[Any], step: Callable[[Any], object], settings: StepLoopSettings
) -> float:
    """W warm-up steps, a barrier, K timed steps, a barrier; returns this rank's seconds.

    Collective: call on every rank (the barriers, and the form's own gradient sync).
    """
    for _ in range(settings.num_warmup_steps):
        step(next(batches))
    _barrier()
    start = time.perf_counter()
    for _ in range(settings.num_steps):
        step(next(batches))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    _barrier()
    return seconds


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _result(model: torch.nn.Module, seconds: float) -> dict:
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return {"seconds": seconds, "param_checksum": checksum}


def _dataset(settings: StepLoopSettings, world_size: int) -> torch.utils.data.Dataset:
    if settings.data_dir is not None:
        from ddpkit.app.mnist.data import load_idx_split

        return load_idx_split(Path(settings.data_dir), "train", verify=False)
    num = world_size * settings.batch_size * (settings.num_steps + settings.num_warmup_steps)
    generator = torch.Generator().manual_seed(RANDOM_DATA_SEED)
    images = torch.randn(num, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (num,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def _rank_world() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _init_default_group(store: dist.Store) -> None:
    """The default group from the run's FileStore (what the forms' users get from env://)."""
    rank, world_size = _rank_world()
    if world_size == 1:
        return
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


@contextlib.contextmanager
def _default_group(store: dist.Store) -> Iterator[None]:
    _init_default_group(store)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _raw_form(store: dist.Store, data, settings: StepLoopSettings, sync: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from ddpkit.app.mnist.model import MnistCNN

    rank, world_size = _rank_world()
    device = _device()
    with _default_group(store):
        torch.manual_seed(settings.seed)
        net = MnistCNN().to(device)
        model: torch.nn.Module = net
        ddp = None
        if world_size > 1:  # one process (scaling, n=1): the plain model
            device_ids = [device.index] if device.type == "cuda" else None
            model = ddp = DistributedDataParallel(net, device_ids=device_ids)
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        sampler: DistributedSampler[Any] = DistributedSampler(
            data, world_size, rank, shuffle=True, seed=settings.seed
        )
        loader = DataLoader(data, batch_size=settings.batch_size, sampler=sampler)

        def step(batch) -> None:
            inputs, targets = (t.to(device) for t in batch)
            optimizer.zero_grad(set_to_none=True)
            # ddp: world_size > 1 (one process trains the plain model, nothing to skip)
            skip_sync = ddp.no_sync() if ddp is not None and not sync else contextlib.nullcontext()
            with skip_sync:
                loss = F.cross_entropy(model(inputs), targets)
                loss.backward()
            optimizer.step()

        seconds = timed_steps(iter(loader), step, settings)
        return _result(model, seconds)


def _ddpkit_form(
    store: dist.Store, data, settings: StepLoopSettings, compression: str, sync_every: int = 1
) -> dict:
    from ddpkit.app.mnist.config import TrainConfig
    from ddpkit.app.mnist.job import build_model_and_optimizer
    from ddpkit.data.sampler import build_train_loader
    from ddpkit.runtime.process_group import init_runtime
    from ddpkit.training.precision import MixedPrecision
    from ddpkit.training.step import TrainStep

    config = TrainConfig(
        batch_size=settings.batch_size,
        lr=settings.lr,
        seed=settings.seed,
        grad_compression=compression,
        sync_every=sync_every,
    )
    stall_timeout_s = 300.0  # `ddpkit train`'s default: the watchdog is on
    with init_runtime("auto", store=store, stall_timeout_s=stall_timeout_s) as runtime:
        torch.manual_seed(config.seed)
        model, optimizer, _, _ = build_model_and_optimizer(config, runtime)
        loader = build_train_loader(data, runtime, batch_size=config.batch_size, seed=config.seed)
        # the step `ddpkit train` runs, at its defaults (no non-finite guard); untimed, as the
        # other forms are
        step = TrainStep(
            model,
            optimizer,
            runtime=runtime,
            num_micro_steps=config.grad_accum,
            precision=MixedPrecision(config.precision, runtime),
            clip_grad_norm=config.clip_grad_norm,
        )
        seconds = timed_steps(iter(step.windows(loader)), step, settings)
        return _result(model, seconds)


def _accelerate_form(store: dist.Store, data, settings: StepLoopSettings) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from ddpkit.app.mnist.model import MnistCNN

    _, world_size = _rank_world()
    with _default_group(store):
        # the seedable sampler (Accelerate's advice for reproducible runs) shuffles with
        # randperm(seed + epoch), as DistributedSampler does, so every form sees the same data
        seeded = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=settings.seed)
        # cpu=True is what `accelerate launch --cpu` sets: without it, Accelerate 1.x on a
        # machine without CUDA runs every rank as an undistributed single process
        cpu = not torch.cuda.is_available()
        accelerator = Accelerator(cpu=cpu, dataloader_config=seeded)
        if accelerator.num_processes != world_size:
            raise DistributedError(
                f"Accelerate sees num_processes={accelerator.num_processes}, expected "
                f"{world_size}: it would train undistributed. Check its environment detection."
            )
        set_seed(settings.seed)
        model = MnistCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        loader = torch.utils.data.DataLoader(data, batch_size=settings.batch_size, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

        def step(batch) -> None:
            inputs, targets = batch
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()

        seconds = timed_steps(iter(loader), step, settings)
        return _result(accelerator.unwrap_model(model), seconds)


def _fabric_form(store: dist.Store, data, settings: StepLoopSettings) -> dict:
    from ddpkit.app.mnist.model import MnistCNN

    module = _module_of("fabric")
    assert module is not None  # the bench's options refuse a form that is not installed
    Fabric = importlib.import_module(module).Fabric  # noqa: N806

    _, world_size = _rank_world()
    with _default_group(store):
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        fabric = Fabric(accelerator=accelerator, devices=world_size, strategy="ddp")
        fabric.launch()
        fabric.seed_everything(settings.seed, verbose=False)
        model = MnistCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        model, optimizer = fabric.setup(model, optimizer)
        loader = torch.utils.data.DataLoader(data, batch_size=settings.batch_size, shuffle=True)
        loader = fabric.setup_dataloaders(loader)  # DistributedSampler(seed=PL_GLOBAL_SEED)

        def step(batch) -> None:
            inputs, targets = batch
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()

        seconds = timed_steps(iter(loader), step, settings)
        return _result(model.module if hasattr(model, "module") else model, seconds)
