"""ZeroMQ sockets with CURVE authentication: the only module that imports zmq.

The controller binds a ROUTER socket as a CURVE server and accepts only clients that
hold the run's worker key (checked by pyzmq's ZAP authenticator). Workers connect a
DEALER as CURVE clients. Keys are generated per run into ``<run>/keys`` (files 0600):

    keys/controller.key_secret   controller's key pair (public + secret)
    keys/worker.key_secret       the workers' key pair
    keys/authorized/worker.key   the public key the controller accepts

``python -m core.wire.transport keygen DIR`` generates them (the login-node CLI runs it as a
subprocess so that it never imports zmq itself).
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import monitor as zmq_monitor

from core.errors import ExitCode

Frames = Sequence[Any]
log = logging.getLogger(__name__)

REFUSAL_LOG_S = 10.0
_REFUSALS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_REFUSAL_WHY = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "not the run's worker key (CURVE)",
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not CURVE with this run's keys (protocol)",
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed"}

# Frames below this size are copied: for small messages a copy is far cheaper than
# zero-copy bookkeeping (measured: ~10 µs per zero-copy frame vs ~1 µs per copied one).
# pyzmq applies the same threshold itself to a send with copy=False (COPY_THRESHOLD).
_ZERO_COPY_MIN = 65536
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVTIMEO = int(zmq.RCVTIMEO)
# The hot path calls the Cython socket's methods directly: the sugar layer's wrappers
# (routing_id/group handling, attribute lookups such as ``sock.rcvmore``, which costs
# ~3 µs) are a large share of a small message's cost.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv


def _send_frames(sock: Any, frames: Frames, first: bytes | None = None) -> None:
    """Routing frame (if any) and header copied; array frames zero-copy when large."""
    if first is not None:
        _send(sock, first, _SNDMORE, True)
    last = len(frames) - 1
    _send(sock, frames[0], _SNDMORE if last else 0, True)
    for i in range(1, last + 1):
        _send(sock, frames[i], _SNDMORE if i < last else 0, False)


def _more_frames(sock: Any, parts: list[Any]) -> None:
    """The rest of a multipart message: array frames zero-copy when large."""
    while True:
        frame = _recv(sock, 0, False)
        parts.append(frame.bytes if len(frame) < _ZERO_COPY_MIN else frame)
        if not frame.more:
            return


def _recv_frames(sock: Any, flags: int = 0, *, routed: bool = False) -> list[Any]:
    """Routing and header frames as bytes; array frames (after the header) as zero-copy
    zmq.Frame buffers when large. ``routed``: the first frame is a ROUTER's peer identity,
    always followed by more."""
    parts: list[Any] = []
    if routed:
        parts.append(_recv(sock, flags, True))
        flags = 0
    frame = _recv(sock, flags, False)
    parts.append(frame.bytes)
    if frame.more:
        _more_frames(sock, parts)
    return parts


def recv_or_none(sock: Any) -> list[Any] | None:
    """A DEALER's next message, waiting at most its receive timeout (``set_timeout``), or None."""
    try:
        frame = _recv(sock, 0, False)
    except zmq.Again:
        return None
    parts = [frame.bytes]
    if frame.more:
        _more_frames(sock, parts)
    return parts


def recv_routed_or_none(sock: Any) -> tuple[bytes, list[Any]] | None:
    """A ROUTER's next (peer identity, frames), waiting at most its receive timeout, or None."""
    try:
        identity = _recv(sock, 0, True)
    except zmq.Again:
        return None
    frame = _recv(sock, 0, False)
    parts = [frame.bytes]
    if frame.more:
        _more_frames(sock, parts)
    return identity, parts


def send_routed(sock: Any, identity: bytes, frames: Frames) -> bool:
    """Send one message on a ROUTER to the peer ``identity``; False if it is no longer connected."""
    try:
        _send_frames(sock, frames, identity)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    return True


def send_frames(sock: Any, frames: Frames) -> None:
    """Send one message on a DEALER (see ``_send_frames``)."""
    _send_frames(sock, frames)


class _Timeout:
    """RCVTIMEO set only when it changes: a blocking recv with a timeout is cheaper than
    a poll followed by a recv."""

    __slots__ = ("sock", "ms")

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.ms = -2

    def set(self, timeout_s: float) -> None:
        ms = max(0, int(timeout_s * 1000))
        if ms != self.ms:
            self.sock.setsockopt(_RCVTIMEO, ms)
            self.ms = ms


def generate_keys(keys_dir: Path) -> None:
    """Create the run's two CURVE key pairs (mode 0600, folder 0700)."""
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    with tempfile.TemporaryDirectory(dir=keys_dir) as tmp:
        zmq.auth.create_certificates(tmp, "controller")
        zmq.auth.create_certificates(tmp, "worker")
        authorized = keys_dir / "authorized"
        authorized.mkdir(mode=0o700, exist_ok=True)
        for src, dst in [
            ("controller.key_secret", keys_dir / "controller.key_secret"),
            ("worker.key_secret", keys_dir / "worker.key_secret"),
            ("worker.key", authorized / "worker.key"),
        ]:
            os.chmod(Path(tmp) / src, 0o600)
            shutil.move(str(Path(tmp) / src), dst)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"{path}: cannot read CURVE key ({exc}); the run folder's keys/ is incomplete") from None
    return public, secret


