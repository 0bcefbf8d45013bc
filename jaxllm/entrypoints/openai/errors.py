"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @classmethod
    def from_value_error(cls, error: ValueError) -> APIError:
        """jaxllm's ValueErrors start with the field name: "field: problem"."""
        message = str(error)
        param = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
        return cls(400, message, param=param)

    @classmethod
    def from_validation_error(cls, error: ValidationError) -> APIError:
        first = error.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            return cls(400, f"Unrecognized request argument supplied: {param}", param=param)
        return cls(400, f"{param}: {first['msg']}", param=param)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)

    def as_json(self) -> str:
        return json.dumps(error_body(self.status, self.message, self.param, self.code))


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param,
                      "code": code if code is not None else str(status)}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
