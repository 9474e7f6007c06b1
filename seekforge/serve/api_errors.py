"""Every error the server answers, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

A bad request is a 400 naming the offending field (`param`), an unknown model or adapter a 404, an
unknown URL OpenAI's "Invalid URL (POST /v1/x)", a bug a 500; the engine keeps running after each.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from seekforge.errors import InvalidSetting

log = logging.getLogger("seekforge.serve")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.code, self.param = message, status, kind, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON"
        if not where:  # the body as a whole: missing, or no JSON object (or sent without the JSON content type)
            return "the request body must be a JSON object, sent with 'Content-Type: application/json'"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unsupported parameter {where!r}; remove it")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def validation_param(exc: RequestValidationError) -> str | None:
    """The first offending field, as OpenAI's `param` names it (None for a body that is not JSON)."""
    errors = exc.errors()
    if not errors or errors[0].get("type") == "json_invalid":  # its loc is a position in the text, not a field
        return None
    return ".".join(str(x) for x in errors[0].get("loc", ()) if x != "body") or None


async def _api_error(_, exc: APIError):
    return exc.response()


async def _invalid(_, exc: RequestValidationError):
    return APIError(validation_message(exc), param=validation_param(exc)).response()


async def _http_error(request: Request, exc: StarletteHTTPException):
    # an unknown route or method: OpenAI's error shape ("Invalid URL (POST /v1/x)"), not FastAPI's
    message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) \
        else str(exc.detail)
    return APIError(message, exc.status_code).response()


async def _value_error(_, exc: ValueError):
    # the engine's and SamplingParams' checks raise ValueError with the fix; InvalidSetting names its field
    return APIError(str(exc), param=exc.name if isinstance(exc, InvalidSetting) else None).response()


async def _internal(_, exc: Exception):
    log.exception("unhandled error")
    return APIError(f"internal error: {exc}", 500, "internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    for kind, handler in ((APIError, _api_error), (RequestValidationError, _invalid),
                          (StarletteHTTPException, _http_error), (ValueError, _value_error), (Exception, _internal)):
        app.add_exception_handler(kind, handler)
