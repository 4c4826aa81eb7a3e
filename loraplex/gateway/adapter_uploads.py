"""Adapters over HTTP: multipart uploads streamed into the upload pipeline, and deletes
that reach the engine.

An upload is a ``multipart/form-data`` body with the fields ``name`` and ``visibility``
and the adapter as files: ``adapter_config.json`` + ``adapter_model.safetensors`` (sent
under those field names, or under any field name with those file names), or one ``.zip``
or ``.tar.gz`` (field ``archive``). The body is never buffered: python-multipart's push
parser is fed from ``request.stream()`` and each file part goes straight into the
pipeline's staging folder under its byte cap. A declared ``Content-Length`` over the cap is
refused (413) before a byte is read.

Shared by the admin routes (any tenant's adapters) and the tenant routes (one's own): a
service, not a route module.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import ClientDisconnect, HTTPConnection, Request

from loraplex.engine.backend import EngineBackend
from loraplex.errors import (
    AdapterError,
    EngineDeadError,
    InvalidRequestError,
    UploadTooLargeError,
)
from loraplex.gateway.adapter_effect import EffectProbes, ProbeOutcome, effect_json
from loraplex.gateway.errors import AdapterRejectedError, ClientDisconnected
from loraplex.gateway.http import declared_length
from loraplex.registry import service, upload
from loraplex.registry.archive import ALLOWED_FILES
from loraplex.registry.models import Adapter
from loraplex.registry.quotas import StorageUsage
from loraplex.registry.store import AdapterStore
from loraplex.registry.upload import AdapterUploader, DeletedAdapter, UploadResult
from loraplex.registry.versions import Traffic

logger = logging.getLogger("loraplex.gateway")

# Multipart framing (boundaries, part headers, the small fields) on top of the files.
BODY_SLACK_BYTES: Final = 64 * 1024
MAX_PARTS: Final = 16
MAX_FIELD_BYTES: Final = 1024
FIELDS: Final = ("name", "visibility")


def adapter_json(row: Adapter, owner: str,
                 traffic: Mapping[tuple[int, str], Traffic] | None = None) -> dict[str, Any]:
    """An adapter version as the API shows it (never its path on the server); with its
    name's ``traffic``: whether it is the current version and its share of the requests."""
    pinned_at = row.pinned_at if row.status == "active" else None
    out = {
        "object": "adapter", "id": row.id, "tenant": owner, "name": row.name,
        "model": f"{owner}/{row.name}", "version": row.version, "identity": row.identity,
        "digest": row.digest, "size_bytes": row.size_bytes, "rank": row.rank,
        "alpha": row.alpha, "use_rslora": row.use_rslora,
        "target_modules": list(row.target_modules), "visibility": row.visibility,
        "status": row.status, "created_at": row.created_at.isoformat(),
        # A deleted version's pin no longer applies (registry/pins.py).
        "pinned": pinned_at is not None,
        "pinned_at": None if pinned_at is None else pinned_at.isoformat(),
        # null until measured (gateway/adapter_effect.py)
        "effect": effect_json(row),
    }
    if traffic is not None:
        shares = traffic.get((row.tenant_id, row.name))
        active = shares is not None and row.status == "active"
        out["current"] = active and shares is not None and shares.current_id == row.id
        out["traffic_percent"] = shares.percent_of(row.id) if active and shares else 0.0
    return out


def upload_json(result: UploadResult, outcome: ProbeOutcome, owner: str) -> dict[str, Any]:
    """The answer to an upload: the version, with its measured effect when the probe
    ended in time (``effect_pending``: it still runs, and the effect is stored when it
    ends), and ``warnings`` (an effect indistinguishable from zero)."""
    out = adapter_json(result.adapter, owner)
    if outcome.effect is not None:
        out["effect"] = outcome.json()
    out["effect_pending"] = outcome.pending
    out["warnings"] = outcome.warnings()
    return out


def versions_json(session: Session, rows: Sequence[Adapter],
                  owner: Callable[[Adapter], str]) -> list[dict[str, Any]]:
    """Adapter versions as the API lists them, each with its name's traffic."""
    traffic = service.traffic(session, {(row.tenant_id, row.name) for row in rows})
    return [adapter_json(row, owner(row), traffic) for row in rows]


def storage_json(usage: StorageUsage) -> dict[str, Any]:
    """A tenant's storage against its quotas (``None``: unlimited): bytes of its active
    versions and of deleted ones not yet reclaimed, and its active versions."""
    return {"storage_bytes": usage.num_bytes, "max_storage_bytes": usage.max_storage_bytes,
            "num_adapter_versions": usage.num_versions,
            "max_adapter_versions": usage.max_adapter_versions}


