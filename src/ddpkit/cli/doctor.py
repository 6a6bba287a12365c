"""``ddpkit doctor [--port P] [--master HOST:PORT] [--json]``: environment report + live checks."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="environment report and live checks, for bug reports",
        description="Print Python/torch/CUDA/NCCL versions, devices, backends, network "
        "interfaces and distributed environment variables, then run live checks: a 2-process "
        "gloo all-reduce over loopback, /dev/shm size, open-file limit, gloo TLS support, and "
        "optionally a port and a master address. Exit status 1 names the failed checks.",
    )
    parser.add_argument("--port", type=int, default=None, help="check this port is free")
    parser.add_argument(
        "--master",
        default=None,
        metavar="HOST:PORT",
        help="check a TCP connection to the master's store opens",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ddpkit.launch.doctor import environment_report, report_as_dict, run_checks

    env = environment_report()
    checks = run_checks(port=args.port, master=args.master)
    failed = [c.name for c in checks if c.ok is False]
    if args.json:
        print(json.dumps({**report_as_dict(env, checks), "failed": failed}, indent=2))
    else:
        for key, value in env.items():
            if key != "env":
                print(f"{key:20s} {value}")
        print(
            "environment variables:",
            ", ".join(f"{k}={v}" for k, v in env["env"].items()) or "(none set)",
        )
        for check in checks:
            mark = {True: "ok  ", False: "FAIL", None: "warn"}[check.ok]
            print(f"[{mark}] {check.name}: {check.detail}")
    if failed:
        print(f"ddpkit doctor: failed checks: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
