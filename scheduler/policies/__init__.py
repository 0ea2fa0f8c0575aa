"""Scheduling policies, registered by name. Importing this package registers them all."""

from scheduler.policies import fcfs, infercept  # noqa: F401  (registration side effects)
from scheduler.policies.base import Policy, available_policies, make_policy, register_policy

__all__ = ["Policy", "available_policies", "make_policy", "register_policy"]
