"""Transport deadlines, which uvicorn lacks: a connection's request line and headers, and
a request's body, must each arrive in time (`deadline_protocol`); else 408 and closed.

Why: an idle or 1-byte/s peer held a connection (and its memory) for ever. The time after
the body (the generation) is not bounded here: a request may wait and generate as long as
the queue and its n allow."""

from __future__ import annotations

import json

from mtplib.serve.errors import ApiError

#: the scope key a connection deadline sets before it closes a request's connection (read
#: by the body reader, which then names the deadline instead of a client that left)
DEADLINE_KEY = "mtplib.deadline"


def deadline_protocol(header_s: float, body_s: float, base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (``base``, default its auto choice) with two deadlines
    per request: the request line and headers within ``header_s`` of the connection or of
    the previous response, the body within ``body_s`` of the headers. A connection past
    one is answered 408 (when it sent part of a request) and closed."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base  # noqa: N813

    class DeadlineProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._seen, self._timer, self._phase, self._bytes = None, None, None, 0
            self._arm("headers")

        def data_received(self, data: bytes) -> None:
            self._bytes += len(data)
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm("headers")
                self._follow()  # a pipelined request may have started in there

        def connection_lost(self, exc) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Move to the body's deadline when a request's headers are in, and off it
            when its body is."""
            c = self.cycle
            if c is not None and c is not self._seen:
                self._seen = c
                self._arm("body" if c.more_body else None)
            elif c is not None and self._phase == "body" and not c.more_body:
                self._arm(None)

        def _arm(self, phase: str | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._phase, self._timer, self._bytes = phase, None, 0
            if phase is not None:
                t = header_s if phase == "headers" else body_s
                self._timer = self.loop.call_later(t, self._expired, phase, t)

        def _expired(self, phase: str, t: float) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            what = (f"no complete request headers within {t:g} s" if phase == "headers"
                    else f"the body did not arrive within {t:g} s of the headers")
            if phase == "body" and self.cycle is not None:
                self.cycle.scope[DEADLINE_KEY] = f"closed: {what}"  # the reader logs it
            if phase == "body" or self._bytes:
                body = json.dumps(ApiError(408, f"request timeout: {what}",
                                           type="timeout_error").body()).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n"
                                     b"content-type: application/json\r\n"
                                     b"connection: close\r\n"
                                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return DeadlineProtocol
