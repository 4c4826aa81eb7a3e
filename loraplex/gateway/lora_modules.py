"""vLLM's ways of naming adapters by path: ``loraplex serve --lora-modules`` at the start,
and ``/v1/load_lora_adapter`` at run time (only inside the server's allowed folders).

Both register the adapter in the registry like an upload (validated, copied into the
content-addressed store), for the ``default`` tenant at the start and for the caller's
tenant at run time, and both are idempotent by digest: the same files under the same name
register nothing new; other files make a new version, which becomes the current one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import ConfigError, LoraplexError, NotFoundError
from loraplex.gateway.errors import PermissionDeniedError
from loraplex.registry import service
from loraplex.registry.archive import README_FILE
from loraplex.registry.db import transaction
from loraplex.registry.store import CONFIG_FILE, WEIGHTS_FILE
from loraplex.registry.upload import AdapterUploader, UploadResult

# Longer paths are refused before the filesystem sees them (Linux's PATH_MAX).
MAX_PATH_CHARS: Final = 4096
_MODULE_KEYS: Final = ("name", "path", "base_model_name")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: the adapter's name and its local folder."""

    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON ``{"name": .., "path": .., "base_model_name": ..}``
    (``base_model_name`` is accepted and not used: the adapter's shapes are checked against
    the served model instead). ValueError saying what is wrong otherwise."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            raise ValueError(f"not valid JSON: {text!r}") from None
        unknown = sorted(set(data) - set(_MODULE_KEYS))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; expected name, path "
                             "(and base_model_name)")
        name, path = data.get("name"), data.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(f'expected {{"name": "...", "path": "..."}}, got {text!r}')
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"expected name=path or a JSON object, got {text!r}")
    if not name or not path:
        raise ValueError(f"both the name and the path are needed, got {text!r}")
    return LoRAModule(name.strip(), path.strip())


def check_lora_modules(modules: list[LoRAModule]) -> None:
    """ConfigError, before anything loads, for a name given twice or a path that is not
    a folder."""
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ConfigError(f"--lora-modules names {module.name!r} twice")
        seen.add(module.name)
        if not Path(module.path).is_dir():
            raise ConfigError(f"--lora-modules {module.name}: {module.path} is not a folder")


def register_lora_modules(uploader: AdapterUploader, sessions: sessionmaker[Session],
                          modules: list[LoRAModule]) -> list[str]:
    """Registers each module for the ``default`` tenant (created if missing) unless its
    current version has the same files; returns one line per module saying what was done.
    ConfigError naming the module for one that cannot be registered."""
    with transaction(sessions) as session:
        tenant_id = service.default_tenant(session).id
    lines = []
    for module in modules:
        try:
            result = uploader.upload_path(sessions, tenant_id=tenant_id, name=module.name,
                                          path=module.path, unless_current=True)
        except LoraplexError as exc:
            raise ConfigError(f"--lora-modules {module.name}={module.path}: {exc}") from None
        row = result.adapter
        what = "registered" if result.new_version else "already registered"
        lines.append(f"adapter {module.name}: {what} as version {row.version} of tenant "
                     f"{service.DEFAULT_TENANT!r} ({row.digest[:12]})")
    return lines


def resolve_allowed_path(raw: str, allowed_dirs: tuple[str, ...]) -> Path:
    """The folder ``raw`` names, resolved (symlinks followed), when it lies inside one of
    ``allowed_dirs`` together with the adapter files in it; PermissionDeniedError (403)
    otherwise, with the same message whether or not the path exists, so nothing outside
    is revealed. NotFoundError (404) when it is allowed but names no folder."""
    if not allowed_dirs:
        raise PermissionDeniedError("loading adapters by path is off on this server (the "
                                    "operator turns it on with --allowed-lora-dir); upload "
                                    "the files to /v1/adapters instead")
    refused = PermissionDeniedError("lora_path is not inside the server's allowed adapter "
                                    "folders")
    if len(raw) > MAX_PATH_CHARS or "\0" in raw:
        raise refused
    roots = [os.path.realpath(d) for d in allowed_dirs]
    # A relative path is read against the first allowed folder, never the working directory.
    target = os.path.realpath(os.path.join(roots[0], raw))

    def inside(path: str) -> bool:
        return any(os.path.commonpath([root, path]) == root for root in roots)

    if not inside(target):
        raise refused
    folder = Path(target)
    if not os.path.isdir(folder):  # False for any OSError too (a name over NAME_MAX)
        raise NotFoundError("lora_path names no folder inside the allowed adapter folders")
    # The files are read through their links too: one pointing outside is refused.
    for base in (CONFIG_FILE, WEIGHTS_FILE, README_FILE):
        if os.path.lexists(folder / base) and not inside(os.path.realpath(folder / base)):
            raise refused
    return folder


def load_for_tenant(uploader: AdapterUploader, sessions: sessionmaker[Session], tenant_id: int,
                    name: str, folder: Path) -> UploadResult:
    """Registers the adapter in ``folder`` as ``name`` for the tenant, unless its current
    version has the same files (blocking: call it from a worker thread)."""
    return uploader.upload_path(sessions, tenant_id=tenant_id, name=name, path=folder,
                                unless_current=True)
