"""Point-to-point message streams between ranks: one TCP connection per (sender, receiver,
tag), frames of a length and bytes, for rank 0's step messages and a pipeline's
activations.

Why not gloo's send and receive: gloo sends a buffer only once its receiver has posted
the matching receive (a notice, a reply, then the data), so a message the receiver was
not already waiting for costs one and a half round trips, and a step's messages follow
one another: across hosts 50 ms apart a PP=2 decode step took 515 ms where one round trip
(100 ms) is the floor. Here a send is queued and written by a thread of its own (never
waiting for a busy receiver), the kernel buffers it, and a receiver reads it when it gets
there: a message costs half a round trip, and messages to different ranks go out at once.

Connections are made on first use: a sender connects to the receiver's listener (its
address published in the store, `reach/<rank>`, the one `ranks.check_reachable` checked)
and says who it is and which stream; the receiver's accept thread files the socket under
that. TCP_NODELAY (no Nagle wait on small frames) and keepalive (a host that vanishes
without closing its connections is seen within about 20 s) on every socket.
"""

import logging
import queue
import socket
import struct
import threading
from typing import Any

logger = logging.getLogger(__name__)

HELLO = struct.Struct("<ii")  # sender rank, tag
LENGTH = struct.Struct("<Q")


class ChannelClosed(RuntimeError):
    """The other end went away."""


class Channels:
    """This rank's streams to and from the others (see the module docstring)."""

    def __init__(self, rank: int, listener: socket.socket, store: Any) -> None:
        self.rank = rank
        self.store = store
        self._listener = listener
        self._incoming: dict[tuple[int, int], socket.socket] = {}
        self._arrived = threading.Condition()
        self._outgoing: dict[tuple[int, int], _Sender] = {}
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, daemon=True,
                                          name="llmserve-channels")
        self._acceptor.start()

    # ---- sending -----------------------------------------------------------------------

    def send(self, dst: int, tag: int, *parts: Any) -> None:
        """Queue one frame of `parts` (bytes-like: bytes, a numpy array, a memoryview;
        kept until written) for `dst` on stream `tag`; returns at once."""
        sender = self._outgoing.get((dst, tag))
        if sender is None:
            sender = self._outgoing[(dst, tag)] = _Sender(self._connect(dst, tag), dst)
        sender.put(parts)

    def flush(self) -> None:
        """Wait until every queued frame is written."""
        for sender in self._outgoing.values():
            sender.drain()

    def _connect(self, dst: int, tag: int) -> socket.socket:
        host, port = self.store.get(f"reach/{dst}").decode().rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.settimeout(None)
        _tune(sock)
        sock.sendall(HELLO.pack(self.rank, tag))
        return sock

    # ---- receiving ---------------------------------------------------------------------

    def receive(self, src: int, tag: int, into: memoryview | None = None) -> bytes | None:
        """The next frame from `src` on stream `tag`: its bytes, or read into `into`
        (which must be its exact size; returns None)."""
        sock = self._incoming_socket(src, tag)
        header = _read_exact(sock, LENGTH.size, src)
        (length,) = LENGTH.unpack(header)
        if into is not None:
            into = into.cast("B") if into.format != "B" or into.ndim != 1 else into
            if into.nbytes != length:
                raise RuntimeError(f"a frame of {length} bytes from rank {src} for a buffer "
                                   f"of {into.nbytes}")
            _read_into(sock, into, src)
            return None
        buffer = bytearray(length)
        _read_into(sock, memoryview(buffer), src)
        return bytes(buffer)

    def _incoming_socket(self, src: int, tag: int) -> socket.socket:
        with self._arrived:
            while (src, tag) not in self._incoming:
                if self._closed:
                    raise ChannelClosed("the channels are closed")
                self._arrived.wait(1.0)
            return self._incoming[(src, tag)]

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                sock.settimeout(30)
                src, tag = HELLO.unpack(_read_exact(sock, HELLO.size, -1))
                sock.settimeout(None)
            except (OSError, ChannelClosed):
                sock.close()  # a reachability probe (`check_reachable`), or a dead peer
                continue
            _tune(sock)
            with self._arrived:
                self._incoming[(src, tag)] = sock
                self._arrived.notify_all()

    def close(self) -> None:
        self._closed = True
        for sender in self._outgoing.values():
            sender.close()
        for sock in self._incoming.values():
            sock.close()
        self._listener.close()
        with self._arrived:
            self._arrived.notify_all()


class _Sender:
    """One outgoing stream: frames queued, written in order by its own thread."""

    def __init__(self, sock: socket.socket, dst: int) -> None:
        self.sock = sock
        self.dst = dst
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"llmserve-send-{dst}")
        self._thread.start()

    def put(self, parts: tuple) -> None:
        if self.error is not None:
            raise ChannelClosed(f"rank {self.dst} went away ({self.error})")
        self._queue.put(parts)

    def drain(self) -> None:
        self._queue.join()
        if self.error is not None:
            raise ChannelClosed(f"rank {self.dst} went away ({self.error})")

    def _run(self) -> None:
        while True:
            parts = self._queue.get()
            try:
                if parts is None:
                    return
                if self.error is None:
                    views = [memoryview(p).cast("B") for p in parts]
                    self.sock.sendall(LENGTH.pack(sum(len(v) for v in views)))
                    for view in views:
                        self.sock.sendall(view)
            except OSError as exc:
                self.error = exc
            finally:
                self._queue.task_done()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        self.sock.close()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _read_exact(sock: socket.socket, n: int, src: int) -> bytes:
    buffer = bytearray(n)
    _read_into(sock, memoryview(buffer), src)
    return bytes(buffer)


def _read_into(sock: socket.socket, view: memoryview, src: int) -> None:
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except OSError as exc:
            raise ChannelClosed(f"rank {src} went away ({exc})") from None
        if n == 0:
            raise ChannelClosed(f"rank {src} went away (its connection closed)")
        got += n
