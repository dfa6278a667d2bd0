"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every refusal names what to fix: pydantic's validation errors become one 400 whose message lists
each bad field as `field: problem` and whose `param` is the first field (a body that is not JSON
at all is reported as such).  The same body, as an SSE `data:` event, ends a stream that fails
after its headers were sent.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _field(loc: tuple[Any, ...]) -> str:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_type_tag(part):
            out += f".{part}" if out else str(part)
    return out or "body"


def _is_type_tag(part: Any) -> bool:
    # pydantic puts the union member it tried into the location ("list[int]", "function-after[...]")
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return APIError(400, f"body: malformed JSON ({detail})".replace(" ()", ""), "body")
    seen: dict[str, str] = {}
    for e in errors:
        name = _field(tuple(e.get("loc", ())))
        seen.setdefault(name, "field required" if e.get("type") == "missing" else str(e.get("msg", "invalid")))
    message = "; ".join(f"{k}: {v}" for k, v in seen.items())
    return APIError(400, message, next(iter(seen), None))


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
