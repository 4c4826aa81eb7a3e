"""The salt secret a KV disk tier keeps beside its blocks (gateway/auth.kept_salt_secret):
made once, the same on every later start, private, never half-written, and refused in one
line when it cannot be kept. (The compose stack's end-to-end test restarts a server on its
kvcache volume and reads a tenant's blocks back through it.)"""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pytest

from loraplex.errors import ConfigError
from loraplex.gateway.auth import SALT_SECRET_FILE, cache_salt, kept_salt_secret


def test_a_folder_keeps_one_private_secret_across_starts(tmp_path: Path) -> None:
    folder = tmp_path / "kv-disk"  # made if missing
    first = kept_salt_secret(folder)
    assert len(first) >= 32
    assert kept_salt_secret(folder) == first  # the next start
    mode = stat.S_IMODE((folder / SALT_SECRET_FILE).stat().st_mode)
    assert mode == 0o600, oct(mode)
    assert kept_salt_secret(tmp_path / "other") != first
    # Same secret, same tenant salts; the other folder's differ.
    assert cache_salt(first.encode(), 7) == cache_salt(kept_salt_secret(folder).encode(), 7)
    assert [p.name for p in folder.iterdir()] == [SALT_SECRET_FILE]  # no temporary left


def test_servers_starting_at_once_agree_on_one_secret(tmp_path: Path) -> None:
    results: list[str] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        results.append(kept_salt_secret(tmp_path))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [SALT_SECRET_FILE]


@pytest.mark.parametrize("content", ["", "short", "\n\n"])
def test_a_file_without_a_secret_is_refused_in_one_line(tmp_path: Path, content: str) -> None:
    (tmp_path / SALT_SECRET_FILE).write_text(content)
    with pytest.raises(ConfigError, match="holds no salt secret") as info:
        kept_salt_secret(tmp_path)
    assert "\n" not in str(info.value)


def test_a_folder_that_cannot_be_made_is_refused_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="cannot keep the prefix-cache salt secret") as info:
        kept_salt_secret(blocker / "kv-disk")
    assert "\n" not in str(info.value)
