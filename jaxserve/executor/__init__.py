"""Executors: apply a ``StepPlan`` and return a ``StepResult``.

``executor.model.ModelExecutor`` runs the real model (JAX); ``executor.sim.SimExecutor``
advances a simulated clock by a cost model. ``jaxserve.core.EngineCore`` drives either.
Import the submodules directly: the model executor imports JAX, the simulated one does not.
"""