def deleted_json(rows: list[DeletedAdapter], owner: str) -> dict[str, Any]:
    return {"object": "adapter.deleted", "deleted": True,
            "versions": [{"id": d.id, "tenant": owner, "name": d.name, "version": d.version,
                          "identity": d.identity} for d in rows]}


# --- multipart ---------------------------------------------------------------------------


@dataclass
class _Part:
    field: str
    filename: str | None
    reader: MultipartReader

    async def chunks(self) -> AsyncIterator[bytes]:
        """The part's data, chunk by chunk as it arrives."""
        async for chunk in self.reader.part_data():
            yield chunk

    async def text(self) -> str:
        data = bytearray()
        async for chunk in self.reader.part_data():
            data += chunk
            if len(data) > MAX_FIELD_BYTES:
                raise InvalidRequestError(f"form field {self.field!r} is longer than "
                                          f"{MAX_FIELD_BYTES} bytes", param=self.field)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"form field {self.field!r} is not UTF-8",
                                      param=self.field) from None


class MultipartReader:
    """Parts of a ``multipart/form-data`` body, read from the request stream on demand."""

    def __init__(self, request: Request, max_body_bytes: int) -> None:
        content_type, options = parse_options_header(request.headers.get("content-type"))
        boundary = options.get(b"boundary")
        if content_type != b"multipart/form-data" or not boundary:
            raise InvalidRequestError("send the adapter as multipart/form-data (fields name "
                                      "and visibility, and the adapter's files)")
        self._stream = request.stream().__aiter__()
        self._max_body_bytes = max_body_bytes
        self._num_bytes = 0
        self._events: deque[tuple[str, Any]] = deque()
        self._finished = False
        self._in_part = False
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        try:
            self._parser = MultipartParser(boundary, callbacks={
                "on_part_begin": self._on_part_begin,
                "on_part_data": self._on_part_data,
                "on_part_end": lambda: self._events.append(("end", None)),
                "on_header_field": lambda d, s, e: self._header_field.extend(d[s:e]),
                "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
                "on_header_end": self._on_header_end,
                "on_headers_finished": lambda: self._events.append(("headers",
                                                                    dict(self._headers))),
                "on_end": lambda: self._events.append(("finish", None)),
            })
        except FormParserError as exc:  # e.g. a boundary over 256 bytes
            raise InvalidRequestError(f"malformed multipart body: {exc}") from None

    def _on_part_begin(self) -> None:
        self._headers = {}

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        self._events.append(("data", bytes(data[start:end])))

    def _on_header_end(self) -> None:
        self._headers[bytes(self._header_field).lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    async def _next(self) -> tuple[str, Any]:
        while not self._events:
            if self._finished:
                return ("eof", None)
            try:
                chunk = await self._stream.__anext__()
            except StopAsyncIteration:
                self._finished = True
                continue
            except ClientDisconnect:
                raise ClientDisconnected("the client closed the connection while "
                                         "uploading") from None
            self._num_bytes += len(chunk)
            if self._num_bytes > self._max_body_bytes:
                raise UploadTooLargeError(f"upload too large: the body is over "
                                          f"{self._max_body_bytes} bytes",
                                          self._max_body_bytes)
            try:
                self._parser.write(chunk)
            except FormParserError as exc:
                raise InvalidRequestError(f"malformed multipart body: {exc}") from None
        return self._events.popleft()

    async def part_data(self) -> AsyncIterator[bytes]:
        while self._in_part:
            kind, value = await self._next()
            if kind == "data":
                if value:
                    yield value
            elif kind == "end":
                self._in_part = False
            else:
                raise InvalidRequestError("malformed multipart body: a part has no end")

    async def parts(self) -> AsyncIterator[_Part]:
        """Each part in order; what a consumer leaves unread of a part is skipped."""
        count = 0
        while True:
            kind, value = await self._next()
            if kind == "finish":
                return
            if kind == "eof":
                raise InvalidRequestError("malformed multipart body: it ended before its "
                                          "closing boundary")
            if kind != "headers":
                continue
            count += 1
            if count > MAX_PARTS:
                raise InvalidRequestError(f"too many form parts (at most {MAX_PARTS})")
            disposition, options = parse_options_header(value.get(b"content-disposition"))
            if disposition != b"form-data" or b"name" not in options:
                raise InvalidRequestError("malformed multipart body: a part has no "
                                          "Content-Disposition: form-data name")
            raw_filename = options.get(b"filename")
            field = options[b"name"].decode("utf-8", "replace")
            filename = raw_filename.decode("utf-8", "replace") if raw_filename is not None \
                else None
            self._in_part = True
            yield _Part(field, filename, self)
            async for _ in self.part_data():  # whatever the consumer did not read
                pass


# --- the service -------------------------------------------------------------------------


@dataclass(frozen=True)
class UploadForm:
    """The fields of one upload."""

    name: str
    visibility: str


def _staged_name(part: _Part) -> str:
    # A file sent under its own name's field ("adapter_config.json") keeps that name
    # whatever the client called the file; other fields ("archive", "file") keep the file's.
    if part.field in ALLOWED_FILES:
        return part.field
    assert part.filename is not None
    return part.filename


class AdapterService:
    """Uploads and deletes adapters for the HTTP routes; built once by ``create_app``."""

    def __init__(self, uploader: AdapterUploader, sessions: sessionmaker[Session],
                 store: AdapterStore, backend: EngineBackend, probes: EffectProbes) -> None:
        self.uploader = uploader
        self.sessions = sessions
        self.store = store
        self.backend = backend
        self.probes = probes

    @property
    def max_upload_bytes(self) -> int:
        return self.uploader.limits.max_upload_bytes

    async def upload(self, request: Request, tenant_id: int) -> UploadResult:
        """Receives a multipart upload into a staging folder and commits it for the tenant.

        Raises InvalidRequestError (400), UploadTooLargeError (413), AdapterRejectedError
        (422, the reason in the message), ConflictError (409), QuotaExceededError (413 for
        bytes, 409 for versions; before a byte is read when the tenant is already full,
        else as soon as the received files pass what is left, and before any is kept).
        """
        max_body = self.max_upload_bytes + BODY_SLACK_BYTES
        size = declared_length(request)
        if size is not None and size > max_body:
            raise UploadTooLargeError(
                f"upload too large: {size} bytes, over the limit of "
                f"{self.max_upload_bytes} bytes", self.max_upload_bytes)
        quota = await asyncio.to_thread(self.uploader.check_quota, self.sessions, tenant_id)
        reader = MultipartReader(request, max_body)
        fields: dict[str, str] = {}
        try:
            with self.uploader.staging(quota=quota) as staging:
                async for part in reader.parts():
                    if part.filename is None:
                        if part.field in FIELDS:
                            fields[part.field] = (await part.text()).strip()
                            # As soon as it arrives: a bad name must not cost the upload.
                            if part.field == "name" or fields[part.field]:
                                self.uploader.check_field(part.field, fields[part.field])
                        continue  # unknown fields are ignored
                    if part.field in fields or part.field in FIELDS:
                        raise InvalidRequestError(f"{part.field!r} must be a text field",
                                                  param=part.field)
                    if not part.filename and part.field not in ALLOWED_FILES:
                        raise AdapterError(f"a file was sent without a file name (field "
                                           f"{part.field!r})")
                    await staging.write_async(_staged_name(part), part.chunks())
                form = _form(fields)
                return await asyncio.to_thread(
                    self.uploader.commit, self.sessions, staging, tenant_id=tenant_id,
                    name=form.name, visibility=form.visibility)
        except UploadTooLargeError:
            raise
        except AdapterError as exc:
            raise AdapterRejectedError(str(exc)) from exc

    async def probe(self, result: UploadResult) -> ProbeOutcome:
        """Measures the effect of the version an upload committed (see adapter_effect),
        waiting a bounded time; a version that was not new was measured when it was."""
        if not result.new_version:
            return ProbeOutcome(None, pending=False)
        return await self.probes.probe(result.adapter)

    async def delete(self, tenant_id: int, name: str,
                     version: int | None = None) -> list[DeletedAdapter]:
        """Deletes the tenant's adapter (all versions, or one) and tells the engine.

        Once the row is committed no new request resolves the adapter; the engine then
        drops its cached blocks, host copy and idle slot, while the requests it already
        holds on it finish on weights it keeps for them (``LLMEngine.forget_adapter``).
        Files go last, once the engine has its copy.
        """
        deleted = await asyncio.to_thread(
            upload.delete_adapter, self.sessions, self.store, tenant_id=tenant_id,
            name=name, version=version, remove_files=False)

        try:
            for d in deleted:
                # The same identity the gateway submits requests with (targets.py).
                await self.backend.forget_adapter(str(d.id), d.digest)
        except EngineDeadError:
            logger.warning("adapter %s deleted while the engine is not running", name)
        finally:
            digests = sorted({d.digest for d in deleted})
            for digest in digests:
                await asyncio.to_thread(upload.discard_unreferenced, self.sessions,
                                        self.store, digest)
            # The tenant's quota gets the bytes back now, not at the next sweep.
            await asyncio.to_thread(upload.reclaim_deleted, self.sessions, self.store,
                                    digests)
        return deleted


def _form(fields: dict[str, str]) -> UploadForm:
    if "name" not in fields:
        raise InvalidRequestError("the form field 'name' (the adapter's name) is required",
                                  param="name")
    return UploadForm(fields["name"], fields.get("visibility") or "private")


def adapter_service(conn: HTTPConnection) -> AdapterService:
    """The adapter service of the app serving ``conn``."""
    service: AdapterService = conn.app.state.adapters
    return service
