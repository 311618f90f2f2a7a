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
