"""Which tenant and adapter names are allowed, and which text the registry can hold.

Names appear in URLs and in the ``model`` field as ``owner/name`` (``@N`` after it names
version N), so neither may contain ``/``, ``@`` or ``:``; tenant names are lower case so
``Acme`` cannot pose as ``acme``.

Every string bound into a registry statement passes ``check_text`` (``db.make_engine``
installs it for every engine): PostgreSQL refuses a NUL character and no database stores a
lone surrogate, so such text is a 400 on every backend instead of a driver error on one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from loraplex.errors import AdapterNotFoundError, InvalidRequestError

TENANT_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
ADAPTER_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# A version number fits the database's integer column (and is never 0).
MAX_VERSION: Final = 2**31 - 1
# After '@': the version number, optionally written as usage reports it (``v3``), in ASCII
# digits. One past MAX_VERSION's length is never converted (a huge one is not found).
VERSION_SUFFIX_RE: Final = re.compile(r"v?([0-9]+)")
_SHOWN_CHARS: Final = 24


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}...")


@dataclass(frozen=True)
class ModelName:
    """A ``model`` field naming an adapter: ``[owner/]name[@version]``, not yet checked
    against the name rules (a name no adapter can have is simply not found)."""

    owner: str | None
    name: str
    version: int | None


def parse_model_name(model: str) -> ModelName:
    """Splits ``[owner/]name[@N]``. An ``@`` followed by anything but a version number
    from 1 to MAX_VERSION names no model: AdapterNotFoundError saying what a version looks
    like, decided on the text alone (so it reveals nothing about what exists)."""
    base, at, tail = model.partition("@")
    version = None
    if at:
        match = VERSION_SUFFIX_RE.fullmatch(tail)
        digits = match[1].lstrip("0") if match else ""
        if not digits or len(digits) > len(str(MAX_VERSION)) or int(digits) > MAX_VERSION:
            raise AdapterNotFoundError(
                f"the model {_shown(model)} does not exist: after '@' comes a version number "
                f"from 1 to {MAX_VERSION}, as in name@3")
        version = int(digits)
    owner, sep, name = base.rpartition("/")
    return ModelName(owner if sep else None, name, version)


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
