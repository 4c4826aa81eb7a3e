"""Which tenant and adapter names are allowed, and which text the registry can hold.

Names appear in URLs and in the ``model`` field as ``owner/name``, so neither may contain
``/``, ``@`` or ``:``; tenant names are lower case so ``Acme`` cannot pose as ``acme``.

Every string bound into a registry statement passes ``check_text`` (``db.make_engine``
installs it for every engine): PostgreSQL refuses a NUL character and no database stores a
lone surrogate, so such text is a 400 on every backend instead of a driver error on one.
"""

from __future__ import annotations

import re
from typing import Final

from loraplex.errors import InvalidRequestError

TENANT_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
ADAPTER_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def is_tenant_name(name: str) -> bool:
    """Whether ``name`` is a valid tenant name (one that may exist)."""
    return TENANT_NAME_RE.fullmatch(name) is not None


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a valid adapter name (one that may exist)."""
    return ADAPTER_NAME_RE.fullmatch(name) is not None


def check_tenant_name(name: str) -> str:
    """Returns ``name`` if it is a valid tenant name, else raises InvalidRequestError."""
    if not is_tenant_name(name):
        raise InvalidRequestError(
            f"invalid tenant name {name!r}: use 1-64 characters of a-z, 0-9, '_', '.', '-', "
            "starting with a letter or digit", param="name")
    return name


def check_adapter_name(name: str) -> str:
    """Returns ``name`` if it is a valid adapter name, else raises InvalidRequestError."""
    if not is_adapter_name(name):
        raise InvalidRequestError(
            f"invalid adapter name {name!r}: use 1-128 characters of A-Z, a-z, 0-9, '_', "
            "'.', '-', starting with a letter or digit", param="name")
    return name


def check_text(value: str, param: str | None = None) -> str:
    """Returns ``value`` if the registry can store and compare it: no NUL character and
    valid Unicode (no lone surrogate); InvalidRequestError otherwise."""
    if "\x00" in value:
        raise InvalidRequestError("text may not contain a NUL character (\\u0000)",
                                  param=param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("text contains a lone surrogate, which is not valid "
                                  "Unicode", param=param) from None
    return value
