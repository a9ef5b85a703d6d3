"""The Register call to the kubelet: one attempt, classified as success, retryable or permanent.

The kubelet dials back into the plugin and calls GetDevicePluginOptions inside Register, so the
call is awaited on the event loop that serves the plugin (a blocking call there deadlocks).
The kubelet's side of the call (``registration_server``) is here too, for the simulated kubelet.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from devplugin_sdk._wire import convert
from devplugin_sdk._wire.server import unary
from devplugin_sdk.api import constants
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.errors import RegistrationRejectedError

log = logging.getLogger("devplugin_sdk")

__all__ = ["Outcome", "RegisterCall", "register_once", "registration_server"]


_CHANNEL_OPTIONS = [
    # The kubelet's server punishes pings more often than every 5 minutes: keep keepalive off.
    ("grpc.keepalive_time_ms", 2**31 - 1),
    ("grpc.enable_retries", 0),
]


class Outcome(enum.Enum):
    """How one Register attempt ended."""

    REGISTERED = "registered"
    RETRY = "retry"
    TIMED_OUT = "timed out"


async def register_once(
    kubelet_socket: Path,
    *,
    resource_name: str,
    endpoint: str,
    pre_start_required: bool,
    preferred_allocation: bool,
    timeout: float,
) -> tuple[Outcome, str]:
    """Call Register once.

    Args:
        kubelet_socket: Path of ``kubelet.sock``.
        resource_name: The resource to register.
        endpoint: Our socket's file name in the kubelet's directory.
        pre_start_required: The option as GetDevicePluginOptions will answer it.
        preferred_allocation: Likewise.
        timeout: Deadline of the call, seconds.

    Returns:
        The outcome and, for RETRY/TIMED_OUT, the reason.

    Raises:
        RegistrationRejectedError: the kubelet rejected the version or the resource name.
    """
    request = pb.RegisterRequest(
        version=constants.VERSION,
        endpoint=endpoint,
        resource_name=resource_name,
        options=convert.options(
            pre_start_required=pre_start_required, preferred_allocation=preferred_allocation
        ),
    )
    async with grpc.aio.insecure_channel(
        f"unix:{kubelet_socket}", options=_CHANNEL_OPTIONS
    ) as channel:
        stub = pb_grpc.RegistrationStub(channel)
        try:
            await stub.Register(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if exc.code() is grpc.StatusCode.UNKNOWN and (
                "is not supported by kubelet" in details
                or ("the ResourceName" in details and "is invalid" in details)
            ):
                raise RegistrationRejectedError(
                    f"the kubelet rejected {resource_name!r}: {details}"
                ) from None
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                # Kubelets up to v1.34 may still complete a registration the client gave up on.
                return Outcome.TIMED_OUT, f"no answer within {timeout:g}s"
            return Outcome.RETRY, f"{exc.code().name}: {details}"
    return Outcome.REGISTERED, ""


# ------------------------------------------------------------------ the kubelet's side


@dataclass(frozen=True, slots=True)
class RegisterCall:
    """One Register request as the kubelet's registration server receives it."""

    version: str
    endpoint: str
    resource_name: str
    pre_start_required: bool
    preferred_allocation: bool


def registration_server(
    on_register: Callable[[RegisterCall], Awaitable[str | None]],
) -> grpc.GenericRpcHandler:
    """The kubelet's ``v1beta1.Registration`` service, answering Register with ``on_register``.

    Args:
        on_register: Handles one request; returns None to accept it, or the kubelet's error
            message to reject it.
    """

    async def register(
        request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Empty:
        error = await on_register(
            RegisterCall(
                version=request.version,
                endpoint=request.endpoint,
                resource_name=request.resource_name,
                pre_start_required=request.options.pre_start_required,
                preferred_allocation=request.options.get_preferred_allocation_available,
            )
        )
        if error is not None:
            # The kubelet returns plain Go errors: the plugin sees status UNKNOWN with the message.
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return pb.Empty()

    return grpc.method_handlers_generic_handler(
        "v1beta1.Registration",
        {"Register": unary(register, pb.RegisterRequest, pb.Empty)},
    )
