"""gRPC errors that name the field, the item and the fix.

Service code raises `ServiceError`; the `handle_errors` decorator on each servicer method turns it
into a gRPC status, so one bad request never takes the server down and other callers keep being
served.

Every status a service returns this way is final: it carries gRPC's retry pushback trailer
(`grpc-retry-pushback-ms: -1`), which tells a client channel's retry policy not to send the call
again. A service that answers UNAVAILABLE has already done its own retrying (e.g. the reward
service over its remote servers), so a channel retry would only multiply the attempts; channel
retries are left for failures that never reached a service (connection refused or reset).
"""

import functools
import inspect
import logging
import traceback

import grpc

_log = logging.getLogger("rlmesh.errors")


class ServiceError(Exception):
    """An error to return to the caller with a gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(field: str, item: str | None, problem: str, fix: str) -> ServiceError:
    """INVALID_ARGUMENT naming the field, the offending item (e.g. "prompt 'p3'") and the fix."""
    where = f"{field} of {item}" if item else field
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {problem}; fix: {fix}")


def failed_precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


# gRPC's retry pushback (gRFC A6): a negative value means "do not retry this call".
FINAL_TRAILER = (("grpc-retry-pushback-ms", "-1"),)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, name: str):
    if isinstance(exc, ServiceError):
        await context.abort(exc.code, exc.message, FINAL_TRAILER)
    _log.error("unhandled error in %s: %s\n%s", name, exc, traceback.format_exc())
    await context.abort(grpc.StatusCode.INTERNAL, f"{name} failed: {type(exc).__name__}: {exc}", FINAL_TRAILER)


def handle_errors(method):
    """Decorates an async servicer method (unary or async-generator streaming)."""
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - every error becomes a status
                await _abort(context, exc, name)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, name)

    return unary_wrapper
