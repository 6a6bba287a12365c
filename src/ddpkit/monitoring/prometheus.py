"""Per-rank training metrics served over HTTP for Prometheus (``prometheus_client``).

Rank 0 starts one :class:`MetricsServer` (off by default; the caller decides) and feeds it what
it knows of every rank: the step, samples per second, the step-time phases, when each rank last
stepped, the job's goodput, guard events and the stragglers it named. The server listens on one
address only, 127.0.0.1 unless the caller gives another, like every ddpkit listener, and serves
its own ``CollectorRegistry`` (never prometheus_client's global one, so two servers in one
process, or a user's own metrics, never mix).

Metric names follow Prometheus conventions: base units (seconds), ``_total`` on counters, the
rank as a label. An "is it stuck" alert reads ``time() - ddpkit_last_step_timestamp_seconds``.

Example:
    >>> server = MetricsServer(0)                                    # 0: any free port
    >>> server.update_rank(0, "node1", step=120, samples_per_s=5400.0,
    ...                    phases={"data": 0.002, "step": 0.031}, last_step_time=time.time())
    >>> server.url
    'http://127.0.0.1:.../metrics'
    >>> server.close()
"""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
import threading
from types import ModuleType

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger
from ddpkit.security.bind import resolve_ipv4

DEFAULT_HOST = "127.0.0.1"
PHASES = ("data", "compute", "comm_wait", "step")  # label values of ddpkit_step_phase_seconds
GUARD_EVENT_KINDS = ("nonfinite_skip", "straggler", "replica_mismatch")  # exported from 0 on
_RANK_LABELS = ("rank", "host")


def _import_prometheus_client() -> ModuleType:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            "cannot serve metrics: prometheus_client is not installed. Install it with "
            "pip install 'ddpkit[prometheus]'."
        ) from None
    return prometheus_client


def _check_address(host: str) -> str:
    """``host`` as the IPv4 address to listen on; the unspecified address is refused."""
    address = resolve_ipv4(host)
    ip = ipaddress.ip_address(address)
    if ip.is_unspecified:
        raise ConfigError(
            f"refusing to serve metrics on every interface: host={host} ({address}) is the "
            "unspecified address. Give the one address of this machine Prometheus scrapes "
            "(--metrics-host), or leave the default 127.0.0.1."
        )
    if ip.is_global:
        get_logger("monitoring").warning(
            "the metrics endpoint listens on the public address %s: anyone who can reach it "
            "can read the job's metrics. Prefer a private network or a firewall.",
            address,
        )
    return address


def _bind_error(exc: OSError, host: str, port: int, address: str) -> ConfigError:
    """The one-line error for an endpoint that cannot bind ``address:port``."""
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(
            f"cannot serve metrics: port {port} on {address} is already in use. Pick another "
            "port (--metrics-port), or 0 to let the system pick a free one."
        )
    return ConfigError(
        f"cannot serve metrics on {host}:{port} ({address}): {exc.strerror}. Give an address "
        "of this machine (--metrics-host), or leave the default 127.0.0.1."
    )


