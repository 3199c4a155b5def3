"""Every failure as an error body with its HTTP status: OpenAI's {"error": {message, type, param, code}}, or
Anthropic's {"type": "error", "error": {type, message}} on the Anthropic routes (/v1/messages...).

Client mistakes are 4xx and name their fix; a full queue is 503 with Retry-After; anything unexpected
is a 500 for that one request (logged with its traceback), and the server goes on serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import NotFound, UserError
from .anthropic_api import error_body
from .worker import JobCancelled, QueueFull

ANTHROPIC_ROUTES = "/v1/messages"
RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its answer


class ClientGone(Exception):
    """The client disconnected before its answer; its generation was cancelled."""


@dataclass
class ApiError:
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return error_body(self.status, self.message)

    def response(self, anthropic: bool = False) -> JSONResponse:
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def describe(err: Exception) -> ApiError:
    if isinstance(err, RequestValidationError):
        return _invalid_request(err)
    if isinstance(err, NotFound):
        return ApiError(404, str(err), code="not_found")
    if isinstance(err, UserError):
        return ApiError(400, str(err))
    if isinstance(err, HTTPException):
        return ApiError(err.status_code, str(err.detail), headers=dict(err.headers or {}))
    if isinstance(err, QueueFull):
        return ApiError(503, str(err), type="server_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(err, JobCancelled):
        return ApiError(503, "the generation was cancelled: the server is stopping", type="server_error",
                        code="cancelled")
    if isinstance(err, ClientGone):
        return ApiError(CLIENT_CLOSED_REQUEST, str(err), code="client_closed_request")
    return ApiError(500, f"internal server error ({type(err).__name__}); see the server log",
                    type="server_error", code="internal_error")


def _invalid_request(err: RequestValidationError) -> ApiError:
    first = err.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    param = ".".join(str(part) for part in first["loc"] if part != "body") or None
    message = f"{param or 'request body'}: {first['msg']}"
    return ApiError(400, message, param=param, code="invalid_value")


async def _handle(request: Request, err: Exception) -> JSONResponse:
    return describe(err).response(anthropic=request.url.path.startswith(ANTHROPIC_ROUTES))


def install_error_handlers(app: FastAPI) -> None:
    """A handler for Exception runs in Starlette's outermost middleware, which sends the 500 body and then
    re-raises for uvicorn to log the traceback."""
    for kind in (RequestValidationError, HTTPException, UserError, QueueFull, JobCancelled, ClientGone, Exception):
        app.add_exception_handler(kind, _handle)
