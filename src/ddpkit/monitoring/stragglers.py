"""Naming the slow rank: every rank's own work compared across ranks, window by window.

DDP's gradient all-reduce makes every rank wait for the slowest one, so a slow rank does not
stand out by its step time: every rank's step is as slow as its, and the waiting lands on the
fast ranks. What tells the ranks apart is the work each does on its own, from the step's split
(:class:`~ddpkit.StepTimer`, measured on host time even when step timing is off):

``data``
    the ``data_wait`` phase: the loader's next window of batches and their copy to the device.
``compute``
    ``forward`` + ``backward_comm`` - ``comm_wait`` + ``optimizer``: the rank's own work.
``comm_wait``
    from this rank's last gradient to the end of backward: waiting for the other ranks.

Every ``window`` optimizer steps each rank takes the median of each over the window's steps
(and of its step time), and the ranks exchange them in one all-reduce of ``world_size x 8``
float64 values (:func:`~ddpkit.runtime.collectives.gather_per_rank`). Every rank applies
the same rule to the same table, so every rank reaches the same verdict:

    rank r is **slow** in ``data`` or ``compute`` in a window when its median is at least
    ``factor`` times the median of the *other* ranks' medians, and exceeds it by at least
    ``min_share`` of the ranks' median step time (the excess costs every step that much);

a rank slow in ``patience`` consecutive windows is **named** (one warning line on rank 0, and in
:meth:`StragglerDetector.summary`); ``patience`` windows in a row without it clear the name. The
first ``warmup`` windows are exchanged but not judged (first-step allocations, compilation).
Medians, because one slow step (a garbage collection, a checkpoint) moves a mean but not a
median; the other ranks' median as the reference, because at two ranks the median of all is
halfway to the straggler. Defaults: ``window=20``, ``factor=1.25``, ``min_share=0.1``,
``patience=3``, ``warmup=1`` (a straggler is named after 80 steps), chosen from measured runs:
docs/monitoring.md has the detection table and the balanced runs.

Limits: on CUDA without ``--step-timing on`` the phases are host time: a slow data loader is
named, slow kernels are not. With FSDP the compute includes FSDP's own collectives (its
gradients are not hooked). Live fault tolerance and :func:`~ddpkit.join_uneven_inputs` (so
``train_epoch(..., join=True)``) run without it: a rank may run fewer steps there, and the
exchange is a collective (:func:`paused`).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ddpkit.log import get_logger
from ddpkit.monitoring.observe import COMM_WAIT, PHASES, WeakHook
from ddpkit.runtime.collectives import all_gather_object, gather_per_rank
from ddpkit.runtime.process_group import Runtime

JUDGED = ("data", "compute")  # the phases a rank can be named for
WHAT = {"data": "data loading", "compute": "compute (forward, backward, optimizer)"}
ADVICE = {
    "data": "look at that rank's data loader (num_workers, storage, CPU contention on its host)",
    "compute": "look at that host (other processes on its CPUs or GPU, GPU clocks and "
    "temperature: top, nvidia-smi)",
}


@dataclass(frozen=True)
class RankWindow:
    """One rank's figures over one window (seconds per step are medians over its steps).

    Attributes:
        rank, host: the rank and its host name.
        data_s, compute_s, comm_wait_s, step_s: median seconds per step of each.
        samples_per_s: this rank's samples over the window's wall time.
        last_step_time: Unix time (s) of this rank's last step of the window.
        step: the optimizer step that ended the window.
    """

    rank: int
    host: str
    data_s: float
    compute_s: float
    comm_wait_s: float
    step_s: float
    samples_per_s: float
    last_step_time: float
    step: int


@dataclass
class Straggler:
    """One rank named slow in one phase, from the window it was named to the one it cleared.

    Attributes:
        rank, host, phase: who, and ``"data"`` or ``"compute"``.
        factor: its median over the other ranks' (the largest of its slow windows).
        rank_s, others_s, step_s: those medians and the step time, seconds per step, in the
            window with the largest factor.
        first_step: the step that ended its first slow window; named_step: the step it was named
            at; last_step: the step that ended its last slow window.
        cleared_step: the step it was cleared at (``None``: still slow at the end).
    """

    rank: int
    host: str
    phase: str
    factor: float
    rank_s: float
    others_s: float
    step_s: float
    first_step: int
    named_step: int
    last_step: int
    cleared_step: int | None = None


@dataclass
class _Streak:
    slow: int = 0  # consecutive slow windows
    calm: int = 0  # consecutive windows without, while named
    first_step: int = 0
    worst: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # factor, rank, others, step


@dataclass
class _Verdict:
    rank: int
    phase: str
    factor: float
    rank_s: float
    others_s: float
    step_s: float


_PAUSE = {"depth": 0, "generation": 0}  # paused(): every detector of this process


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No straggler exchange in this process inside (torch's ``Join``, where ranks run
    different numbers of steps and only DDP's own collectives are shadowed); every detector's
    window starts afresh after it, on every rank. :func:`~ddpkit.join_uneven_inputs` enters it."""
    _PAUSE["depth"] += 1
    _PAUSE["generation"] += 1
    try:
        yield
    finally:
        _PAUSE["depth"] -= 1
        _PAUSE["generation"] += 1


