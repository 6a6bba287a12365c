"""``ddpkit train``'s way out to the tools users already run: a Prometheus endpoint and
experiment trackers (MLflow, Weights & Biases), both on rank 0 and off by default.

:class:`Exporters` is fed by the job: every straggler window (every rank's figures, rank 0's
copy), every optimizer step (rank 0's own step and time, skipped steps), every epoch record and
the final summary. Nothing here is a collective; the per-rank figures come from the straggler
detector's exchange that runs anyway.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddpkit.log import get_logger
from ddpkit.monitoring.prometheus import MetricsServer
from ddpkit.monitoring.stragglers import RankWindow, StragglerDetector
from ddpkit.monitoring.trackers import Trackers, open_trackers
from ddpkit.runtime.process_group import Runtime
from ddpkit.training.step import StepResult


class Exporters:
    """Rank 0's metrics endpoint and tracker runs for one job (no-ops elsewhere or when off).

    Args:
        runtime: the job's :class:`~ddpkit.Runtime`.
        output_dir: the job's output folder (the trackers' local stores go under it).
        config: the job's settings, flat (logged once to each tracker).
        metrics_port: the endpoint's port (``None``: no endpoint; 0: any free port).
        metrics_host: the address it listens on (default loopback).
        trackers: tracker names, e.g. ``["mlflow", "wandb"]`` (empty: none).

    Raises:
        ConfigError: on rank 0, the port is in use, the address is not usable, a tracker is
            unknown or its library is not installed (each in one line with the fix).
    """

    def __init__(
        self,
        runtime: Runtime,
        output_dir: Path,
        *,
        config: dict[str, Any],
        metrics_port: int | None,
        metrics_host: str,
        trackers: list[str],
    ) -> None:
        self.runtime = runtime
        self.server: MetricsServer | None = None
        self.trackers: Trackers | None = None
        self._host = socket.gethostname()
        self._detector: StragglerDetector | None = None
        self._flagged: set[tuple[int, str, str]] = set()
        if not runtime.is_rank_zero:
            return
        log = get_logger("train")
        if metrics_port is not None:
            self.server = MetricsServer(metrics_port, metrics_host)
            log.info("Prometheus metrics of every rank at %s", self.server.url)
        if trackers:
            try:
                self.trackers = open_trackers(
                    trackers, output_dir, run_name=Path(output_dir).resolve().name, config=config
                )
            except BaseException:
                self.close()  # the endpoint already listening
                raise
            where = ", ".join(f"{name}: {place}" for name, place in self.trackers.locations.items())
            log.info("experiment tracking to %s", where)

    @classmethod
    def off(cls, runtime: Runtime) -> Exporters:
        """No endpoint, no trackers."""
        return cls(runtime, Path("."), config={}, metrics_port=None, metrics_host="", trackers=[])

    def watch(self, detector: StragglerDetector | None) -> None:
        """Export each straggler window's per-rank figures and the stragglers named."""
        if self.server is None or detector is None:
            return
        self._detector = detector
        detector.listeners.append(self._on_window)

    def _on_window(self, ranks: list[RankWindow]) -> None:
        server = self.server
        assert server is not None and self._detector is not None
        for window in ranks:
            phases = {"data": window.data_s, "compute": window.compute_s}
            phases |= {"comm_wait": window.comm_wait_s, "step": window.step_s}
            server.update_rank(
                window.rank,
                window.host,
                step=window.step,
                samples_per_s=window.samples_per_s,
                phases=phases,
                last_step_time=window.last_step_time,
            )
        flagged = {(s.rank, s.host, s.phase) for s in self._detector.active()}
        for rank, host, phase in flagged - self._flagged:
            server.set_straggler(rank, host, phase=phase, on=True)
            server.count_event("straggler")
        for rank, host, phase in self._flagged - flagged:
            server.set_straggler(rank, host, phase=phase, on=False)
        self._flagged = flagged

    def on_step(self, result: StepResult) -> None:
        """Rank 0's own step and its time (so a stuck job shows), and a skipped step."""
        if self.server is None:
            return
        self.server.update_rank(
            self.runtime.rank,
            self._host,
            step=result.step,
            samples_per_s=None,
            phases={},
            last_step_time=time.time(),
        )
        if result.skipped:
            self.server.count_event("nonfinite_skip")

    def on_epoch(self, record: dict[str, Any], step: int, *, goodput: float | None) -> None:
        """Log an epoch record's numbers to the trackers at optimizer step ``step``; the run's
        goodput so far to the endpoint."""
        if self.trackers is not None:
            self.trackers.log_metrics(record, step)
        if self.server is not None and goodput is not None:
            self.server.set_goodput(goodput)

    def finish(self, summary: dict[str, Any]) -> None:
        """The summary to the trackers and the goodput to the endpoint; closes both (the
        endpoint is gone once training ended: the last scrape saw the last step)."""
        goodput = (summary.get("goodput") or {}).get("goodput")
        if self.server is not None and goodput is not None:
            self.server.set_goodput(goodput)
        if self.trackers is not None:
            self.trackers.log_summary(summary)
        self.close("FINISHED")

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """Close as ``FAILED`` when the body raises (a run closed as KILLED stays KILLED)."""
        try:
            yield
        except BaseException:
            self.close("FAILED")
            raise

    def close(self, status: str = "FAILED") -> None:
        """Close what is still open (a run that did not finish ends as ``status``); safe twice."""
        if self.trackers is not None:
            self.trackers.close(status)
        if self.server is not None:
            self.server.close()


def exporter_settings(config: Any) -> dict[str, Any]:
    """:class:`Exporters`' keyword arguments from a ``TrainConfig``."""
    names = [name for name in config.tracker.split(",") if name.strip()]
    return {
        "config": asdict(config),
        "metrics_port": config.metrics_port,
        "metrics_host": config.metrics_host,
        "trackers": names,
    }
