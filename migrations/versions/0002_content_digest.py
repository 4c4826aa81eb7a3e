"""Adapter digests cover the weights and the config together; stored folders follow.

Before: ``adapters.digest`` was the sha256 of ``adapter_model.safetensors`` and the store
kept one folder per weights digest, so uploads with the same weights but another config
collided across tenants. After: the digest is the content digest of both files
(``loraplex.adapter_format``, restated below so this revision never changes meaning) and
each folder lives under it.

Upgrade, for every row whose folder is in the store: compute the new digest from the
folder's own two files, put them at ``<new[:2]>/<new>`` (hard links, or a copy across
filesystems, into a temporary folder renamed into place, as the store does), and point the
row there. Rows sharing a folder get the same new digest; rows whose folders share weights
but differ in config get separate ones. Old folders are left in place: no row names them
any more, so the store's sweep removes them after its grace period, and a failed migration
(rolled back) still finds them. A row whose folder is gone (a deleted version whose files
were removed) keeps its old digest: nothing can be computed, and nothing serves it.

Downgrade does the reverse, keyed on the weights alone; it refuses when two rows' folders
share weights but differ in config, which the old layout cannot hold.

Revision ID: 0002
Revises: 0001
Create Date: 2026-01-10
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import context, op

from loraplex.errors import ConfigError

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DOMAIN = b"loraplex-adapter-v1\x00"

adapters = sa.table("adapters", sa.column("id", sa.Integer), sa.column("digest", sa.String),
                    sa.column("storage_path", sa.String))


def _sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.digest()


def _content_digest(folder: Path) -> str:
    return hashlib.sha256(DOMAIN + _sha256(folder / WEIGHTS_FILE)
                          + _sha256(folder / CONFIG_FILE)).hexdigest()


def _weights_digest(folder: Path) -> str:
    return _sha256(folder / WEIGHTS_FILE).hex()


def _store_root(num_rows: int) -> Path | None:
    configured = (context.config.attributes.get("adapter_dir")
                  or context.get_x_argument(as_dictionary=True).get("adapter_dir")
                  or os.environ.get("LORAPLEX_ADAPTER_DIR"))
    if configured:
        return Path(configured).expanduser().resolve()
    if num_rows:
        raise ConfigError("migration 0002 moves stored adapter files: pass the adapter "
                           "store (--adapter-dir, -x adapter_dir=..., or "
                           "LORAPLEX_ADAPTER_DIR)")
    return None


def _place(root: Path, src: Path, digest: str) -> str:
    """Puts ``src``'s two files at ``digest``'s folder (if not there yet); its path."""
    relative = f"{digest[:2]}/{digest}"
    final = root / relative
    if (final / WEIGHTS_FILE).is_file() and (final / CONFIG_FILE).is_file():
        return relative
    tmp = root / ".tmp" / f"migrate-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            try:
                os.link(src / name, tmp / name)  # immutable files: a link costs no space
            except OSError:
                shutil.copy2(src / name, tmp / name)
                os.chmod(tmp / name, 0o444)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return relative


def _rewrite(*, to_content: bool) -> None:
    connection = op.get_bind()
    rows = connection.execute(sa.select(adapters.c.id, adapters.c.digest,
                                        adapters.c.storage_path)).all()
    root = _store_root(len(rows))
    if root is None:
        return
    placed: dict[str, Path] = {}  # new digest -> the folder its files came from
    for row_id, _old, storage_path in rows:
        folder = (root / storage_path).resolve()
        if not folder.is_relative_to(root) or not (folder / WEIGHTS_FILE).is_file() \
                or not (folder / CONFIG_FILE).is_file():
            continue
        new = _content_digest(folder) if to_content else _weights_digest(folder)
        first = placed.setdefault(new, folder)
        if not to_content and first != folder and \
                (first / CONFIG_FILE).read_bytes() != (folder / CONFIG_FILE).read_bytes():
            raise ConfigError(f"cannot downgrade: adapter rows share the weights {new[:12]} "
                               "but differ in adapter_config.json, which revision 0001's "
                               "store cannot hold")
        relative = _place(root, folder, new)
        connection.execute(adapters.update().where(adapters.c.id == row_id)
                           .values(digest=new, storage_path=relative))


def upgrade() -> None:
    _rewrite(to_content=True)


def downgrade() -> None:
    _rewrite(to_content=False)
