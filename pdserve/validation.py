"""Request checks the router and the workers share, so that both answer the same input with
the same status and message: the request id rule and the served-model check."""

from __future__ import annotations

import re
import uuid

from pdserve.errors import InvalidArgument, ModelNotFound

#: Longest request id accepted (characters; the protos document the same limit).
MAX_REQUEST_ID = 128
#: Printable ASCII without spaces: ids go into log lines, HTTP headers and engine ids as is.
_REQUEST_ID = re.compile(rf"^[\x21-\x7e]{{1,{MAX_REQUEST_ID}}}$")


def check_request_id(raw: str) -> str:
    """The request id to use: ``raw`` when valid, a fresh one when empty; INVALID_ARGUMENT
    (param ``request_id``) otherwise."""
    if not raw:
        return uuid.uuid4().hex
    if not _REQUEST_ID.match(raw):
        raise InvalidArgument(
            f"request_id must be 1-{MAX_REQUEST_ID} printable ASCII characters without spaces",
            param="request_id",
        )
    return raw


def check_model(requested: str, served: str) -> None:
    """NOT_FOUND (:class:`~pdserve.errors.ModelNotFound`, param ``model``) unless
    ``requested`` is empty (= the served model) or the served model's name."""
    if requested and requested != served:
        raise ModelNotFound(
            f"model: unknown model {requested!r}; this deployment serves {served!r}",
            param="model",
        )
