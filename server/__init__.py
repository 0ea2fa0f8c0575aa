"""OpenAI-compatible HTTP server over ``jaxserve.AsyncEngine`` (see docs/server.md)."""

from server.app import create_app

__all__ = ["create_app"]
