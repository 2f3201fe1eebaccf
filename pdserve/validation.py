"""Request checks the router and the workers share, so that both answer the same input with
the same status and message: the request id rule, the cache salt rule and the served-model
check."""

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


#: Longest cache salt accepted (characters) and the characters it may not hold: vLLM's rules
#: (``vllm.entrypoints.generate.base.protocol.validate_cache_salt``), so a salt pdserve takes
#: is one vLLM takes too.
MAX_CACHE_SALT = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(salt: object) -> str:
    """The request's cache salt: ``""`` (no salt) for None; the salt when it is a string of
    1-``MAX_CACHE_SALT`` characters without ``@``, ``/``, ``\\`` or NUL; INVALID_ARGUMENT
    (param ``cache_salt``) otherwise. The message never repeats the salt: it is a secret."""
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise InvalidArgument(
            "cache_salt must be a non-empty string when given", param="cache_salt"
        )
    if len(salt) > MAX_CACHE_SALT or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise InvalidArgument(
            f"cache_salt must be at most {MAX_CACHE_SALT} characters and must not contain "
            "'@', '/', '\\' or NUL",
            param="cache_salt",
        )
    return salt


#: A tenant's name (the router's tenants file; KVNamespace.tenant): 1-64 characters.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_tenant(raw: str) -> str:
    """The request's tenant ("" = none) when it is a tenant name; INVALID_ARGUMENT (param
    ``tenant``) otherwise."""
    if raw and TENANT_NAME.fullmatch(raw) is None:
        raise InvalidArgument(
            f"tenant {raw[:80]!r} must be 1-64 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit",
            param="tenant",
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
