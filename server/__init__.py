"""OpenAI-compatible HTTP server over ``jaxserve.AsyncEngine`` (see docs/server.md).

``create_app`` is imported on first use (PEP 562): a light module of this package
(``server.errors``, ``server.listing``) can be imported without the engine and JAX,
as the replicas' front does."""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from server.app import create_app
        return create_app
    raise AttributeError(f"module 'server' has no attribute {name!r}")
