"""What ``ddpkit run`` (and ``ddpkit train``) starts, and its checks, without torch: the
command line answers a bad flag or a missing script before anything imports torch.
:mod:`ddpkit.launch.launcher` starts it."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.launch.config import LaunchConfig, launch_rules
from ddpkit.launch.elastic import node_problems
from ddpkit.launch.resources import BARE_RANK_MIB
from ddpkit.runtime.signals import DEFAULT_STOP_SIGNALS, parse_stop_signals
from ddpkit.settings import field_problems

__all__ = ["LaunchSpec", "settings_of", "spec_of", "validate_spec"]

_DEFAULTS = LaunchConfig()


@dataclass(frozen=True)
class LaunchSpec:
    """What to start.

    Attributes:
        target: ``["script.py", *args]`` or ``["-m", "module", *args]``.
        nproc: processes on this node (the world size, single node).
        max_restarts: how many times torchrun restarts the whole group after a failure.
        omp_num_threads: threads per process; ``None`` keeps an ``OMP_NUM_THREADS`` already set,
            else usable cores // nproc (at least 1).
        nnodes: number of nodes (machines); each runs ``ddpkit run`` with the same settings.
            With ``min_nodes``: the most nodes the job takes in.
        min_nodes: elastic membership (``--nnodes MIN:MAX``): the fewest nodes the job runs
            on; ``None`` (or ``nnodes``) for a fixed number of nodes. torchrun's agents restart
            the workers on the nodes that remain when one is lost (this costs one of
            ``max_restarts``) and when one joins (free); see docs/launching.md.
        node_rank: this node's index; node 0 hosts the rendezvous store at ``rdzv_endpoint``
            (the ranks are assigned by the rendezvous, not by node rank).
        rdzv_endpoint: ``HOST:PORT`` of the rendezvous store (several nodes only): an address
            of node 0 that every node can reach.
        rdzv_id: the job's name in the rendezvous (the same on every node).
        rdzv_conf: torchrun's dynamic-rendezvous timings, ``"last_call_timeout=5,..."``
            (:data:`ddpkit.launch.elastic.RDZV_CONF_KEYS`; ``""``: torch's defaults).
        tls: ``(cert, key, ca)`` PEM files for gloo's TLS transport, or ``None``.
        command: the command the user ran, which labels every line the launcher prints
            (``ddpkit train`` launches through here too).
        on_interrupt: after a stop signal (Ctrl-C, SIGTERM, ...), once every worker has
            stopped: ``on_interrupt(saved=clean)`` gives the text that ends the one line
            (``ddpkit train``: the checkpoint and the command that resumes it); ``saved``:
            every rank saved the step they agreed on. A failure's last line ends with
            ``on_interrupt(saved=False)`` too.
        resume_command: without ``on_interrupt``, the command the stop line (and a failure's
            line, after the newest checkpoint a ``CheckpointManager`` of the job saved) says
            resumes the job (``ddpkit run``: the command as the user typed it).
        grace_period_s: after passing a stop signal on to the workers, seconds to wait before
            SIGKILLing those still running (torchrun's ``--shutdown-timeout``).
        stop_signals: the signals that stop every rank at one step with a checkpoint
            (:mod:`ddpkit.runtime.stop`); torchrun passes them on.
        mem_per_rank_mib, mem_per_rank_what: the measured peak memory of one rank and what it
            was measured on; ``nproc`` ranks that cannot fit in the available memory are
            refused before any starts (:func:`ddpkit.launch.resources.check_fits`).
        fault_tolerance: ``restart`` (torchrun; a lost rank ends or restarts every rank) or
            ``live`` (:mod:`ddpkit.launch.live`: the survivors go on, a replacement heals from
            them; ``max_restarts`` then counts replacement processes).
        spares: live: warm spare processes started up front, each taking over a lost slot.
        heartbeat_timeout_s: live: a worker whose heartbeat (every 0.5 s, from a thread of
            its own) stops this long is declared dead and killed (SIGSTOP, a frozen host).
        preload: live: modules a warm spare imports while it waits (the target's own).
    """

    target: list[str]
    nproc: int
    max_restarts: int = _DEFAULTS.max_restarts
    omp_num_threads: int | None = None
    nnodes: int = 1
    min_nodes: int | None = None
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "ddpkit"
    rdzv_conf: str = ""
    tls: tuple[str, str, str] | None = None
    command: str = "ddpkit run"
    on_interrupt: Callable[..., str] | None = None
    resume_command: str | None = None
    grace_period_s: int = _DEFAULTS.grace_period
    stop_signals: tuple[signal.Signals, ...] = DEFAULT_STOP_SIGNALS  # LaunchConfig's default
    mem_per_rank_mib: float = BARE_RANK_MIB
    mem_per_rank_what: str = "a bare torch + gloo rank"
    fault_tolerance: str = _DEFAULTS.fault_tolerance
    spares: int = _DEFAULTS.spares
    heartbeat_timeout_s: float = _DEFAULTS.heartbeat_timeout
    preload: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """The world size; elastic: the largest (every node taken in)."""
        return self.nproc * self.nnodes

    @property
    def elastic(self) -> bool:
        """Whether the number of nodes may change while the job runs (``MIN < MAX``)."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def nnodes_arg(self) -> str:
        """torchrun's ``--nnodes`` value: ``"N"``, or ``"MIN:MAX"`` when elastic."""
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)


def spec_of(settings: LaunchConfig, target: list[str], **details: Any) -> LaunchSpec:
    """The :class:`LaunchSpec` that starts ``target`` with ``settings`` (``nproc`` set) and
    ``details``, the other fields (``command="ddpkit train"``, ``nnodes=2``, ...)."""
    return LaunchSpec(
        target=target,
        nproc=settings.nproc if settings.nproc is not None else 0,  # 0: refused by validate_spec
        max_restarts=settings.max_restarts,
        grace_period_s=settings.grace_period,
        stop_signals=parse_stop_signals(settings.stop_signals),
        fault_tolerance=settings.fault_tolerance,
        spares=settings.spares,
        heartbeat_timeout_s=settings.heartbeat_timeout,
        **details,
    )


def settings_of(spec: LaunchSpec) -> LaunchConfig:
    """The launch settings of ``spec`` (the inverse of :func:`spec_of`), to check them."""
    return LaunchConfig(
        nproc=spec.nproc,
        max_restarts=spec.max_restarts,
        grace_period=spec.grace_period_s,
        stop_signals=",".join(s.name for s in spec.stop_signals) or "none",
        fault_tolerance=spec.fault_tolerance,
        spares=spec.spares,
        heartbeat_timeout=spec.heartbeat_timeout_s,
    )


def _find_module(name: str) -> object | None:
    """The spec of module ``name`` as the workers will look for it: ``python -m`` puts the
    current folder first on their ``sys.path`` (the ``ddpkit`` console script's own has its
    ``bin`` folder there instead), then this process's path."""
    import importlib.util

    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        return None
    finally:
        sys.path[:] = saved


def validate_spec(spec: LaunchSpec) -> None:
    """Check a whole :class:`LaunchSpec` at once; one error lists every problem.

    Raises:
        ConfigError: a launch setting out of its range (the checks of
            :class:`~ddpkit.launch.config.LaunchConfig` and
            :func:`~ddpkit.launch.config.launch_rules`), a bad node layout, a missing script, an
            empty target.
    """
    settings = settings_of(spec)
    problems = field_problems(settings)
    problems += launch_rules(settings) if not problems else []
    if spec.omp_num_threads is not None and spec.omp_num_threads < 1:
        problems.append(f"omp_num_threads={spec.omp_num_threads} must be >= 1")
    problems += node_problems(spec)
    if not spec.target or spec.target == ["-m"]:
        problems.append("no script given (ddpkit run -n 2 train.py [args], or -m package.module)")
    elif spec.target[0] == "-m":
        if _find_module(spec.target[1]) is None:
            problems.append(f"module={spec.target[1]!r} cannot be found on sys.path")
    elif not os.path.exists(spec.target[0]):
        problems.append(f"script={spec.target[0]!r} does not exist")
    elif not os.path.isfile(spec.target[0]):
        problems.append(f"script={spec.target[0]!r} is not a file")
    if problems:
        raise ConfigError(f"invalid launch: {'; '.join(problems)}.")
