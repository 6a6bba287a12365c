"""Test helpers for distributed code, public so users can test their own training code."""

from ddpkit.testing.harness import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
