"""``loraplex serve`` as users run it: a subprocess on SQLite with the in-process limiter,
then the admin key bootstrap on its own."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path
from typing import IO

import httpx
import openai
import pytest
from servers import clean_env, free_port, serve_command, wait_ready
from sqlalchemy.orm import Session

from loraplex.cli_serve import admin_url
from loraplex.errors import ConfigError
from loraplex.gateway.auth import ensure_admin_key
from loraplex.registry import db, service

pytestmark = pytest.mark.server


def read_banner(stream: IO[str]) -> tuple[str, list[str]]:
    """What came before the framed banner on ``stream``, and the banner's lines."""
    before: list[str] = []
    while not (line := stream.readline()).startswith("+-"):
        assert line, "no banner before the end of the output"
        before.append(line)
    banner = [line.rstrip("\n")]
    while not (line := stream.readline()).startswith("+-"):
        assert line.startswith("| "), line
        banner.append(line.rstrip("\n"))
    return "".join(before), [*banner, line.rstrip("\n")]


def test_loraplex_serve_end_to_end(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = clean_env(tmp_path / "home")
    cmd = serve_command("--model", str(tiny_llama_dir),
                        "--port", str(port), "--num-kv-blocks", "64",
                        "--served-model-name", "tiny", "--max-upload-bytes", "1000",
                        "--log-level", "warning")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        assert proc.stderr is not None
        before, banner = read_banner(proc.stderr)
        assert "loading" in before  # the banner comes after the model's progress output
        assert len({len(line) for line in banner}) == 1  # a closed frame
        text = "\n".join(banner)
        assert f"http://127.0.0.1:{port}/admin/" in text
        assert "loraplex keys create --admin" in text  # how to get a new key if lost
        keys = [w for line in banner for w in line.split() if w.startswith("lpx-")]
        assert len(keys) == 1  # the bootstrap key, shown once
        admin_key = keys[0]
        assert len(admin_key) >= 47
        with openai.OpenAI(base_url=f"{url}/v1", api_key=admin_key, max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["tiny"]
            result = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
            assert result.usage is not None and result.usage.completion_tokens <= 3
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="nope", prompt="hello", max_tokens=3)
        # --max-upload-bytes reaches the upload pipeline: 2 KB is refused before reading.
        big = httpx.post(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {admin_key}"},
                         files={"adapter_model.safetensors": ("adapter_model.safetensors",
                                                              b"\0" * 2000)},
                         data={"name": "big"}, timeout=30)
        assert big.status_code == 413, big.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert admin_key not in out + err  # shown only in the banner
    # The database and the usage written at shutdown are in LORAPLEX_HOME's SQLite file.
    engine = db.make_engine(f"sqlite:///{tmp_path / 'home' / 'loraplex.db'}")
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            admin = service.get_tenant_by_name(session, "admin")
            assert service.usage_totals(session, admin.id).requests == 1
    finally:
        engine.dispose()


def kernel_lines(before_banner: str) -> list[str]:
    prefix = "loraplex kernels: "
    return [line[len(prefix):] for line in before_banner.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
def test_first_serve_shows_the_kernel_build_and_another_home_reuses_it(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A new user's first start compiles the native kernels with a line per stage (no
    silent minutes before the banner); a second LORAPLEX_HOME of the same user reuses that
    build instead of compiling again."""
    user_cache = tmp_path / "user-cache"  # what ~/.cache is for a new user
    said: list[list[str]] = []
    for home in ("first-home", "second-home"):
        env = clean_env(tmp_path / home) | {"XDG_CACHE_HOME": str(user_cache)}
        port = free_port()
        proc = subprocess.Popen(
            serve_command("--model", str(tiny_llama_dir), "--port", str(port),
                          "--num-kv-blocks", "32", "--log-level", "warning"),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            before, _banner = read_banner(proc.stderr)
            wait_ready(f"http://127.0.0.1:{port}", proc)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate()
        assert proc.returncode == 0
        said.append(kernel_lines(before))
    first, second = said
    cache = user_cache / "loraplex" / "kernels"
    assert first[0].startswith("compiling the native CPU kernels (") and str(cache) in first[0]
    assert len([line for line in first if line.startswith("compiled ")]) == len(first) - 2
    assert first[-1].startswith("linked in ") and "the kernels took" in first[-1]
    (library,) = cache.glob("cpu_kernels-*.so")
    assert second == [f"using the cached build {library}"]
    assert not (tmp_path / "second-home" / "kernels").exists()


def test_admin_key_is_created_once(session: Session) -> None:
    key = ensure_admin_key(session, None)
    assert key is not None and key.startswith("lpx-")
    assert ensure_admin_key(session, None) is None
    principal = service.authenticate(session, key)
    assert principal is not None and principal.is_admin


def test_admin_key_from_the_environment(session: Session) -> None:
    key = "lpx-" + "a" * 43
    assert ensure_admin_key(session, key) is None
    assert ensure_admin_key(session, key) is None  # idempotent
    principal = service.authenticate(session, key)
    assert principal is not None and principal.is_admin
    # With an admin key present, no other is created on a start without the variable.
    assert ensure_admin_key(session, None) is None
    service.revoke_key(session, principal.key_id)
    with pytest.raises(ConfigError, match="revoked"):
        ensure_admin_key(session, key)


@pytest.mark.parametrize("key", ["short", "lpx-short", "x" * 60])
def test_weak_admin_key_is_refused(session: Session, key: str) -> None:
    with pytest.raises(ConfigError, match="LORAPLEX_ADMIN_KEY"):
        ensure_admin_key(session, key)


def test_a_busy_port_fails_before_loading_anything(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(serve_command("--model", str(tiny_llama_dir), "--port", str(port)),
                              env=clean_env(tmp_path / "home"), capture_output=True, text=True,
                              timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr  # one line: no progress, no traceback
    assert done.stderr.startswith(f"loraplex: error: cannot listen on 127.0.0.1:{port}: ")
    assert "--port" in done.stderr
    assert not (tmp_path / "home").exists()  # neither the registry nor the model was touched


def test_bad_registry_options_fail_before_any_key_is_created(tiny_llama_dir: Path,
                                                              tmp_path: Path) -> None:
    # The admin key had been created (and never shown) before --max-upload-bytes was read.
    db_file = tmp_path / "registry.db"
    for option in (("--max-upload-bytes", "0"), ("--sweep-grace-s", "-1")):
        done = subprocess.run(serve_command("--model", str(tiny_llama_dir), "--port", "0",
                                            "--database-url", f"sqlite:///{db_file}", *option),
                              env=clean_env(tmp_path / "home"), capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("loraplex: error:")
        assert not db_file.exists()  # nothing migrated, no key made


@pytest.mark.parametrize(("option", "words"), [
    (("--database-url", "postgresql://nobody@127.0.0.1:1/none"), "database"),
    (("--database-url", "sqlite:////"), "database"),
    (("--port", "70000"), "must be in 0..65535"),
])
def test_serve_options_that_cannot_work_are_refused_without_a_traceback(
        tiny_llama_dir: Path, tmp_path: Path, option: tuple[str, str], words: str) -> None:
    done = subprocess.run(serve_command("--model", str(tiny_llama_dir), "--port", "0", *option),
                          env=clean_env(tmp_path / "home"), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_admin_url_is_one_a_browser_here_can_open() -> None:
    assert admin_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/admin/"
    assert admin_url("0.0.0.0", 80) == "http://127.0.0.1:80/admin/"
    assert admin_url("::", 8000) == "http://[::1]:8000/admin/"
    assert admin_url("example.org", 8000) == "http://example.org:8000/admin/"
