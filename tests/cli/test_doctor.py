"""``ddpkit doctor``: report plus live checks; exit 1 names the failed check."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict

import pytest
import torch

from ddpkit.launch.doctor import check_python_fork
from tests.helpers import run_cli


@pytest.mark.slow
def test_doctor_reports_and_names_failed_checks():
    with socket.socket() as listener:  # a loopback port that is in use and reachable
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = run_cli(
            [
                "-m",
                "ddpkit",
                "doctor",
                "--json",
                "--port",
                str(port),
                "--master",
                f"127.0.0.1:{port}",
            ],
            timeout_s=120,
        )
    assert result.returncode == 1, result.output
    report = json.loads(result.stdout)
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["backends"]["gloo"] is True
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["loopback_allreduce"]["ok"] is True
    assert checks["master_reachable"]["ok"] is True
    assert checks["port_free"]["ok"] is False and str(port) in checks["port_free"]["detail"]
    assert checks["python_fork"] == asdict(check_python_fork())  # a warning on 3.11.7
    assert checks["gloo_tls"]["ok"] in (True, None)  # stock wheels: None, "not in this build"
    assert report["failed"] == ["port_free"]
    assert result.stderr.strip() == "ddpkit doctor: failed checks: port_free"
