"""Domain exceptions. No HTTP here: the gateway maps these to status codes in one place."""

from __future__ import annotations

import re


def first_line(exc: BaseException) -> str:
    """An exception's message as one line for the CLI or a log: its first line, terminal
    colours stripped, or its type's name when it has no message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class LoraplexError(Exception):
    """Base of every error loraplex raises on purpose."""


class ConfigError(LoraplexError, ValueError):
    """A configuration value is out of range or inconsistent."""


class StoreNotOwnedError(ConfigError):
    """The adapter store belongs to another registry (or to none yet): this registry may
    read it but never write or delete there."""


class ModelLoadError(LoraplexError):
    """A base model folder cannot be loaded."""


class AdapterError(LoraplexError):
    """An adapter is refused: unsupported, malformed, or does not fit the base model."""


class AdapterNotFoundError(LoraplexError):
    """No adapter with that name is visible to the caller."""


class InvalidRequestError(LoraplexError, ValueError):
    """A request's parameters are invalid (named in the message)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context or the KV pool."""


class EngineOverloadedError(LoraplexError):
    """The engine's waiting queue is full; retry later."""


class EngineDeadError(LoraplexError):
    """The engine's step loop stopped after an unrecoverable error."""


class NotFoundError(LoraplexError, LookupError):
    """A tenant, API key or other registry record does not exist (or is not visible)."""


class TenantSuspendedError(LoraplexError):
    """A valid key whose tenant is suspended: the key is right, the tenant may not call."""


class ConflictError(LoraplexError):
    """The change clashes with existing state: a duplicate name, or a concurrent writer."""


class UploadTooLargeError(AdapterError):
    """An upload's body went past the server's byte cap (the gateway answers 413)."""

    def __init__(self, message: str, max_bytes: int) -> None:
        super().__init__(message)
        self.max_bytes = max_bytes


class QuotaExceededError(LoraplexError):
    """An upload would take a tenant past its storage quota: ``param`` names the quota
    (``max_storage_bytes`` or ``max_adapter_versions``); nothing of the upload is kept."""

    def __init__(self, message: str, param: str, quota: int) -> None:
        super().__init__(message)
        self.param = param
        self.quota = quota
