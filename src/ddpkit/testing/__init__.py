"""Test helpers for distributed code, public so users can test their own training code."""

from ddpkit.launch.spawn import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