class StragglerDetector:
    """Names the rank whose data loading or compute is persistently slower than the others'.

    :class:`~ddpkit.TrainStep` builds one by default (world size > 1, no live fault tolerance)
    and calls :meth:`observe` after every optimizer step.

    Args:
        runtime: the job's :class:`~ddpkit.Runtime`.
        window: optimizer steps per exchange (>= 3).
        factor: how many times the other ranks' median a slow rank's median is at least (> 1).
        min_share: how much of the median step time the excess is at least (0..1).
        patience: consecutive slow windows before a rank is named, and calm ones to clear (>= 1).
        warmup: windows exchanged but not judged at the start (>= 0).

    Attributes:
        listeners: callables given each window's ``list[RankWindow]`` (every rank, after the
            exchange), e.g. a metrics exporter on rank 0.
        named: the stragglers named so far (cleared ones too), oldest first.
        num_windows: windows exchanged so far.
        last: the last window's ``list[RankWindow]`` (empty before the first).

    Raises:
        ValueError: an argument out of its range (the message names it).
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        window: int = 20,
        factor: float = 1.25,
        min_share: float = 0.1,
        patience: int = 3,
        warmup: int = 1,
    ) -> None:
        for name, ok in (
            ("window", window >= 3),
            ("factor", factor > 1),
            ("min_share", 0 <= min_share < 1),
            ("patience", patience >= 1),
            ("warmup", warmup >= 0),
        ):
            if not ok:
                value = locals()[name]
                raise ValueError(
                    f"invalid StragglerDetector {name}={value!r}: window >= 3 steps, factor > 1, "
                    "0 <= min_share < 1, patience >= 1, warmup >= 0."
                )
        self.runtime = runtime
        self.window, self.factor, self.min_share = window, factor, min_share
        self.patience, self.warmup = patience, warmup
        self.listeners: list[Callable[[list[RankWindow]], None]] = []
        self.named: list[Straggler] = []
        self.num_windows = 0
        self.last: list[RankWindow] = []
        self._rows: list[tuple[float, float, float, float, int]] = []
        self._mark = time.perf_counter()
        self._hosts: list[str] | None = None
        self._streaks: dict[tuple[int, str], _Streak] = {}
        self._active: dict[tuple[int, str], Straggler] = {}
        self._totals: dict[int, list[float]] = {}
        self._generation = _PAUSE["generation"]

    def observe(
        self,
        step: int,
        split: Mapping[str, float],
        *,
        waits: Mapping[str, float],
        num_samples: int,
    ) -> None:
        """Add one optimizer step; every ``window`` steps, exchange and judge.

        Args:
            step: the optimizer step just ended.
            split: its seconds per phase and ``comm_wait`` (:attr:`StepTimer.last_split`).
            waits: the part of ``comm_wait`` inside each phase (:attr:`StepTimer.last_wait`).
            num_samples: this rank's samples in the step.

        Collective: call on every rank after every optimizer step (one all-reduce every
        ``window`` calls; the first also gathers the host names). Nothing at world size 1.
        """
        wait, wait_in_data = split.get(COMM_WAIT, 0.0), waits.get("data_wait", 0.0)
        total = sum(split[name] for name in PHASES)
        data = split["data_wait"] - wait_in_data
        compute = total - split["data_wait"] - (wait - wait_in_data)  # the other phases' own
        self.observe_parts(step, (data, compute, wait, total), num_samples=num_samples)

    def observe_parts(
        self, step: int, parts: tuple[float, float, float, float], *, num_samples: int
    ) -> None:
        """:meth:`observe` with the step already split: ``parts`` is ``(data, compute,
        comm_wait, step)`` seconds. Collective like :meth:`observe`."""
        if self.runtime.world_size == 1 or _PAUSE["depth"]:
            return
        if self._generation != _PAUSE["generation"]:  # a pause ended: a fresh window
            self._generation, self._rows = _PAUSE["generation"], []
        self._rows.append((*parts, num_samples))
        if len(self._rows) >= self.window:
            self._exchange(step)

    def _exchange(self, step: int) -> None:
        rows, self._rows = self._rows, []
        now = time.perf_counter()
        elapsed, self._mark = now - self._mark, now
        medians = [statistics.median(row[i] for row in rows) for i in range(4)]
        samples = sum(row[4] for row in rows)
        local = [*medians, samples / max(elapsed, 1e-9), time.time(), float(step), 0.0]
        table = gather_per_rank(local, self.runtime).tolist()  # (world_size, 8)
        if self._hosts is None:
            self._hosts = all_gather_object(socket.gethostname(), self.runtime)
        ranks = [
            RankWindow(
                rank,
                self._hosts[rank],
                data_s=row[0],
                compute_s=row[1],
                comm_wait_s=row[2],
                step_s=row[3],
                samples_per_s=row[4],
                last_step_time=row[5],
                step=int(row[6]),
            )
            for rank, row in enumerate(table)
        ]
        self.last = ranks
        self.num_windows += 1
        for rank in ranks:
            total = self._totals.setdefault(rank.rank, [0.0] * 4)
            for i, value in enumerate((rank.data_s, rank.compute_s, rank.comm_wait_s, rank.step_s)):
                total[i] += value
        if self.num_windows > self.warmup:
            self._update(judge(ranks, factor=self.factor, min_share=self.min_share), step)
        for listener in self.listeners:
            listener(ranks)

    def _update(self, verdicts: list[_Verdict], step: int) -> None:
        """Advance each (rank, phase) streak by this window's verdicts; name and clear."""
        slow = {(v.rank, v.phase): v for v in verdicts}
        for key in set(self._streaks) | set(slow):
            streak = self._streaks.setdefault(key, _Streak())
            verdict = slow.get(key)
            if verdict is not None:
                self._slow_window(key, streak, verdict, step)
                continue
            streak.slow, streak.calm = 0, streak.calm + 1
            if key in self._active and streak.calm >= self.patience:
                self._clear(self._active.pop(key), step)
            if key not in self._active:
                del self._streaks[key]

    def _slow_window(
        self, key: tuple[int, str], streak: _Streak, verdict: _Verdict, step: int
    ) -> None:
        if streak.slow == 0:
            streak.first_step = step
        streak.slow, streak.calm = streak.slow + 1, 0
        if verdict.factor > streak.worst[0]:
            streak.worst = (verdict.factor, verdict.rank_s, verdict.others_s, verdict.step_s)
        if key in self._active:
            self._grow(self._active[key], streak, step)
        elif streak.slow >= self.patience:
            self._name(key, streak, step)

    def _grow(self, named: Straggler, streak: _Streak, step: int) -> None:
        named.last_step = step
        named.factor, named.rank_s, named.others_s, named.step_s = streak.worst

    def _name(self, key: tuple[int, str], streak: _Streak, step: int) -> None:
        rank, phase = key
        assert self._hosts is not None
        factor, rank_s, others_s, step_s = streak.worst
        named = Straggler(
            rank,
            self._hosts[rank],
            phase,
            factor,
            rank_s,
            others_s,
            step_s,
            first_step=streak.first_step,
            named_step=step,
            last_step=step,
        )
        self.named.append(named)
        self._active[key] = named
        if self.runtime.is_rank_zero:
            get_logger("stragglers").warning(straggler_line(named, self.window))

    def _clear(self, named: Straggler, step: int) -> None:
        named.cleared_step = step
        if self.runtime.is_rank_zero:
            get_logger("stragglers").info(
                "straggler cleared: rank %d (host %s) is no longer slow in %s at step %d "
                "(named at step %d, up to %.1fx)",
                named.rank,
                named.host,
                WHAT[named.phase],
                step,
                named.named_step,
                named.factor,
            )

    def active(self) -> list[Straggler]:
        """The stragglers named and not cleared."""
        return list(self._active.values())

    def summary(self) -> dict[str, Any]:
        """What ``summary.json``'s ``stragglers`` holds (the same on every rank).

        Returns:
            ``{"window": steps, "factor", "min_share", "patience", "warmup", "windows": exchanged,
            "named": [Straggler as a dict, ...], "ranks": [{"rank", "host", "data_s",
            "compute_s", "comm_wait_s", "step_s"}: the mean of the window medians, seconds per
            step, ...]}``; ``ranks`` is empty before the first exchange.
        """
        ranks = []
        for rank, totals in sorted(self._totals.items()):
            means = [value / max(self.num_windows, 1) for value in totals]
            host = self._hosts[rank] if self._hosts else ""
            names = ("data_s", "compute_s", "comm_wait_s", "step_s")
            ranks.append({"rank": rank, "host": host, **dict(zip(names, means, strict=True))})
        return {
            "window": self.window,
            "factor": self.factor,
            "min_share": self.min_share,
            "patience": self.patience,
            "warmup": self.warmup,
            "windows": self.num_windows,
            "named": [asdict(named) for named in self.named],
            "ranks": ranks,
        }


