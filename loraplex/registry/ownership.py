"""One adapter store belongs to one registry: claiming a store, and opening it to write.

Every registry database has an id (``RegistryIdentity``, written by ``db upgrade``); the
store records its owner's id in ``<root>/.registry``. A server or command opens the store
through ``open_store``, which claims a store nobody owns yet and refuses, in one line that
says what to do, a store another registry owns. Only a store opened for its owner writes,
removes or sweeps (``AdapterStore.check_owned``), so two registries pointed at one folder
(a SQLite home and a PostgreSQL server sharing ``LORAPLEX_HOME``) never delete each
other's adapters as orphans.

A store written before owners were recorded is claimed by the first registry that names
every adapter folder in it, or by the embedded default's own registry (the SQLite file
beside it in one ``LORAPLEX_HOME``, whose leftovers such a store holds); one holding
folders another registry does not name (perhaps the home's) is refused unless claimed on
purpose (``loraplex db claim-store``).
"""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from loraplex.config import HOME_DATABASE
from loraplex.errors import ConfigError, StoreNotOwnedError
from loraplex.registry.db import transaction
from loraplex.registry.models import Adapter, RegistryIdentity
from loraplex.registry.store import AdapterStore, StoreOwner

__all__ = ["describe_database", "open_store", "registry_id"]


def registry_id(session: Session) -> str:
    """This registry's id (ConfigError on a database migrated before it had one)."""
    row = session.get(RegistryIdentity, 1)
    if row is None:
        raise ConfigError("the registry database has no identity yet: run `loraplex db upgrade`")
    return row.registry_id


def describe_database(url: str) -> str:
    """``url`` as shown to people and written in a store's owner record: no password."""
    return make_url(url).render_as_string(hide_password=True)


def open_store(factory: sessionmaker[Session], adapter_dir: str | os.PathLike[str],
               database_url: str, *, claim_any: bool = False) -> AdapterStore:
    """The store at ``adapter_dir`` opened for this registry, which owns it (claimed now if
    nobody did). StoreNotOwnedError where another registry owns it, or where an unclaimed
    store holds adapter folders this registry does not name (unless ``claim_any``)."""
    with transaction(factory) as session:
        this = registry_id(session)
        named = set(session.scalars(sa.select(Adapter.digest).distinct()))
    store = AdapterStore(adapter_dir, this)
    shown = describe_database(database_url)
    owner = store.owner()
    if owner is None:
        foreign = [d for d in store.stored_digests() if d not in named]
        if foreign and not (claim_any or _is_home_registry(database_url, store.root)):
            raise StoreNotOwnedError(
                f"the adapter store {store.root} has no owner yet and holds {len(foreign)} "
                f"adapter folder(s) that this registry ({shown}) does not name, perhaps "
                "another registry's: give this registry a store of its own with "
                "--adapter-dir DIR (or LORAPLEX_ADAPTER_DIR), or, if they are this "
                "registry's leftovers, claim the store with `loraplex db claim-store`")
        if store.write_owner(StoreOwner(this, shown), replacing=None):
            return store
        owner = store.owner()  # claimed by another process meanwhile
    if owner is None or owner.registry_id != this:
        theirs = owner.database if owner is not None and owner.database else "URL"
        raise StoreNotOwnedError(
            f"the adapter store {store.root} belongs to another registry ({theirs}), not to "
            f"this one ({shown}): give this registry a store of its own with --adapter-dir "
            "DIR (or LORAPLEX_ADAPTER_DIR), or move that registry here with `loraplex db "
            f"migrate --database-url {theirs} --to {shown}`")
    return store


def _is_home_registry(database_url: str, root: Path) -> bool:
    """Whether ``database_url`` is the SQLite file of the home that holds ``root`` (the
    embedded default: ``LORAPLEX_HOME/loraplex.db`` beside ``LORAPLEX_HOME/adapters``)."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return False
    return Path(url.database).expanduser().resolve() == root.parent / HOME_DATABASE
