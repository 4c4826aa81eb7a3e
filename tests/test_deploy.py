"""The container deployment: compose.yaml, Dockerfile, .env.example, docker/entrypoint.sh.

No Docker engine runs in the test environment, so the files are checked statically against
what the code reads (a renamed environment variable or a moved cache folder breaks a test
here), and the image's entry command runs for real on this machine, against the local
PostgreSQL and Redis, with the environment compose.yaml gives the container.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from servers import wait_ready

from loraplex.testing import postgres_url_for_tests, redis_url_for_tests

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ENV_EXAMPLE = ROOT / ".env.example"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
RAY_NODE = ROOT / "docker" / "ray-node.sh"
RAY_SERVICES = {"ray-head", "ray-worker", "gateway", "gateway-2"}

POSTGRES_URL = postgres_url_for_tests()
REDIS_URL = redis_url_for_tests()
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}")


# --- helpers ------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _service(name: str) -> dict[str, Any]:
    service = _compose()["services"][name]
    assert isinstance(service, dict)
    return service


def _env_example() -> dict[str, str]:
    """The settings .env.example sets (commented-out lines excluded)."""
    values: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f".env.example: not NAME=VALUE: {line!r}"
            values[name.strip()] = value.strip()
    return values


def _interpolate(text: str, values: dict[str, str]) -> str:
    """Compose's variable substitution, for the forms compose.yaml uses."""

    def sub(m: re.Match[str]) -> str:
        name, kind, arg = m.group(1), m.group(2), m.group(3)
        if values.get(name):
            return values[name]
        if kind == "-":
            return arg
        raise AssertionError(f"compose.yaml needs {name}, which .env.example does not set")

    return INTERPOLATION.sub(sub, text)


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the "- NAME=value" form
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _env_files(service: dict[str, Any]) -> list[str]:
    files = service.get("env_file", [])
    files = [files] if isinstance(files, str | dict) else files
    return [f["path"] if isinstance(f, dict) else f for f in files]


def _named_mounts(service: dict[str, Any]) -> dict[str, str]:
    """volume name -> mount path, for the short "name:/path" form and the long form."""
    mounts: dict[str, str] = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, _, target = volume.partition(":")
            target = target.split(":")[0]
        else:
            source, target = volume.get("source", ""), volume["target"]
        if source and not source.startswith((".", "/", "~")):
            mounts[source] = target
    return mounts


def _healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return ["sh", "-c", test]
    kind, *argv = test
    assert kind in ("CMD", "CMD-SHELL"), test
    return argv if kind == "CMD" else ["sh", "-c", " ".join(argv)]


def _cli_source() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "loraplex").rglob("*.py")))


def _read_by_cli(name: str, source: str) -> bool:
    return f'"{name}"' in source or f"'{name}'" in source


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _args(instructions: list[tuple[str, str]]) -> dict[str, str | None]:
    args: dict[str, str | None] = {}
    for word, rest in instructions:
        if word == "ARG":
            name, sep, default = rest.partition("=")
            args[name] = default if sep else None
    return args


def _last_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from + 1:]


def _torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"torch\s*==", d)]
    return pin.split("==", 1)[1].strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- compose.yaml -------------------------------------------------------------------------


def _default_services() -> dict[str, Any]:
    """The services of a plain `docker compose up`: those without a profile."""
    return {name: s for name, s in _compose()["services"].items() if not s.get("profiles")}


def test_compose_has_the_three_services_from_pinned_images() -> None:
    services = _default_services()
    assert set(services) == {"postgres", "redis", "loraplex"}
    # Everything else is the `ray` profile's.
    others = {name: s for name, s in _compose()["services"].items() if name not in services}
    assert set(others) == RAY_SERVICES
    assert all(s["profiles"] == ["ray"] for s in others.values())
    assert services["postgres"]["image"].split(":")[1].startswith("16")
    assert services["redis"]["image"].split(":")[1].startswith("7")
    build = services["loraplex"]["build"]
    assert build["context"] == "."
    assert (ROOT / build.get("dockerfile", "Dockerfile")).is_file()


