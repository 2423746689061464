"""uvicorn's HTTP/1.1 protocol with a deadline on each request's head.

uvicorn closes a connection that stays idle between requests (``timeout_keep_alive``), but it never times out a
request's head once its first byte has arrived, nor a connection that sends nothing after connecting: a client that
opens connections and trickles a header a minute (slowloris) holds each one, and its buffers, for as long as it
likes. Here every connection must send a whole request line and headers within ``header_timeout_s``
(``MOBIZO_HEADER_TIMEOUT_S``) of opening, and again of each answer it was sent; otherwise it is closed. A body's
pace is the upload routes' own rule (``server.uploads``), not this one.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` (uvicorn's default where httptools is installed) plus the head deadline. uvicorn takes
    the class (``http=``) and builds one per connection; the deadline is read from the process's settings, so that
    every API process (``--workers``) applies the same one."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head, if the connection is kept

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        from server.settings import get_settings

        self._disarm()
        self._head_deadline = self.loop.call_later(get_settings().header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.cycle is None or self.cycle.response_complete:  # no request is being answered
            log.info("closing a connection that sent no whole request head in time")
            self.transport.close()
