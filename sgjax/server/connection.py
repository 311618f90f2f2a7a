"""Socket and ASGI helpers the server and the router share (no engine import: the router process has no model)."""

from __future__ import annotations

import asyncio
import socket


class ClientDisconnected(Exception):
    pass


def check_port(host: str, port: int) -> None:
    """Exit with a message naming the address when it cannot be listened on (before any model loads)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise SystemExit(f"cannot listen on {host}:{port}: {e}") from None


async def until_disconnected(receive, coro):
    """Run `coro` unless the client disconnects first; then cancel it (the engine aborts a cancelled
    async_generate; the router's cancelled call closes its connection to the worker, whose server aborts) and
    raise ClientDisconnected."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, gone):
            if not t.done():
                t.cancel()
    if work in done:
        return work.result()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientDisconnected()


async def _wait_disconnect(receive) -> None:
    # Once the body is read, the ASGI server's next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol with a deadline for each request's line and headers: uvicorn times out idle keep-alive
    connections but not one that sends half a request and stalls (slowloris). The connection is closed when a
    request has not fully arrived `seconds` after its first byte (or after the connection opened)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self._header_timer is None:
                self._arm()
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the request line and headers are in: the route has its own limits

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return HeaderTimeoutH11
