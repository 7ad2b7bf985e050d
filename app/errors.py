"""API errors: every failure answers `{"error": {"type", "message"}}` with its status."""

from __future__ import annotations

import logging
import uuid
from enum import Enum

from fastapi import FastAPI, Request
from pydantic import BaseModel
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from runtime.jobs import JobCancelled, QueueFull

from app.collections.names import name_problem
from app.security_headers import SECURITY_HEADERS
from retrieval.store_types import COLLECTION_NAME_PATTERN, StoreUnavailableError

logger = logging.getLogger(__name__)


class ErrorType(str, Enum):
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    NOT_FOUND = "not_found_error"
    CONFLICT = "conflict_error"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    OVERLOADED = "overloaded_error"
    NOT_READY = "not_ready"
    UNAVAILABLE = "service_unavailable"
    INSUFFICIENT_STORAGE = "insufficient_storage"
    SERVER = "server_error"


class ApiError(Exception):
    status_code = 400
    error_type = ErrorType.INVALID_REQUEST

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequestError(ApiError):
    status_code = 422


class UnsupportedParameterError(ApiError):
    """An OpenAI parameter ragblend does not implement (400, as vLLM answers)."""

    status_code = 400


class NotFoundError(ApiError):
    status_code = 404
    error_type = ErrorType.NOT_FOUND


class PermissionDeniedError(ApiError):
    """What the caller may not do: a known key whose role or scope does not allow it (only where it already
    sees the resource: what lies outside its collections reads as not found, 404), or scoped keys asked of a server
    that has no API key of its own (they would protect nothing there)."""

    status_code = 403
    error_type = ErrorType.PERMISSION


class ConflictError(ApiError):
    status_code = 409
    error_type = ErrorType.CONFLICT


class AuthenticationError(ApiError):
    status_code = 401
    error_type = ErrorType.AUTHENTICATION

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class PayloadTooLargeError(ApiError):
    status_code = 413
    error_type = ErrorType.PAYLOAD_TOO_LARGE


class ClientClosedError(ApiError):
    status_code = 499  # nginx's "client closed request": nobody reads it, but logs and metrics do
    error_type = ErrorType.INVALID_REQUEST


class NotReadyError(ApiError):
    status_code = 503
    error_type = ErrorType.NOT_READY


class QueueFullError(ApiError):
    status_code = 503
    error_type = ErrorType.OVERLOADED

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


STORE_RETRY_AFTER_S = 2


class StoreDownError(ApiError):
    """The shared document store (Postgres) is unreachable: nothing of the failed call was written."""

    status_code = 503
    error_type = ErrorType.UNAVAILABLE

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(STORE_RETRY_AFTER_S)}


def store_down(exc: StoreUnavailableError) -> StoreDownError:
    return StoreDownError(f"{exc}; nothing was lost, retry the request")


class InsufficientStorageError(ApiError):
    """The disk is full: the message says which and how much more a write needs."""

    status_code = 507
    error_type = ErrorType.INSUFFICIENT_STORAGE


class IngestInterruptedError(ApiError):
    """An ingest failed part-way: the documents before the failure are committed, the rest are not."""

    status_code = 500
    error_type = ErrorType.SERVER

    def __init__(self, committed: list[str], failed_id: str, cause: Exception):
        if isinstance(cause, StoreUnavailableError):
            cause = store_down(cause)
        cause_text = cause.message if isinstance(cause, ApiError) else f"an internal error, error id {log_internal(cause)}"
        super().__init__(
            f"ingest stopped at document {failed_id} ({cause_text}); committed before it: "
            f"{', '.join(committed) if committed else 'none'}; re-sending the request is safe"
        )
        self.committed, self.failed_id = committed, failed_id
        if isinstance(cause, ApiError):  # the cause's own status (e.g. 4xx) stays
            self.status_code, self.error_type = cause.status_code, cause.error_type


def error_body(error_type: ErrorType | str, message: str) -> dict:
    return {"error": {"type": getattr(error_type, "value", error_type), "message": message}}


def stream_error_body(exc: Exception) -> dict:
    """The in-band error of a stream whose headers are out. An ApiError's message is meant for the
    client; anything else is internal: a generic message with an id, the details go to the log."""
    if isinstance(exc, StoreUnavailableError):
        exc = store_down(exc)
    if isinstance(exc, ApiError):
        return error_body(exc.error_type, exc.message)
    if isinstance(exc, QueueFull):
        return error_body(ErrorType.OVERLOADED, exc.message)
    if isinstance(exc, JobCancelled):
        return error_body(ErrorType.NOT_READY, f"cancelled: {exc}")
    error_id = log_internal(exc, "generation failed")
    return error_body(ErrorType.SERVER, f"generation failed: internal error (error id {error_id}; "
                                        "the server log has the details)")


def log_internal(exc: BaseException, what: str = "internal error") -> str:
    """Log `exc` with its traceback under a new error id, and return the id: a client's message names
    the id, never the internal exception's class or text."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s (error id %s)", what, error_id, exc_info=exc)
    return error_id


def error_response(status_code: int, error_type: ErrorType | str, message: str, headers=None) -> JSONResponse:
    return JSONResponse(error_body(error_type, message), status_code=status_code, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        message = err.get("msg", "invalid")
        pattern = (err.get("ctx") or {}).get("pattern")
        if err.get("type") == "string_pattern_mismatch" and pattern == COLLECTION_NAME_PATTERN:
            message = name_problem(str(err.get("input", "")))  # a path's, a query's or a form's: as everywhere
        parts.append(f"{where or 'body'}: {message}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status_code, exc.error_type, exc.message, exc.headers())

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        error = QueueFullError(exc.message, exc.retry_after_s)
        return error_response(error.status_code, error.error_type, error.message, error.headers())

    @app.exception_handler(JobCancelled)
    async def _cancelled(request: Request, exc: JobCancelled) -> JSONResponse:
        # the server is shutting down (a client that went away reads no answer)
        return error_response(503, ErrorType.NOT_READY, f"cancelled: {exc}")

    @app.exception_handler(StoreUnavailableError)
    async def _store_down(request: Request, exc: StoreUnavailableError) -> JSONResponse:
        error = store_down(exc)
        return error_response(error.status_code, error.error_type, error.message, error.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        is_bad_json = any(err.get("type") == "json_invalid" for err in exc.errors())
        status = 400 if is_bad_json else 422
        return error_response(status, ErrorType.INVALID_REQUEST, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST
        return error_response(exc.status_code, error_type, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        error_id = log_internal(exc, f"unhandled error on {request.method} {request.url.path}")
        # Starlette sends this answer from outside every middleware: the security headers come with it here
        return error_response(500, ErrorType.SERVER,
                              f"internal error (error id {error_id}; the server log has the details)",
                              headers=SECURITY_HEADERS)


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


# Documented on every router, so the OpenAPI schema (and schemathesis) knows the error shapes.
ERROR_RESPONSES: dict[int | str, dict] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 422, 503, 507)
}
