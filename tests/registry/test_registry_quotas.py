"""Tenants' storage quotas, on SQLite and PostgreSQL: set and checked like the other tenant
settings; an upload over a quota is refused with nothing kept (no stored copy, no staging
folder, no row), a long one as soon as it passes what is left; concurrent uploads cannot
both fit; a deleted version's bytes come back once its files are removed, by deletion or
by the sweep."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from owned_stores import owned_store
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import InvalidRequestError, QuotaExceededError
from loraplex.model.adapter_loader import TargetShapes, validate_adapter_dir
from loraplex.registry import quotas, service
from loraplex.registry.models import MAX_STORAGE_BYTES, Adapter, Tenant
from loraplex.registry.store import CONFIG_FILE, WEIGHTS_FILE, AdapterStore
from loraplex.registry.sweep import sweep_store
from loraplex.registry.upload import AdapterUploader, delete_adapter, stored_digests

MakeAdapter = Callable[..., Path]


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return owned_store(tmp_path / "store")


@pytest.fixture
def uploader(store: AdapterStore, model_dir: Path) -> AdapterUploader:
    target = TargetShapes.from_model_dir(model_dir)
    return AdapterUploader(store, lambda p: validate_adapter_dir(p, target, 8),
                           base_model=str(model_dir))


def _size(folder: Path) -> int:
    return sum((folder / n).stat().st_size for n in (CONFIG_FILE, WEIGHTS_FILE))


def _tenant(factory: sessionmaker[Session], **quota: Any) -> int:
    with factory.begin() as session:
        return service.create_tenant(session, "acme", **quota).id


def _usage(factory: sessionmaker[Session], tenant_id: int) -> quotas.StorageUsage:
    with factory() as session:
        return quotas.storage_usage(session, tenant_id)


def _rows(factory: sessionmaker[Session]) -> list[Adapter]:
    with factory() as session:
        return list(session.scalars(sa.select(Adapter).order_by(Adapter.id)))


def _tmp_empty(store: AdapterStore) -> bool:
    tmp = store.root / ".tmp"
    return not tmp.exists() or list(tmp.iterdir()) == []


# --- setting them ------------------------------------------------------------------------


def test_quotas_are_set_checked_and_cleared(session: Session) -> None:
    tenant = service.create_tenant(session, "acme", max_storage_bytes=5 << 30,
                                   max_adapter_versions=3)
    assert (tenant.max_storage_bytes, tenant.max_adapter_versions) == (5 << 30, 3)
    service.update_tenant_limits(session, tenant.id, max_storage_bytes=MAX_STORAGE_BYTES)
    assert tenant.max_storage_bytes == MAX_STORAGE_BYTES and tenant.max_adapter_versions == 3
    for field, bad in (("max_storage_bytes", 0), ("max_storage_bytes", -1),
                       ("max_storage_bytes", MAX_STORAGE_BYTES + 1),
                       ("max_storage_bytes", 1.5), ("max_storage_bytes", True),
                       ("max_storage_bytes", "1G"), ("max_adapter_versions", 0),
                       ("max_adapter_versions", 2**31), ("max_adapter_versions", float("nan"))):
        # A good value beside the bad one: nothing is applied.
        with pytest.raises(InvalidRequestError) as info:
            service.update_tenant_limits(session, tenant.id, weight=2.0, **{field: bad})
        assert info.value.param == field
        assert (tenant.weight, tenant.max_storage_bytes) == (1.0, MAX_STORAGE_BYTES)
    with pytest.raises(InvalidRequestError):
        service.create_tenant(session, "other", max_adapter_versions=0)
    service.update_tenant_limits(session, tenant.id, max_storage_bytes=None,
                                 max_adapter_versions=None)
    assert (tenant.max_storage_bytes, tenant.max_adapter_versions) == (None, None)


def test_the_database_holds_the_bounds(session: Session) -> None:
    tenant = service.create_tenant(session, "acme")
    session.commit()
    for column in ("max_storage_bytes", "max_adapter_versions"):
        with pytest.raises(sa.exc.IntegrityError):
            session.execute(sa.update(Tenant).where(Tenant.id == tenant.id)
                            .values({column: 0}))
        session.rollback()


# --- uploads -----------------------------------------------------------------------------


def test_an_upload_over_the_byte_quota_is_refused_with_nothing_kept(
        uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session]) -> None:
    first, second = make_adapter("a", seed=1), make_adapter("b", seed=2)
    quota = _size(first) + _size(second) - 1
    tenant_id = _tenant(session_factory, max_storage_bytes=quota)
    kept = uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=first)
    assert _usage(session_factory, tenant_id).num_bytes == _size(first)
    before = stored_digests(store)

    with pytest.raises(QuotaExceededError) as info:
        uploader.upload_path(session_factory, tenant_id=tenant_id, name="b", path=second)
    assert info.value.param == "max_storage_bytes" and info.value.quota == quota
    assert f"{quota - _size(first)} bytes left" in str(info.value)
    assert stored_digests(store) == before == [kept.adapter.digest]
    assert _tmp_empty(store)
    assert [r.name for r in _rows(session_factory)] == ["a"]
    usage = _usage(session_factory, tenant_id)
    assert (usage.num_bytes, usage.num_versions, usage.bytes_left) == (
        _size(first), 1, quota - _size(first))


def test_a_long_upload_is_cut_off_where_it_passes_the_quota(
        uploader: AdapterUploader, store: AdapterStore,
        session_factory: sessionmaker[Session]) -> None:
    tenant_id = _tenant(session_factory, max_storage_bytes=10_000)
    pulled = 0

    def endless() -> Iterator[bytes]:
        nonlocal pulled
        while True:
            pulled += 1
            yield b"\0" * 1000

    quota = uploader.check_quota(session_factory, tenant_id)
    with uploader.staging(quota=quota) as staging, \
            pytest.raises(QuotaExceededError) as info:
        staging.write(WEIGHTS_FILE, endless())
    assert info.value.param == "max_storage_bytes" and pulled == 11  # not one chunk more
    assert not staging.path.exists() and _tmp_empty(store)
    assert _rows(session_factory) == []


def test_a_full_tenant_is_refused_before_a_byte_is_read(
        uploader: AdapterUploader, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session]) -> None:
    src = make_adapter()
    tenant_id = _tenant(session_factory, max_storage_bytes=_size(src))
    uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=src)
    with pytest.raises(QuotaExceededError, match="0 bytes left"):
        uploader.check_quota(session_factory, tenant_id)


def test_the_version_quota(uploader: AdapterUploader, store: AdapterStore,
                           make_adapter: MakeAdapter,
                           session_factory: sessionmaker[Session]) -> None:
    tenant_id = _tenant(session_factory, max_adapter_versions=2)
    for seed in (1, 2):
        uploader.upload_path(session_factory, tenant_id=tenant_id, name="a",
                             path=make_adapter(f"s{seed}", seed=seed))
    before = stored_digests(store)
    with pytest.raises(QuotaExceededError) as info:
        uploader.upload_path(session_factory, tenant_id=tenant_id, name="b",
                             path=make_adapter("s3", seed=3))
    assert info.value.param == "max_adapter_versions" and info.value.quota == 2
    assert stored_digests(store) == before and _tmp_empty(store)
    assert len(_rows(session_factory)) == 2
    # Deleting a version frees it at once.
    delete_adapter(session_factory, store, tenant_id=tenant_id, name="a", version=1)
    uploader.upload_path(session_factory, tenant_id=tenant_id, name="b",
                         path=make_adapter("s3", seed=3))
    assert _usage(session_factory, tenant_id).num_versions == 2


def test_register_checks_under_the_lock(session_factory: sessionmaker[Session]) -> None:
    # The last line of defence, whatever path wrote the files: the row is refused.
    tenant_id = _tenant(session_factory, max_storage_bytes=100)
    with pytest.raises(QuotaExceededError), session_factory.begin() as session:
        service.register_adapter(
            session, tenant_id=tenant_id, name="a", digest="0" * 64, size_bytes=101,
            storage_path="00/" + "0" * 64, base_model="m", rank=1, alpha=1.0,
            use_rslora=False, target_modules=["q_proj"])
    assert _rows(session_factory) == []


def test_concurrent_uploads_cannot_both_fit(
        uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch) -> None:
    sources = [make_adapter(f"c{i}", seed=10 + i) for i in range(2)]
    tenant_id = _tenant(session_factory, max_storage_bytes=max(map(_size, sources)) + 10)
    # Both uploads pass the checks before the files are stored, then meet here: only the
    # check under the tenant's lock can tell them apart.
    barrier = threading.Barrier(2, timeout=10)
    put_dir = store.put_dir

    def meet_then_put(src: Any) -> Any:
        barrier.wait()
        return put_dir(src)

    monkeypatch.setattr(store, "put_dir", meet_then_put)
    outcomes: list[object] = []

    def run(i: int) -> None:
        try:
            outcomes.append(uploader.upload_path(session_factory, tenant_id=tenant_id,
                                                 name=f"c{i}", path=sources[i]))
        except QuotaExceededError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [o for o in outcomes if isinstance(o, QuotaExceededError)]
    assert len(outcomes) == 2 and len(refused) == 1, outcomes
    rows = _rows(session_factory)
    assert len(rows) == 1 and stored_digests(store) == [rows[0].digest]
    assert _tmp_empty(store)


# --- deleting gives the bytes back -------------------------------------------------------


def test_deleting_frees_the_quota(uploader: AdapterUploader, store: AdapterStore,
                                  make_adapter: MakeAdapter,
                                  session_factory: sessionmaker[Session]) -> None:
    first, second = make_adapter("a", seed=1), make_adapter("b", seed=2)
    tenant_id = _tenant(session_factory, max_storage_bytes=max(_size(first), _size(second)))
    uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=first)
    with pytest.raises(QuotaExceededError):
        uploader.upload_path(session_factory, tenant_id=tenant_id, name="b", path=second)
    delete_adapter(session_factory, store, tenant_id=tenant_id, name="a")
    assert stored_digests(store) == []
    assert _usage(session_factory, tenant_id).num_bytes == 0
    assert all(r.reclaimed_at is not None for r in _rows(session_factory))
    uploader.upload_path(session_factory, tenant_id=tenant_id, name="b", path=second)


def test_a_deleted_version_counts_until_the_sweep_removes_its_files(
        uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session]) -> None:
    src = make_adapter()
    tenant_id = _tenant(session_factory, max_storage_bytes=_size(src))
    uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=src)
    # The files stay (as when the engine is told first, or a removal failed).
    delete_adapter(session_factory, store, tenant_id=tenant_id, name="a", remove_files=False)
    usage = _usage(session_factory, tenant_id)
    assert (usage.num_bytes, usage.num_versions) == (_size(src), 0)
    with pytest.raises(QuotaExceededError):
        uploader.check_quota(session_factory, tenant_id)

    result = sweep_store(session_factory, store, grace_s=0)
    assert len(result.orphans_removed) == 1 and result.num_reclaimed == 1
    assert _usage(session_factory, tenant_id).num_bytes == 0
    uploader.upload_path(session_factory, tenant_id=tenant_id, name="a", path=src)
    assert _usage(session_factory, tenant_id).num_bytes == _size(src)


def test_a_deleted_version_whose_content_an_active_row_holds_is_reclaimed(
        uploader: AdapterUploader, store: AdapterStore, make_adapter: MakeAdapter,
        session_factory: sessionmaker[Session]) -> None:
    src = make_adapter()
    tenant_id = _tenant(session_factory)
    for name in ("a", "b"):  # identical content: stored once, charged per version
        uploader.upload_path(session_factory, tenant_id=tenant_id, name=name, path=src)
    assert _usage(session_factory, tenant_id).num_bytes == 2 * _size(src)
    delete_adapter(session_factory, store, tenant_id=tenant_id, name="a")
    assert len(stored_digests(store)) == 1  # "b" still needs the files
    assert _usage(session_factory, tenant_id).num_bytes == _size(src)