class LoopProbe:
    """The straggler detector for a loop ddpkit does not run: the user's own, with a model of
    :func:`~ddpkit.wrap_model` and :meth:`Runtime.stop_requested <ddpkit.Runtime.stop_requested>`
    called once per step (:meth:`CheckpointManager.maybe_save <ddpkit.CheckpointManager.maybe_save>`
    calls it).

    Hooks on the inner module (forward start and end, training mode only) and on its parameters
    (gradient accumulated) split each step, from one :meth:`end_step` to the next, into
    ``data`` (step start to the first forward, and from a backward's last gradient to the next
    forward: the loader, the copy to the device, the caller's code), ``compute`` (the forwards,
    plus each backward's span from its first to its last gradient: this rank's backward, no
    wait in it; several per step with gradient accumulation) and the rest (waiting for the
    other ranks, the loss, the optimizer). :class:`~ddpkit.TrainStep` replaces it with its
    own, finer split.

    Args:
        module: the module inside the DDP wrapper.
        runtime: the job's runtime.
        detector: the detector to feed (default: one with its defaults).
    """

    def __init__(
        self, module: Any, runtime: Runtime, *, detector: StragglerDetector | None = None
    ) -> None:
        self.detector = detector or StragglerDetector(runtime)
        self.module = module
        self.num_steps = 0
        self._handles = [  # weak: a copy of the model (an EMA) gets hooks that do nothing
            module.register_forward_pre_hook(WeakHook(self._forward_start)),
            module.register_forward_hook(WeakHook(self._forward_end)),
        ]
        for param in module.parameters():
            if param.requires_grad and hasattr(param, "register_post_accumulate_grad_hook"):
                hook = WeakHook(self._grad_ready)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self._mark, self._forward_at, self._forward_s, self._samples = now, 0.0, 0.0, 0
        self._data_s, self._backward_s, self._first_grad, self._last_grad = 0.0, 0.0, 0.0, 0.0
        self._forwards = 0

    def _close_backward(self) -> None:
        """The backward since the last forward is over: add its gradient span."""
        if self._first_grad:
            self._backward_s += self._last_grad - self._first_grad
            self._first_grad = 0.0

    def _forward_start(self, module: Any, args: tuple) -> None:
        if not module.training:
            return
        now = time.perf_counter()
        if not self._forwards:  # the step's first: from the step start
            self._data_s += now - self._mark
        elif self._first_grad:  # after a backward (accumulation): from its last gradient
            self._data_s += now - self._last_grad
        self._close_backward()
        self._forwards += 1
        self._forward_at = now
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dim():
            self._samples += int(first.shape[0])

    def _forward_end(self, module: Any, args: tuple, output: Any) -> None:
        if module.training and self._forward_at:
            self._forward_s += time.perf_counter() - self._forward_at
            self._forward_at = 0.0

    def _grad_ready(self, _param: Any) -> None:
        now = time.perf_counter()
        self._first_grad = self._first_grad or now
        self._last_grad = now

    def end_step(self) -> None:
        """One step ended (every rank, the same number of times): hand its split to the
        detector. Collective every ``window`` calls."""
        now = time.perf_counter()
        self.num_steps += 1
        self._close_backward()
        step_s = now - self._mark
        data, compute = self._data_s, self._forward_s + self._backward_s
        rest = max(step_s - data - compute, 0.0)
        parts = (data, compute, rest, step_s)
        self.detector.observe_parts(self.num_steps, parts, num_samples=self._samples)
        self._reset(time.perf_counter())

    def close(self) -> None:
        """Remove the hooks (safe to call twice)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def attach_loop_probe(module: Any, runtime: Runtime) -> None:
    """Give ``runtime`` a :class:`LoopProbe` on ``module`` (the last wrapped model wins;
    world size 1 and live fault tolerance get none)."""
    if runtime.world_size == 1 or runtime.live is not None:
        return
    if runtime.step_probe is not None:
        runtime.step_probe.close()
    runtime.step_probe = LoopProbe(module, runtime)


def judge(ranks: list[RankWindow], *, factor: float, min_share: float) -> list[_Verdict]:
    """This window's slow (rank, phase) pairs by the module's rule (no state, no collective)."""
    if len(ranks) < 2:
        return []
    step_s = statistics.median(rank.step_s for rank in ranks)
    verdicts = []
    for phase in JUDGED:
        values = [getattr(rank, f"{phase}_s") for rank in ranks]
        for rank, value in enumerate(values):
            others = statistics.median(values[:rank] + values[rank + 1 :])
            if value >= factor * others and value - others >= min_share * step_s:
                ratio = value / others if others > 0 else float("inf")
                verdicts.append(_Verdict(rank, phase, ratio, value, others, step_s))
    return verdicts


def straggler_line(named: Straggler, window: int) -> str:
    """The one warning line naming ``named`` (rank, host, phase, factor, cost, where to look)."""
    factor = f"{named.factor:.1f}x" if named.factor < 1e3 else ">1000x"
    first = named.first_step - window + 1
    return (
        f"straggler: rank {named.rank} (host {named.host}) is slow in {WHAT[named.phase]}: "
        f"{named.rank_s * 1e3:.1f} ms per step against {named.others_s * 1e3:.1f} ms on the "
        f"other ranks ({factor}, medians of {window}-step windows, steps {first}-"
        f"{named.named_step}); every rank waits for it, a step takes {named.step_s * 1e3:.1f} ms. "
        f"Fix: {ADVICE[named.phase]}."
    )