def check_endpoint(port: int, host: str = DEFAULT_HOST) -> None:
    """What :class:`MetricsServer` would refuse, found before any worker starts: the library,
    the address (resolved, not the unspecified one) and the port (a bind, closed at once).

    Raises:
        ConfigError: as :class:`MetricsServer` (one line with the fix).
    """
    _import_prometheus_client()
    address = _check_address(host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise _bind_error(exc, host, port, address) from None


def _check_phases(phases: dict[str, float]) -> None:
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise ValueError(f"unknown step phase: phases={unknown}. Allowed: {', '.join(PHASES)}.")


class MetricsServer:
    """prometheus_client's HTTP server on its own registry, with ddpkit's per-rank metrics.

    Start it on rank 0 only (not a collective); it serves ``/metrics`` from a daemon thread.

    Args:
        port: TCP port; 0 lets the system pick a free one (read :attr:`port` afterwards).
        host: the address to listen on, one address only. Default 127.0.0.1 (loopback: nothing
            outside this machine can scrape); give the address Prometheus reaches for a
            remote scraper. A public address is allowed with a warning.

    Attributes:
        host: the IPv4 address listened on.
        port: the port actually bound.

    Raises:
        ConfigError: prometheus_client is not installed; the port is in use on that address;
            ``host`` is the unspecified address (0.0.0.0), does not resolve, or is not one of
            this machine's addresses; ``port`` is outside 0-65535.

    Example:
        >>> with MetricsServer(0) as server:                         # 0: any free port
        ...     server.set_goodput(0.93)
    """

    def __init__(self, port: int, host: str = DEFAULT_HOST) -> None:
        client = _import_prometheus_client()
        if not 0 <= port <= 65535:
            raise ConfigError(f"invalid metrics port: port={port}. Use 1-65535, or 0 for any.")
        address = _check_address(host)
        self._registry = client.CollectorRegistry()
        self._define_metrics(client)
        try:
            self._server, self._thread = client.start_http_server(
                port, addr=address, registry=self._registry
            )
        except OSError as exc:
            raise _bind_error(exc, host, port, address) from None
        self.host: str = address
        self.port: int = self._server.server_address[1]
        self._closed = False
        self._close_lock = threading.Lock()

    def _define_metrics(self, client: ModuleType) -> None:
        registry, gauge = self._registry, client.Gauge
        self._step = gauge(
            "ddpkit_step", "Last optimizer step of the rank.", _RANK_LABELS, registry=registry
        )
        self._samples = gauge(
            "ddpkit_samples_per_second",
            "Training samples per second of the rank over the last window.",
            _RANK_LABELS,
            registry=registry,
        )
        self._phase = gauge(
            "ddpkit_step_phase_seconds",
            "Median seconds per step spent in the phase over the last window.",
            (*_RANK_LABELS, "phase"),
            registry=registry,
        )
        self._last_step = gauge(
            "ddpkit_last_step_timestamp_seconds",
            "Unix time of the rank's last optimizer step, as known to rank 0.",
            _RANK_LABELS,
            registry=registry,
        )
        self._goodput = gauge(
            "ddpkit_goodput_ratio",
            "Fraction of the job's time spent on useful steps (0-1; NaN until known).",
            registry=registry,
        )
        self._goodput.set(math.nan)
        self._events = client.Counter(
            "ddpkit_guard_events_total", "Guard events of the job.", ("kind",), registry=registry
        )
        for kind in GUARD_EVENT_KINDS:
            self._events.labels(kind=kind)  # a series at 0, so rate() and alerts see it from start
        self._straggler = gauge(
            "ddpkit_straggler",
            "1 while the rank is named a straggler in the phase, else 0.",
            (*_RANK_LABELS, "phase"),
            registry=registry,
        )

    @property
    def url(self) -> str:
        """The scrape URL, ``http://HOST:PORT/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def update_rank(
        self,
        rank: int,
        host: str,
        *,
        step: int,
        samples_per_s: float | None,
        phases: dict[str, float],
        last_step_time: float,
    ) -> None:
        """Set one rank's gauges from what rank 0 knows of it.

        Args:
            rank: the global rank the values belong to.
            host: that rank's hostname (a label).
            step: its last optimizer step.
            samples_per_s: its training samples per second; ``None`` (not measured yet) leaves
                the gauge as it was.
            phases: median seconds per step over the last window, keyed by a name of
                :data:`PHASES`; phases left out keep their previous value.
            last_step_time: Unix time in seconds of its last step.

        Raises:
            ValueError: a key of ``phases`` is not one of :data:`PHASES`.
        """
        _check_phases(phases)
        labels = {"rank": str(rank), "host": host}
        self._step.labels(**labels).set(step)
        if samples_per_s is not None:
            self._samples.labels(**labels).set(samples_per_s)
        for phase, seconds in phases.items():
            self._phase.labels(**labels, phase=phase).set(seconds)
        self._last_step.labels(**labels).set(last_step_time)

    def set_goodput(self, ratio: float) -> None:
        """Set the job's goodput: useful step time over wall time, 0 to 1 (NaN: unknown).

        Raises:
            ValueError: ``ratio`` is outside 0-1 (a percentage given by mistake).
        """
        if not math.isnan(ratio) and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"invalid goodput: ratio={ratio}. A fraction from 0 to 1.")
        self._goodput.set(ratio)

    def count_event(self, kind: str, n: int = 1) -> None:
        """Add ``n`` guard events of ``kind`` (e.g. ``nonfinite_skip``, ``straggler``).

        Raises:
            ValueError: ``kind`` is empty, or ``n`` is negative.
        """
        if not kind:
            raise ValueError(f"invalid guard event: kind={kind!r}. Name the kind.")
        if n < 0:
            raise ValueError(f"invalid guard event count: n={n}. Counters only go up.")
        self._events.labels(kind=kind).inc(n)

    def set_straggler(self, rank: int, host: str, *, phase: str, on: bool) -> None:
        """Mark ``rank`` as a straggler in ``phase`` (1) or no longer one (0).

        Raises:
            ValueError: ``phase`` is not one of :data:`PHASES`.
        """
        _check_phases({phase: 0.0})
        self._straggler.labels(rank=str(rank), host=host, phase=phase).set(1 if on else 0)

    def close(self) -> None:
        """Stop serving and free the port (idempotent; waits up to about half a second)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()  # serve_forever polls every 0.5 s
        self._server.server_close()  # shutdown() alone keeps the socket (and the port)
        self._thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
