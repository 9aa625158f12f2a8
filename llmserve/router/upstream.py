"""One HTTP/1.1 exchange with a backend, on bare asyncio streams.

The router relays every token of every stream it forwards: with a general client (anyio
streams, a timeout scope per read, h11's event machine) that relay cost about half a
millisecond of the router's CPU per token, which on a small machine is taken from the
engine beside it. The backends are this project's own servers on the local network, so
the exchange here is the plain part of HTTP/1.1 they speak: the request written whole with
`Connection: close`, the response's head read, its body read as it comes (chunked, by
`Content-Length`, or to the close). Failures raise httpx's exceptions, as the proxy reads
them: `httpx.ConnectError` before the request is sent, `httpx.ReadError` after.
"""

import asyncio
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httpx

MAX_HEAD_BYTES = 64 * 1024  # a response's status line and headers
_READ_BYTES = 64 * 1024
# set here, or not to be passed on (an `Expect: 100-continue` would be answered twice)
_NOT_FORWARDED = frozenset({"host", "content-length", "connection", "transfer-encoding",
                            "expect"})


class UpstreamResponse:
    """A backend's answer: status and headers read, the body still on the connection."""

    def __init__(self, status_code: int, headers: httpx.Headers,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.status_code = status_code
        self.headers = headers
        self._reader = reader
        self._writer = writer

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (a chunk of a chunked body at a time)."""
        reader = self._reader
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        return
                    yield (await reader.readexactly(size + 2))[:-2]
            length = self.headers.get("content-length")
            if length is not None:
                left = int(length)
                while left > 0:
                    data = await reader.read(min(left, _READ_BYTES))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
                return
            while data := await reader.read(_READ_BYTES):
                yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                ValueError) as e:
            raise httpx.ReadError(f"{type(e).__name__}: {e}") from None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        """Close the connection (the backend sees it at once: a stream is aborted). Nothing
        is awaited, so it completes in a task being cancelled (a client gone)."""
        self._writer.close()


async def exchange(url: str, method: str, target: str, headers: Mapping[str, str],
                   body: bytes) -> UpstreamResponse:
    """Send the request (`target`: the path and query) to the backend at `url`
    (http://host:port) and read its response's head."""
    parts = urlsplit(url)
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port,
                                                       limit=MAX_HEAD_BYTES)
    except OSError as e:
        raise httpx.ConnectError(f"{type(e).__name__}: {e}") from None
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}",
             f"Content-Length: {len(body)}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items() if k.lower() not in _NOT_FORWARDED)]
    try:
        writer.write("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body)
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        fields = []
        for line in header_lines:
            name, value = line.split(":", 1)
            fields.append((name.strip(), value.strip()))
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
            ValueError, IndexError) as e:
        writer.close()
        raise httpx.ReadError(f"{type(e).__name__}: {e}") from None
    return UpstreamResponse(status, httpx.Headers(fields), reader, writer)
