"""A grpc.aio server on a unix socket, with the stale-socket rules of the device-plugin dir.

A stale socket file (nobody listening) is removed; a socket that a live server answers is never
stolen. grpcio deletes the path it bound when a server stops, even if a newer server bound the
same path since. So a server is either started on its final path (``start_server``; the old
server must stop first), or staged: bound on a private path in ``STAGING_DIR`` and then renamed
onto its final path (``start_staged``, ``publish``), which leaves grpcio nothing to delete there
and lets the next server start, and register, before the old one stops. The socket is made 0600
before the server accepts anything, whatever the umask. Connections that carry no call are
closed after ``IDLE_CONNECTION_TIMEOUT`` and at most ``MAX_CONNECTIONS`` are held, so half-open
clients can neither use up the process's file descriptors (which Register, inotify and CDI need
too) nor keep a new kubelet connection out for long.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
import socket
import stat
from collections.abc import Awaitable, Callable, Container
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import grpc

from devplugin_sdk.api import constants
from devplugin_sdk.errors import SocketInUseError

if TYPE_CHECKING:
    from google.protobuf.message import Message

__all__ = [
    "STAGING_DIR",
    "FileId",
    "SocketVanishedError",
    "file_id",
    "is_live_socket",
    "prepare_socket_path",
    "publish",
    "remove_socket",
    "remove_staging",
    "staged_path",
    "start_server",
    "start_staged",
    "unary",
]


FileId = tuple[int, int, int]


def file_id(path: Path) -> FileId | None:
    """Identity of the file at ``path`` (not following symlinks), or None if it does not exist.

    Inode numbers are reused at once when a file is deleted and another created (the kubelet
    deletes our socket, then creates kubelet.sock), so the creation-time ctime is part of it.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


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

#: Subdirectory of the device-plugin directory where servers are bound before their socket is
#: renamed into place: on the same filesystem (a rename cannot cross one), and out of reach of
#: the kubelet, which at start removes every entry of its directory but subdirectories.
STAGING_DIR = ".devplugin-sdk"

# Staged names: unique per process (several plugin processes may share the directory) and per
# server, short (unix socket paths are limited to 107 bytes).
_STAGED_PREFIX = secrets.token_hex(4)
_staged_numbers = itertools.count()

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


def unary(
    method: Callable[[Any, Any], Awaitable[Any]], request: type[Message], response: type[Message]
) -> grpc.RpcMethodHandler[Any, Any]:
    """A unary call's handler: `request` messages in, `response` messages out, as protobuf."""
    return grpc.unary_unary_rpc_method_handler(
        method,
        request_deserializer=request.FromString,
        response_serializer=response.SerializeToString,
    )


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
    server = await _bound(path, handlers, close_idle=close_idle)
    # Shielded: see _bound.
    with anyio.CancelScope(shield=True):
        identity = file_id(path)
        if identity is None:
            # A starting kubelet deletes every file in its directory, ours included.
            await server.stop(0)
            raise SocketVanishedError(errno.ENOENT, f"{path} vanished right after binding")
    assert identity is not None  # a shielded scope swallows nothing, but mypy cannot tell
    return server, identity


def staged_path(directory: Path) -> Path | None:
    """A fresh private path to stage a server in ``directory``; None when it would be too long
    for a unix socket (serve on the final path then)."""
    path = directory / STAGING_DIR / f"{_STAGED_PREFIX}-{next(_staged_numbers)}"
    return None if len(os.fsencode(path)) > constants.MAX_SOCKET_PATH_BYTES else path


async def start_staged(path: Path, handlers: list[grpc.GenericRpcHandler]) -> grpc.aio.Server:
    """Serve ``handlers`` on the private path ``path`` (from ``staged_path``); ``publish`` it.

    Raises:
        OSError: the staging directory or the socket could not be made.
    """
    path.parent.mkdir(mode=0o700, exist_ok=True)
    return await _bound(path, handlers)


def publish(staged: Path, path: Path, *, replaceable: Container[FileId] = ()) -> FileId:
    """Move a staged server's socket onto ``path``, under the stale-socket rules.

    A socket at ``path`` whose identity is in ``replaceable`` (an older server of ours) is
    replaced; any other goes through ``prepare_socket_path``. The rename is atomic: a client
    dialing ``path`` reaches one server or the other, never nothing.

    Returns:
        The identity of the socket at ``path``.

    Raises:
        SocketInUseError: another process serves on ``path``.
        SocketVanishedError: the socket was deleted as soon as it was moved (a starting
            kubelet cleaning its directory).
        OSError: the rename failed.
    """
    current = file_id(path)
    if current is not None and current not in replaceable:
        prepare_socket_path(path)
    os.rename(staged, path)
    identity = file_id(path)
    if identity is None:
        raise SocketVanishedError(errno.ENOENT, f"{path} vanished right after it was moved there")
    return identity


def remove_socket(path: Path, identity: FileId | None) -> None:
    """Remove the socket at ``path`` if it is still the one with ``identity`` (a stopped staged
    server leaves its published socket behind: grpcio only removes the path it bound)."""
    if identity is not None and file_id(path) == identity:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_staging(directory: Path) -> None:
    """Clean ``directory``'s staging subdirectory: remove what no live server answers (left
    by a process that was killed), then the subdirectory itself once it is empty."""
    staging = directory / STAGING_DIR
    try:
        entries = list(staging.iterdir())
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            if not stat.S_ISDIR(entry.lstat().st_mode) and not is_live_socket(entry):
                entry.unlink()
    with contextlib.suppress(OSError):
        staging.rmdir()


async def _bound(
    path: Path, handlers: list[grpc.GenericRpcHandler], *, close_idle: bool = True
) -> grpc.aio.Server:
    """A started server on ``path`` (0600)."""
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
    return server
