"""A learned output-length predictor: a small probe on the served model's own
final hidden state (DESIGN / docs/scheduling.md "Learned length predictor").

Modules: ``bins`` (LAMPS's 50 × 10-token bins and metrics), ``probe`` (the
head, pure ``jnp``), ``checkpoint`` (orbax, bound to one model), ``dataset``
(trace text segments -> examples, grain batches), ``features`` (hidden
states with jaxserve's model), ``train`` (optax), ``sim_cache`` (predictions
for the simulator), ``cli`` (``jaxserve predictor train|eval``).
"""
