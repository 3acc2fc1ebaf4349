"""Errors that become gRPC status codes, for every service.

Library code raises `RpcError` (INVALID_ARGUMENT naming the field, NOT_FOUND,
FAILED_PRECONDITION, ...). `grpc_method` wraps a Serve deployment method so
that a gRPC caller (through Serve's proxy) gets that status and details,
while an in-cluster caller holding a DeploymentHandle gets the RpcError
itself. Unexpected exceptions become INTERNAL with a one-line summary, and
the replica stays up.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("rlserve.rpc")


class RpcError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):  # keep the code across Ray's pickling
        return (type(self), (self.code, self.message))


def invalid_argument(field: str, problem: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


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


def _status(err: BaseException) -> RpcError:
    """The RpcError inside `err` (also when Ray wrapped it), or INTERNAL."""
    if isinstance(err, RpcError):
        return err
    cause = getattr(err, "cause", None)
    if isinstance(cause, RpcError):
        return cause
    if isinstance(cause, BaseException):  # a Ray task error: report what the task raised
        err = cause
    return RpcError(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}".splitlines()[0][:500])


def _with_grpc_context(wrapper: Callable[..., Any], fn: Callable[..., Any]) -> None:
    """Advertise a `grpc_context` keyword: Serve passes it only to methods whose signature has one."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "grpc_context"]
    params.append(inspect.Parameter("grpc_context", inspect.Parameter.KEYWORD_ONLY, default=None))
    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]


def grpc_method(fn: F) -> F:
    """Adapt one RPC method of a Serve deployment (sync, async or async generator)."""

    def fail(err: BaseException, grpc_context: Any) -> RpcError:
        status = _status(err)
        if status.code == grpc.StatusCode.INTERNAL:
            log.exception("rpc=%s internal error", fn.__name__)
        if grpc_context is not None:
            grpc_context.set_code(status.code)
            grpc_context.set_details(status.message)
        return status

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, grpc_context=None):
            try:
                async for item in fn(self, request):
                    yield item
            except Exception as err:  # noqa: BLE001 - every failure becomes a status
                raise fail(err, grpc_context) from None
        _with_grpc_context(stream, fn)
        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    async def unary(self, request, *extra, grpc_context=None):
        try:
            result = fn(self, request, *extra)
            if inspect.isawaitable(result):
                result = await result
            return result
        except Exception as err:  # noqa: BLE001 - every failure becomes a status
            raise fail(err, grpc_context) from None
    _with_grpc_context(unary, fn)
    return unary  # type: ignore[return-value]
