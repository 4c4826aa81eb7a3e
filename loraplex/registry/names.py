"""Which tenant and adapter names are allowed.

Names appear in URLs and in the ``model`` field as ``owner/name``, so neither may contain
``/``, ``@`` or ``:``; tenant names are lower case so ``Acme`` cannot pose as ``acme``.
"""

from __future__ import annotations

import re
from typing import Final

from loraplex.errors import InvalidRequestError

TENANT_NAME_RE: Final = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
ADAPTER_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_tenant_name(name: str) -> str:
    """Returns ``name`` if it is a valid tenant name, else raises InvalidRequestError."""
    if not TENANT_NAME_RE.match(name):
        raise InvalidRequestError(
            f"invalid tenant name {name!r}: use 1-64 characters of a-z, 0-9, '_', '.', '-', "
            "starting with a letter or digit", param="name")
    return name


def check_adapter_name(name: str) -> str:
    """Returns ``name`` if it is a valid adapter name, else raises InvalidRequestError."""
    if not ADAPTER_NAME_RE.match(name):
        raise InvalidRequestError(
            f"invalid adapter name {name!r}: use 1-128 characters of A-Z, a-z, 0-9, '_', "
            "'.', '-', starting with a letter or digit", param="name")
    return name
