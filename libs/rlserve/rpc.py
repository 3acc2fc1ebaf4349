"""Errors that become gRPC status codes, for every service.

Library code raises `RpcError` (INVALID_ARGUMENT naming the field, NOT_FOUND,
FAILED_PRECONDITION, PERMISSION_DENIED, ...). Every caller of a service holds
a DeploymentHandle (the coordinator, and the public gateway that turns the
error into the gRPC status), so `grpc_method` only normalises what a method
raises: an RpcError passes as it is, anything else becomes INTERNAL with one
clean line (no traceback, no terminal colour codes), logged in full where it
happened. `status_of` reads the status back out of whatever a handle call
raised, Ray's wrappers included.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("rlserve.rpc")

# Status messages travel in HTTP/2 trailers; keep them short.
MAX_MESSAGE_CHARS = 1000
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class RpcError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):  # keep the code across Ray's pickling
        return (type(self), (self.code, self.message))


def invalid_argument(field: str, problem: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def permission_denied(field: str, problem: str) -> RpcError:
    return RpcError(grpc.StatusCode.PERMISSION_DENIED, f"{field}: {problem}")


def out_of_range(field: str, problem: str) -> RpcError:
    """A well-formed value past a limit the caller cannot change (a conversation longer than the run's
    context), as against INVALID_ARGUMENT's malformed one: a client may handle it by ending what it does."""
    return RpcError(grpc.StatusCode.OUT_OF_RANGE, f"{field}: {problem}")


def not_found(what: str) -> RpcError:
    return RpcError(grpc.StatusCode.NOT_FOUND, what)


def already_exists(what: str) -> RpcError:
    return RpcError(grpc.StatusCode.ALREADY_EXISTS, what)


def failed_precondition(problem: str) -> RpcError:
    return RpcError(grpc.StatusCode.FAILED_PRECONDITION, problem)


def unavailable(problem: str) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, problem)


def aborted(problem: str) -> RpcError:
    """State the caller relies on is gone (a session lost, a sequence broken): retrying the same call
    cannot help; the caller must redo a larger sequence (reconfigure, restore a checkpoint)."""
    return RpcError(grpc.StatusCode.ABORTED, problem)


def clean(text: str) -> str:
    """One line of `text` without terminal colour codes, at most MAX_MESSAGE_CHARS long."""
    text = _ANSI.sub("", text).strip()
    line = text.splitlines()[0] if text else ""
    return line[:MAX_MESSAGE_CHARS]


def _one_line(err: BaseException) -> str:
    return clean(f"{type(err).__name__}: {err}") if str(err) else type(err).__name__


def status_of(err: BaseException) -> RpcError:
    """The status a failed call means, also when Ray or Serve wrapped the RpcError.

    Serve's own failures map to what they mean for a caller (a replica or
    deployment that is gone: UNAVAILABLE; back-pressure: RESOURCE_EXHAUSTED);
    anything unexpected is INTERNAL with one clean line.
    """
    from ray import exceptions as ray_errors
    from ray.serve import exceptions as serve_errors

    cause = getattr(err, "cause", None)
    if isinstance(cause, RpcError):
        return RpcError(cause.code, clean(cause.message))
    if isinstance(err, RpcError):
        return RpcError(err.code, clean(err.message))
    if isinstance(err, grpc.aio.AioRpcError):
        return RpcError(err.code(), clean(err.details() or ""))
    if isinstance(err, (asyncio.TimeoutError, TimeoutError, ray_errors.GetTimeoutError)):
        return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "timed out")
    if isinstance(err, serve_errors.BackPressureError):
        return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, clean(str(err)))
    if isinstance(err, (serve_errors.RequestCancelledError, asyncio.CancelledError)):
        return RpcError(grpc.StatusCode.CANCELLED, "cancelled")
    if isinstance(err, (serve_errors.DeploymentUnavailableError, ray_errors.RayActorError,
                        ray_errors.ActorUnavailableError, ray_errors.NodeDiedError)):
        return RpcError(grpc.StatusCode.UNAVAILABLE, _one_line(err))
    if isinstance(err, ray_errors.RayTaskError) and isinstance(cause, BaseException):
        err = cause  # report what the task raised, not Ray's wrapper (a traceback in colour)
    return RpcError(grpc.StatusCode.INTERNAL, _one_line(err))


def grpc_method(fn: F) -> F:
    """Adapt one RPC method of a Serve deployment (sync, async or async generator)."""

    def fail(err: BaseException) -> RpcError:
        status = status_of(err)
        if status.code == grpc.StatusCode.INTERNAL:
            log.exception("rpc=%s internal error", fn.__name__)
        return status

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, *extra):
            try:
                async for item in fn(self, request, *extra):
                    yield item
            except Exception as err:  # noqa: BLE001 - every failure becomes a status
                raise fail(err) from None
        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    async def unary(self, request, *extra):
        try:
            result = fn(self, request, *extra)
            if inspect.isawaitable(result):
                result = await result
            return result
        except Exception as err:  # noqa: BLE001 - every failure becomes a status
            raise fail(err) from None
    return unary  # type: ignore[return-value]
