"""Scheduling policies, registered by name. Importing this package registers them all.

One module per policy family: ``fcfs`` (fcfs, fcfs-improved), ``infercept``,
``lamps`` (lamps, alias mars), ``augserve``, ``sjf`` (sjf, sjf-total),
``prophet``, ``continuum``, ``autellix``. To add one: subclass ``Policy`` in a new
module, decorate it with ``@register_policy("name")`` and import the module here.
"""

from scheduler.policies import (augserve, autellix, continuum, fcfs, infercept, lamps, prophet,  # noqa: F401
                                sjf)  # (registration)
from scheduler.policies.base import Policy, PolicyContext, available_policies, make_policy, register_policy

__all__ = ["Policy", "PolicyContext", "available_policies", "make_policy", "register_policy"]
