"""uvicorn's HTTP/1.1 protocol with a deadline for each request's head.

uvicorn (0.55) closes an idle keep-alive connection after `timeout_keep_alive`, but a
connection that sends part of a request line or headers and then waits is held forever (any
byte cancels the keep-alive timer): 800 such sockets stayed open against a server here, each a
file descriptor and a protocol object. A connection must now complete a request's head within
`head_wait_s` (serve --head-timeout) of opening, or of its previous response ending; else
it is closed.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_WAIT_S = 30.0  # generous for a slow network; a stalled client frees its socket after it


class DeadlineH11Protocol(H11Protocol):
    head_wait_s = HEAD_WAIT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        armed = self.cycle  # the request before the head awaited (None: the first)

        def late() -> None:
            if self.cycle is armed and not self.transport.is_closing():  # no new head came
                self.transport.close()

        self._head_timer = self.loop.call_later(self.head_wait_s, late)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_timer.cancel()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)


def with_deadline(seconds: float) -> type[DeadlineH11Protocol]:
    """The protocol class with a head deadline of `seconds`."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"head_wait_s": seconds})