def test_compose_publishes_only_the_api_port() -> None:
    services = _compose()["services"]
    ports = [str(p) for p in services["loraplex"]["ports"]]
    assert ports == ["${PUBLISH_ADDRESS:-127.0.0.1}:8000:8000"]
    # By default on the host's loopback only (local testing); .env opens it on purpose.
    assert [_interpolate(p, _env_example()) for p in ports] == ["127.0.0.1:8000:8000"]
    assert "PUBLISH_ADDRESS" not in _env_example()  # documented, commented out
    assert "# PUBLISH_ADDRESS=" in ENV_EXAMPLE.read_text()
    # The database and Redis are reached over the compose network only.
    assert "ports" not in services["postgres"]
    assert "ports" not in services["redis"]


def test_compose_health_checks() -> None:
    for name in ("postgres", "redis", "loraplex"):
        check = _service(name)["healthcheck"]
        assert check.get("disable") is not True
        assert _healthcheck_argv(_service(name)), name
        assert "interval" in check and "retries" in check, name
    assert "pg_isready" in " ".join(_healthcheck_argv(_service("postgres")))
    assert _healthcheck_argv(_service("redis")) == ["redis-cli", "ping"]
    loraplex = " ".join(_healthcheck_argv(_service("loraplex")))
    assert "http://127.0.0.1:8000/ready" in loraplex
    # The first start may download and convert the demo model before /ready answers.
    assert _service("loraplex")["healthcheck"]["start_period"]


def test_compose_loraplex_waits_for_healthy_database_and_redis() -> None:
    depends = _service("loraplex")["depends_on"]
    assert depends == {"postgres": {"condition": "service_healthy"},
                       "redis": {"condition": "service_healthy"}}


def test_compose_named_volumes_are_declared_and_mounted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    declared = _compose()["volumes"]
    assert set(declared) == {"pgdata", "adapters", "models", "kvcache"}
    assert _named_mounts(_service("postgres")) == {"pgdata": "/var/lib/postgresql/data"}
    env = _environment(_service("loraplex"))
    mounts = _named_mounts(_service("loraplex"))
    assert set(mounts) == {"adapters", "models", "kvcache"}
    assert mounts["adapters"] == env["LORAPLEX_ADAPTER_DIR"]
    assert mounts["kvcache"] == env["LORAPLEX_KV_DISK_DIR"]  # the KV disk tier's folder
    # The models volume must hold the folder the demo model is prepared into.
    from loraplex.model.demo import default_demo_dir

    monkeypatch.setenv("LORAPLEX_HOME", env["LORAPLEX_HOME"])
    assert str(default_demo_dir().parent) == mounts["models"]


def test_compose_reads_secrets_from_the_env_file() -> None:
    assert _env_files(_service("loraplex")) == [".env"]
    example = _env_example()
    assert "LORAPLEX_ADMIN_KEY" in example
    # The password is left empty, so `cp .env.example .env && docker compose up` stops with
    # "set POSTGRES_PASSWORD in .env" instead of starting with a well-known password.
    assert "POSTGRES_PASSWORD" in example and example["POSTGRES_PASSWORD"] == ""
    with pytest.raises(AssertionError, match="POSTGRES_PASSWORD"):
        _interpolate(COMPOSE.read_text(), example)
    # Every variable compose.yaml needs (no default) is in .env.example.
    for m in INTERPOLATION.finditer(COMPOSE.read_text()):
        if m.group(2) != "-":
            assert m.group(1) in example, m.group(0)
    # The admin key reaches only the loraplex service (and the ray profile's gateways).
    assert "env_file" not in _service("postgres") and "env_file" not in _service("redis")
    assert "env_file" not in _service("ray-head") and "env_file" not in _service("ray-worker")
    assert _env_files(_service("gateway")) == _env_files(_service("gateway-2")) == [".env"]
    ignored = DOCKERIGNORE.read_text().splitlines()
    assert ".env" in ignored, "the secrets file must stay out of the build context"


