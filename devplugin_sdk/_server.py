"""A grpc.aio server on a unix socket, with the stale-socket rules of the device-plugin dir.

A stale socket file (nobody listening) is removed; a socket that a live server answers is never
stolen. grpcio deletes the socket path when a server stops, even if a newer server bound the same
path since, so callers stop the old server before starting a new one on the same name. The socket
is made 0600 before the server accepts anything, whatever the umask. Connections that carry no
call are closed after ``IDLE_CONNECTION_TIMEOUT`` and at most ``MAX_CONNECTIONS`` are held, so
half-open clients can neither use up the process's file descriptors (which Register, inotify and
CDI need too) nor keep a new kubelet connection out for long.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from pathlib import Path

import anyio
import grpc

from devplugin_sdk._kubelet_watch import FileId, file_id
from devplugin_sdk.api import constants
from devplugin_sdk.errors import SocketInUseError

__all__ = ["SocketVanishedError", "is_live_socket", "prepare_socket_path", "start_server"]


class SocketVanishedError(OSError):
    """Our socket was deleted as soon as it was bound (the kubelet cleaning its directory)."""


#: Seconds a connection may stay open with no call in progress before the server closes it
#: (gRPC GOAWAY, then close). The kubelet's connection is never idle: it calls
#: GetDevicePluginOptions as soon as its dial completes and opens ListAndWatch on the same
#: connection right after, and that stream stays open; a client that comes back after a GOAWAY
#: simply reconnects. Half-open connections (nothing sent, or a lone HTTP/2 preface) count as
#: idle too.
IDLE_CONNECTION_TIMEOUT = 5.0

#: Connections one plugin's server holds at once; past it grpcio closes new ones at once. The
#: kubelet needs one per registration (protocol reference 2.2), a probe or two more; a flood of
#: idle connections holds the slots for at most ``IDLE_CONNECTION_TIMEOUT``, well inside the
#: kubelet's 10 s dial, which keeps retrying.
MAX_CONNECTIONS = 64

#: The mode of the plugin's socket. The kubelet connects as root, so no one else needs it.
SOCKET_MODE = 0o600

_SERVER_OPTIONS = [
    # The kubelet accepts at most 4 MiB per message; fail locally rather than break its stream.
    ("grpc.max_send_message_length", constants.MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", constants.MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_TIMEOUT * 1000)),
    ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
    # Bounds the connection handshake too (grpcio's default is 120 s).
    ("grpc.server_handshake_timeout_ms", int(IDLE_CONNECTION_TIMEOUT * 1000)),
]


def is_live_socket(path: Path) -> bool:
    """Whether a server accepts connections on the unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def prepare_socket_path(path: Path) -> None:
    """Make ``path`` free to bind: remove a stale file, refuse a live server's socket.

    Raises:
        SocketInUseError: another process serves on ``path``.
        ValueError: the path is too long for a unix socket.
    """
    if len(os.fsencode(path)) > constants.MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"socket path {path} is {len(os.fsencode(path))} bytes; unix sockets allow "
            f"{constants.MAX_SOCKET_PATH_BYTES}"
        )
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode) and is_live_socket(path):
        raise SocketInUseError(
            f"{path} is served by another live process (another instance of this plugin?); "
            "refusing to take it over"
        )
    if stat.S_ISDIR(st.st_mode):
        raise SocketInUseError(f"{path} is a directory; cannot serve there")
    path.unlink(missing_ok=True)


async def start_server(
    path: Path, handlers: list[grpc.GenericRpcHandler], *, close_idle: bool = True
) -> tuple[grpc.aio.Server, FileId]:
    """Serve ``handlers`` on the unix socket ``path``; return the server and the socket's identity.

    ``close_idle=False`` keeps connections without a call open (a DRA plugin's socket: the
    kubelet holds its connection idle between calls to see that the plugin is alive).

    Raises:
        SocketInUseError: another process serves on ``path``.
        OSError: the socket could not be bound.
    """
    prepare_socket_path(path)
    options = _SERVER_OPTIONS
    if not close_idle:
        options = [o for o in options if o[0] != "grpc.max_connection_idle_ms"]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers(handlers)
    try:
        server.add_insecure_port(f"unix:{path}")
    except RuntimeError as exc:
        raise OSError(errno.EADDRINUSE, f"cannot bind {path}: {exc}") from exc
    # grpcio binds the path in add_insecure_port with the process's umask (0777 under umask
    # 000) and serves nothing before start(): tighten the mode in between. Changing the umask
    # instead would change it for every thread of the process (a CDI directory created at that
    # moment, say). A socket deleted at once by a starting kubelet is noticed below.
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, SOCKET_MODE)
    # Shielded: a cancellation in the middle would orphan a half-started server, which grpcio
    # then fails to shut down (InvalidStateError); the caller stops what it gets back.
    with anyio.CancelScope(shield=True):
        await server.start()
        identity = file_id(path)
        if identity is None:
            # A starting kubelet deletes every file in its directory, ours included.
            await server.stop(0)
            raise SocketVanishedError(errno.ENOENT, f"{path} vanished right after binding")
    assert identity is not None  # a shielded scope swallows nothing, but mypy cannot tell
    return server, identity
