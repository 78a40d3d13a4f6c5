"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with an HTTP status,
and pydantic's validation errors turned into a 400 that names the offending parameter."""

from __future__ import annotations

from pydantic import ValidationError


class APIError(Exception):
    """An OpenAI-style error: HTTP status + {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the parameter (messages[0].content)."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {err['msg']}", code="invalid_json")
    param = ""
    for part in err["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
        else:
            break  # a union member tag such as 'list[str]': the parameter is named already
    if err["type"] == "missing":
        message = f"missing required parameter '{param}'"
    elif not param:
        message = f"the request body must be a JSON object: {err['msg']}"
    else:
        message = f"invalid value for '{param}': {err['msg']}"
    return APIError(400, message, param=param or None, code=err["type"])


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
