"""Connection-level limits the ASGI app cannot see: a deadline for a request's
headers and a cap on open connections.

uvicorn's own keep-alive timeout only runs between requests and stops at the
first byte, so a client that trickles header bytes (or connects and says
nothing) would hold a connection forever. ``guarded_h11_protocol`` returns
uvicorn's h11 protocol with both limits added; pass it as ``uvicorn.run(...,
http=...)``. The body's read deadline is the app's (``GuardMiddleware``).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("jaxserve.server")

_REFUSED_BODY = (b'{"error": {"message": "too many open connections; retry later", "type": "service_unavailable", '
                 b'"param": null, "code": null}}')
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n" % len(_REFUSED_BODY)) + _REFUSED_BODY


def guarded_h11_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """An ``H11Protocol`` subclass that closes a connection whose next request's headers
    are not complete ``header_timeout_s`` seconds after it opened (or after the previous
    response ended), and answers 503 and closes any connection beyond ``max_connections``."""
    if header_timeout_s <= 0:
        raise ValueError(f"header timeout must be > 0 s, got {header_timeout_s}")
    if max_connections < 1:
        raise ValueError(f"max connections must be >= 1, got {max_connections}")

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("refusing a connection: %d open (--max-connections %d)", len(self.connections) - 1,
                            max_connections)
                transport.write(_REFUSED)
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:   # a request's headers arrived complete
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()   # the next request's headers get their own deadline (pipelined: disarmed at once)
            super().on_response_complete()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