def test_compose_environment_is_what_the_cli_reads() -> None:
    """Every LORAPLEX_* variable compose.yaml or .env.example sets is read by the CLI:
    renaming one in the code without updating the deployment fails here."""
    source = _cli_source()
    env = _environment(_service("loraplex"))
    assert {"LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL", "LORAPLEX_HOME",
            "LORAPLEX_ADAPTER_DIR"} <= set(env)
    documented = re.findall(r"^#?\s*(LORAPLEX_[A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), re.M)
    dockerfile_env = re.findall(r"\b(LORAPLEX_[A-Z0-9_]+)=", " ".join(
        rest for word, rest in _dockerfile_instructions() if word == "ENV"))
    names = set(env) | set(documented) | set(dockerfile_env)
    assert "LORAPLEX_ADMIN_KEY" in names
    unread = sorted(n for n in names if not _read_by_cli(n, source))
    assert not unread, f"set for the container but read nowhere in loraplex/: {unread}"


def test_compose_urls_point_at_the_services() -> None:
    import sqlalchemy as sa

    values = {**_env_example(), "POSTGRES_PASSWORD": "0123abcdef"}  # as a user sets it
    env = {k: _interpolate(v, values) for k, v in _environment(_service("loraplex")).items()}
    postgres_env = _environment(_service("postgres"))
    url = sa.engine.make_url(env["LORAPLEX_DATABASE_URL"])
    assert url.drivername == "postgresql+psycopg"  # the driver pyproject installs
    assert (url.host, url.port) == ("postgres", 5432)
    assert url.username == postgres_env["POSTGRES_USER"]
    assert url.database == postgres_env["POSTGRES_DB"]
    assert url.password == values["POSTGRES_PASSWORD"]
    assert _interpolate(postgres_env["POSTGRES_PASSWORD"], values) == values["POSTGRES_PASSWORD"]
    assert env["LORAPLEX_REDIS_URL"].startswith("redis://redis:6379")


# --- compose.yaml, profile `ray` ----------------------------------------------------------


def test_compose_ray_profile_runs_head_workers_and_two_gateways() -> None:
    head, worker = _service("ray-head"), _service("ray-worker")
    gateways = [_service("gateway"), _service("gateway-2")]
    assert head["command"] == ["/app/docker/ray-node.sh", "head"]
    assert worker["command"] == ["/app/docker/ray-node.sh", "worker"]
    assert worker["deploy"]["replicas"] == "${RAY_WORKERS:-2}"
    for gw in gateways:
        assert gw["command"][:4] == ["/app/docker/ray-node.sh", "gateway", "--backend", "ray"]
        assert gw["command"][4:] == ["--replicas", "${RAY_REPLICAS:-2}"]
    # One image, with the ray extra, for every node.
    for name in RAY_SERVICES:
        service = _service(name)
        assert service["image"] == "loraplex:ray"
        assert service["build"]["args"]["EXTRAS"] == "ray"
        assert _environment(service)["RAY_AUTH_TOKEN"] == "${RAY_AUTH_TOKEN:-}"
        assert _environment(service)["LORAPLEX_RAY_ADDRESS"] == "ray-head:6380"
    # The second gateway attaches once the first has deployed the replicas.
    assert gateways[1]["depends_on"] == {"gateway": {"condition": "service_healthy"}}
    assert {"postgres", "redis", "ray-head", "ray-worker"} <= set(gateways[0]["depends_on"])


def test_compose_ray_profile_publishes_only_the_gateways() -> None:
    # The Ray ports stay on the compose network.
    assert "ports" not in _service("ray-head") and "ports" not in _service("ray-worker")
    assert _service("gateway")["ports"] == ["${PUBLISH_ADDRESS:-127.0.0.1}:8000:8000"]
    assert _service("gateway-2")["ports"] == ["${PUBLISH_ADDRESS:-127.0.0.1}:8001:8000"]


def test_compose_ray_profile_shares_the_volumes_at_the_same_paths() -> None:
    # Not the KV disk tier's: one folder per engine, and replicas run without it.
    default = {k: v for k, v in _named_mounts(_service("loraplex")).items() if k != "kvcache"}
    for name in RAY_SERVICES:
        assert _named_mounts(_service(name)) == default, name
    for name in ("gateway", "gateway-2"):
        env = _environment(_service(name))
        assert env["LORAPLEX_ADAPTER_DIR"] == default["adapters"]
        loraplex_env = _environment(_service("loraplex"))
        for key in ("LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL", "LORAPLEX_HOME"):
            assert env[key] == loraplex_env[key], key


def test_ray_profile_is_documented() -> None:
    for text in (COMPOSE.read_text(), ENV_EXAMPLE.read_text()):
        assert "docker compose --profile ray up" in text
        assert "RAY_AUTH_TOKEN" in text
    assert "# RAY_AUTH_TOKEN=" in ENV_EXAMPLE.read_text()


def test_ray_node_script_needs_a_token_and_uses_token_auth() -> None:
    text = RAY_NODE.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert "export RAY_AUTH_MODE=token" in text
    assert 'exec /app/docker/entrypoint.sh "$@"' in text
    assert RAY_NODE.stat().st_mode & stat.S_IXUSR, "docker/ray-node.sh is not executable"
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    result = subprocess.run(["bash", str(RAY_NODE), "head"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "RAY_AUTH_TOKEN" in result.stderr, result


def test_dockerfile_extras_build_argument_installs_pinned_extras() -> None:
    stage = _last_stage(_dockerfile_instructions())
    assert _args(stage).get("EXTRAS") == ""  # the default image: no extras
    run = next(rest for word, rest in stage if word == "RUN" and "$EXTRAS" in rest)
    assert "-c constraints.txt" in run


def test_dockerfile_installs_every_dependency_at_its_pin() -> None:
    """Every pip install of the image's dependencies reads constraints.txt (an unpinned one
    took a newer transformers, whose new dependency broke the Ray replicas); the build
    tools, torch (its own index, pinned by version) and the project itself (--no-deps)
    aside."""
    stage = _last_stage(_dockerfile_instructions())
    installs = [rest for word, rest in stage if word == "RUN" and "pip install" in rest]
    unpinned = [run for run in installs
                if "-c constraints.txt" not in run
                and "--upgrade pip setuptools wheel" not in run
                and "torch==${TORCH_VERSION}" not in run
                and "--no-deps -e ." not in run]
    assert len(installs) >= 4 and unpinned == []
    copied = [rest for word, rest in stage if word == "COPY"]
    first_install = next(i for i, (word, rest) in enumerate(stage)
                         if word == "RUN" and "-c constraints.txt" in rest)
    assert any("constraints.txt" in rest for word, rest in stage[:first_install]
               if word == "COPY"), copied


def test_dockerfile_runs_outside_the_checkout() -> None:
    """The checkout's kernels/ folder must not be importable as `kernels` (a PyPI package's
    name) from a process's working directory: the image's last WORKDIR is its state folder."""
    stage = _last_stage(_dockerfile_instructions())
    workdirs = [rest for word, rest in stage if word == "WORKDIR"]
    assert workdirs[0] == "/app" and workdirs[-1] == "$LORAPLEX_HOME"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "ray" in extras


# --- Dockerfile, .dockerignore ------------------------------------------------------------


def test_dockerfile_base_image_and_torch_are_build_arguments() -> None:
    instructions = _dockerfile_instructions()
    first_from = next(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    global_args = _args(instructions[:first_from])
    assert global_args.get("BASE_IMAGE") == "python:3.11-slim"
    assert instructions[first_from][1].split()[0] == "${BASE_IMAGE}"
    stage = _last_stage(instructions)
    stage_args = _args(stage)
    assert stage_args.get("TORCH_VARIANT") == "cpu"
    assert stage_args.get("TORCH_VERSION") == _torch_pin()
    runs = [rest for word, rest in stage if word == "RUN"]
    torch_run = next(r for r in runs if "torch==${TORCH_VERSION}" in r)
    assert "https://download.pytorch.org/whl/${TORCH_VARIANT}" in torch_run
    # Every build argument compose passes is one the Dockerfile declares.
    for name in ("loraplex", *sorted(RAY_SERVICES)):
        build_args = _service(name)["build"]["args"]
        assert set(build_args) <= set(global_args) | set(stage_args), name


def test_dockerfile_runtime_settings() -> None:
    stage = _last_stage(_dockerfile_instructions())
    words = [word for word, _ in stage]
    assert ("EXPOSE", "8000") in stage
    health = next(rest for word, rest in stage if word == "HEALTHCHECK")
    assert "--start-period=" in health and "http://127.0.0.1:8000/ready" in health
    users = [rest for word, rest in stage if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entrypoint = json.loads(next(rest for word, rest in stage if word == "ENTRYPOINT"))
    assert entrypoint[-1] == "/app/docker/entrypoint.sh"
    assert words.index("ENTRYPOINT") > words.index("USER")
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR, "docker/entrypoint.sh is not executable"
    # The image's state folder is the one compose mounts its volumes under.
    env = " ".join(rest for word, rest in stage if word == "ENV")
    assert "LORAPLEX_HOME=/var/lib/loraplex" in env
    assert _environment(_service("loraplex"))["LORAPLEX_HOME"] == "/var/lib/loraplex"


def test_dockerignore_keeps_what_the_image_needs() -> None:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    excluded = [p for p in patterns if not p.startswith("!")]
    for needed in ("pyproject.toml", "README.md", "loraplex", "kernels", "migrations",
                   "admin_ui", "docker", "docker/entrypoint.sh"):
        for pattern in excluded:
            assert not fnmatch.fnmatch(needed, pattern.strip("/")), (needed, pattern)
    for secret_or_junk in (".env", ".git"):
        assert secret_or_junk in excluded


# --- docker/entrypoint.sh -----------------------------------------------------------------


def test_entrypoint_script_is_strict_and_execs_the_server() -> None:
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert 'exec loraplex serve --host 0.0.0.0 --port 8000 "$@"' in text
    assert "loraplex db upgrade" in text and "loraplex demo prepare" in text
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)


@pytest.mark.parametrize("script", [
    ENTRYPOINT, RAY_NODE, ROOT / "scripts" / "test", ROOT / ".ci" / "run",
    ROOT / "scripts" / "test-compose",
    ROOT / "scripts" / "compose-test" / "postgres" / "entrypoint.sh",
    ROOT / "scripts" / "compose-test" / "redis" / "entrypoint.sh",
], ids=["entrypoint", "ray-node", "scripts/test", ".ci/run", "scripts/test-compose",
        "compose-test/postgres", "compose-test/redis"])
def test_shell_scripts_pass_shellcheck(script: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(extra)
    return env


def test_entrypoint_runs_a_command_given_instead_of_options() -> None:
    result = subprocess.run(
        ["bash", str(ENTRYPOINT), sys.executable, "-c", "print('ran instead')"],
        capture_output=True, text=True, timeout=60, env=_clean_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran instead\n"


def test_entrypoint_gives_up_when_the_database_never_answers(tmp_path: Path) -> None:
    port = _free_port()  # nothing listens there
    env = _clean_env(
        LORAPLEX_DATABASE_URL=f"postgresql+psycopg://loraplex:s3cret@127.0.0.1:{port}/x",
        LORAPLEX_DB_WAIT_S="1", LORAPLEX_HOME=str(tmp_path))
    start = time.monotonic()
    result = subprocess.run(["bash", str(ENTRYPOINT)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 1
    assert "not reachable after 1s" in result.stderr
    assert "s3cret" not in result.stderr  # the password is masked
    assert "migrating" not in result.stderr
    assert time.monotonic() - start < 60


# --- the entry command for real, against the local PostgreSQL and Redis ------------------


@pytest.fixture
def deploy_database() -> Iterator[str]:
    """A fresh PostgreSQL database (created and dropped here); yields its URL."""
    import sqlalchemy as sa

    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    name = f"loraplex_deploy_test_{os.getpid()}"
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_URL}: {exc.orig}")
    try:
        yield sa.engine.make_url(POSTGRES_URL).set(database=name).render_as_string(
            hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture
def deploy_redis() -> Iterator[Any]:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        client.close()
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {exc}")
    yield client
    client.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.server
def test_entrypoint_serves_the_stack_against_local_postgres_and_redis(
        tmp_path: Path, tiny_llama_dir: Path, deploy_database: str,
        deploy_redis: Any) -> None:
    import sqlalchemy as sa
    from alembic.script import ScriptDirectory

    from loraplex.registry import db

    admin_key = "lpx-" + secrets.token_urlsafe(32)
    # The container's environment (compose.yaml), with local addresses and folders.
    local = {
        "LORAPLEX_DATABASE_URL": deploy_database,
        "LORAPLEX_REDIS_URL": REDIS_URL,
        "LORAPLEX_HOME": str(tmp_path / "home"),
        "LORAPLEX_ADAPTER_DIR": str(tmp_path / "home" / "adapters"),
        "LORAPLEX_KV_DISK_DIR": str(tmp_path / "home" / "kv-disk"),
    }
    compose_env = _environment(_service("loraplex"))
    assert set(compose_env) == set(local), "compose.yaml's environment changed: update here"
    env = _clean_env(**local, LORAPLEX_ADMIN_KEY=admin_key,
                     LORAPLEX_MODEL=str(tiny_llama_dir), LORAPLEX_DB_WAIT_S="30")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        # Later options win over the script's --host 0.0.0.0 --port 8000.
        proc = subprocess.Popen(
            ["bash", str(ENTRYPOINT), "--host", "127.0.0.1", "--port", str(port),
             "--max-num-seqs", "4"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_ready(base, proc, "the image's entrypoint", log=log_path)
        # The KV disk tier is on, with the salt secret its blocks need kept beside them.
        assert (tmp_path / "home" / "kv-disk" / ".cache-salt-secret").stat().st_mode & 0o777 \
            == 0o600
        with httpx.Client(base_url=base, timeout=10) as client:
            assert client.get("/health").json() == {"status": "ok"}

            # The image's health check command answers 0 against the live server.
            argv = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
                    for a in _healthcheck_argv(_service("loraplex"))]
            assert argv[0] == "python"
            subprocess.run([sys.executable, *argv[1:]], check=True, timeout=30)

            # The database was migrated to the newest revision.
            head = ScriptDirectory(str(db.migrations_dir())).get_current_head()
            engine = sa.create_engine(deploy_database)
            try:
                with engine.connect() as conn:
                    version = conn.execute(sa.text(
                        f"SELECT version_num FROM {db.VERSION_TABLE}")).scalar_one()
                    admin_rows = conn.execute(sa.text(
                        "SELECT role FROM api_keys WHERE name = 'LORAPLEX_ADMIN_KEY'")).all()
            finally:
                engine.dispose()
            assert version == head
            assert [r.role for r in admin_rows] == ["admin"]  # LORAPLEX_ADMIN_KEY was read
            headers = {"Authorization": f"Bearer {admin_key}"}
            assert client.get("/v1/models", headers=headers).status_code == 200

            # `docker compose exec loraplex loraplex ...`: the same environment, the
            # command passed through the entry point.
            def cli(*args: str) -> Any:
                result = subprocess.run(["bash", str(ENTRYPOINT), "loraplex", *args, "--json"],
                                        env=env, capture_output=True, text=True, timeout=120)
                assert result.returncode == 0, result.stderr
                return json.loads(result.stdout)

            tenant = cli("tenants", "create", "acme")
            key = cli("keys", "create", "--tenant", "acme")["key"]
            # A completion goes through the Redis rate limiter of LORAPLEX_REDIS_URL.
            rl_key = f"loraplex:rl:{{{tenant['id']}}}:req"
            deploy_redis.delete(rl_key)
            response = client.post(
                "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                json={"model": tiny_llama_dir.name, "prompt": "hello world",
                      "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
            assert deploy_redis.exists(rl_key), "the rate limiter did not use Redis"
            leftovers = deploy_redis.keys(f"loraplex:rl:{{{tenant['id']}}}*")
            if leftovers:
                deploy_redis.delete(*leftovers)

        # SIGTERM (what `docker compose stop` sends): a graceful shutdown. uvicorn re-raises
        # the signal once it has shut down, so the status is "terminated by SIGTERM" (143
        # in a container), or 0 should the CLI ever turn that into a normal exit.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM), log_path.read_text()
    finally:
        _stop(proc)
    log_text = log_path.read_text()
    assert "migrating the registry database" in log_text
    assert "preparing the demo model" not in log_text  # LORAPLEX_MODEL was given
    assert "Application shutdown complete" in log_text
    assert "Traceback" not in log_text
    assert admin_key not in log_text  # an operator's key is never printed