class ControllerSocket:
    """ROUTER bound on a random port; CURVE server; only the workers' key may connect.

    One calling style on both sides of the wire: ``send``, ``recv`` (waits up to the
    timeout set by ``set_timeout``), ``recv_nowait``. They are the module's functions
    bound to this socket (``functools.partial``, built in C): a serving loop that calls
    ``sock.recv()`` runs one Python frame per message, as if it called zmq itself.
    """

    def __init__(self, keys_dir: Path, *, bind_host: str = "*") -> None:
        self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(keys_dir / "authorized"))
        public, secret = _load(keys_dir / "controller.key_secret")
        self.public_key = public
        sock = self.ctx.socket(zmq.ROUTER)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises, not drops
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        self.port = sock.bind_to_random_port(f"tcp://{bind_host}")
        self._sock = sock
        self.set_timeout = _Timeout(sock).set
        self.send: Callable[[bytes, Frames], bool] = functools.partial(send_routed, sock)
        self.recv: Callable[[], tuple[bytes, list[Any]] | None] = functools.partial(recv_routed_or_none, sock)
        self._watch = _RefusalLog(sock)
        self._watch.start()

    def recv_nowait(self) -> tuple[bytes, list[Any]] | None:
        """The next (identity, frames) if one is queued, else None."""
        try:
            parts = _recv_frames(self._sock, _NOBLOCK, routed=True)
        except zmq.Again:
            return None
        return parts[0], parts[1:]

    def close(self) -> None:
        self._watch.stop()
        self._sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()


class _RefusalLog(threading.Thread):
    """Logs the clients the controller's socket refuses (no CURVE, another key, another protocol),
    with their address: one warning at once, then at most one every REFUSAL_LOG_S counting the
    others, so a port scan cannot flood the log. Reads the socket's monitor events."""

    def __init__(self, sock: Any) -> None:
        super().__init__(name="baton-refusals", daemon=True)
        self._monitor = sock.get_monitor_socket(_REFUSALS)
        self._sock = sock
        self._stopping = threading.Event()
        self.refused = 0
        self._unreported = 0
        self._next_report = 0.0

    def run(self) -> None:
        while not self._stopping.is_set():
            if not self._monitor.poll(200):
                continue
            try:
                event = zmq_monitor.recv_monitor_message(self._monitor)
            except zmq.ZMQError:
                return
            self._note(event)

    def _note(self, event: dict[str, Any]) -> None:
        self.refused += 1
        self._unreported += 1
        now = time.monotonic()
        if now < self._next_report:
            return
        peer = event.get("endpoint", b"?")
        peer = peer.decode(errors="replace") if isinstance(peer, bytes) else str(peer)
        others = f" ({self._unreported - 1} more since the last report)" if self._unreported > 1 else ""
        log.warning("refused a client at %s: %s%s", peer, _REFUSAL_WHY.get(event.get("event"), "handshake failed"),
                    others)
        self._unreported, self._next_report = 0, now + REFUSAL_LOG_S

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=2)
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)


class WorkerSocket:
    """DEALER connected to the controller as a CURVE client (one per thread).

    The calling style of ``ControllerSocket``: ``send(frames)``, ``recv()`` (up to the
    timeout of ``set_timeout``), ``recv_within(s)``, ``recv_nowait()``. Sockets of one
    process may share a context (``share_context_with``): one I/O thread then serves them
    all; the context ends with the socket that created it.
    """

    def __init__(self, address: str, keys_dir: Path, *, identity: bytes,
                 share_context_with: WorkerSocket | None = None) -> None:
        self._owns_ctx = share_context_with is None
        self.ctx = zmq.Context() if share_context_with is None else share_context_with.ctx
        server_public, _ = _load(keys_dir / "controller.key_secret")
        public, secret = _load(keys_dir / "worker.key_secret")
        sock = self.ctx.socket(zmq.DEALER)
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(address)
        self._sock = sock
        self.zmq_socket = sock  # for a zmq.Poller over many sockets in one thread (a benchmark's hosts)
        self.set_timeout = _Timeout(sock).set
        self.send: Callable[[Frames], None] = functools.partial(send_frames, sock)
        self.recv: Callable[[], list[Any] | None] = functools.partial(recv_or_none, sock)

    def recv_within(self, timeout_s: float) -> list[Any] | None:
        """The next message's frames, or None after ``timeout_s``."""
        self.set_timeout(timeout_s)
        return self.recv()

    def recv_nowait(self) -> list[Any] | None:
        """The next message's frames if one is queued, else None."""
        try:
            return _recv_frames(self._sock, _NOBLOCK)
        except zmq.Again:
            return None

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._owns_ctx:
            self.ctx.destroy(linger=0)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "keygen":
        print("usage: python -m core.wire.transport keygen KEYS_DIR", file=sys.stderr)
        return ExitCode.USER_ERROR
    generate_keys(Path(argv[1]))
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
