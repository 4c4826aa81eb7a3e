"""``loraplex adapters promote``, ``adapters split`` and ``adapters pin``/``unpin`` on SQLite
and PostgreSQL: the state they print, and refusals as one line on stderr that change
nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_registry_cli import Cli, any_cli, home

from loraplex.cli_registry import run_registry_cli

__all__ = ["any_cli", "home"]  # the fixtures this module's tests use


@pytest.fixture
def versions_cli(any_cli: Cli, make_adapter: Callable[..., Path]) -> Cli:
    """Tenant acme with adapter ``bot`` at versions 1, 2, 3 (the last one deleted) and 4."""
    cli = any_cli
    cli("db", "upgrade")
    cli("tenants", "create", "acme")
    for n in (1, 2, 3, 4):
        cli("adapters", "add", "--tenant", "acme", "--name", "bot",
            str(make_adapter(f"bot{n}", seed=n)))
    cli("adapters", "delete", "--tenant", "acme", "--name", "bot", "--version", "3")
    return cli


def _state(data: dict[str, Any]) -> tuple[Any, ...]:
    split = data["split"]
    return (data["current_version"], data["promoted"],
            None if split is None else (split["version"], split["percent"]),
            [(v["version"], v["current"], v["traffic_percent"]) for v in data["versions"]])


def test_promote_rollback_split_and_cancel(versions_cli: Cli,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cli = versions_cli
    assert _state(cli("adapters", "promote", "--tenant", "acme", "bot", "2")) == (
        2, True, None, [(1, False, 0), (2, True, 100), (4, False, 0)])
    assert _state(cli("adapters", "split", "--tenant", "acme", "bot", "--to", "4",
                      "--percent", "12.5")) == (
        2, True, (4, 12.5), [(1, False, 0), (2, True, 87.5), (4, False, 12.5)])
    assert _state(cli("adapters", "split", "--tenant", "acme", "bot", "--cancel"))[2] is None
    assert _state(cli("adapters", "promote", "--tenant", "acme", "bot", "1"))[0] == 1
    # The text output says where requests go, in one line.
    cli("adapters", "split", "--tenant", "acme", "bot", "--to", "4", "--percent", "10")
    capsys.readouterr()
    assert run_registry_cli(["adapters", "promote", "--tenant", "acme", "bot", "4",
                             *cli.options[:-1]]) == 0
    assert capsys.readouterr().out == "acme/bot: current version 4\n"
    cli("adapters", "split", "--tenant", "acme", "bot", "--to", "1", "--percent", "10")
    assert run_registry_cli(["adapters", "split", "--tenant", "acme", "bot", "--to", "2",
                             "--percent", "25", *cli.options[:-1]]) == 0
    assert capsys.readouterr().out == (
        "acme/bot: current version 4, 25% of requests split to version 2 (75% stay on 4)\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["promote", "bot", "9"], "no version 9"),
    (["promote", "bot", "3"], "deleted"),
    (["promote", "bot", "0"], "VERSION must be an integer"),
    (["promote", "bot", "x"], "VERSION must be an integer"),
    (["promote", "bot", "9" * 5000], "VERSION must be an integer"),
    (["promote", "nope", "1"], "no active adapter nope"),
    (["split", "bot", "--to", "3", "--percent", "10"], "deleted"),
    (["split", "bot", "--to", "9", "--percent", "10"], "no version 9"),
    (["split", "bot", "--to", "4", "--percent", "10"], "already the current version"),
    (["split", "bot", "--to", "2", "--percent", "101"], "--percent must be a number"),
    (["split", "bot", "--to", "2", "--percent", "-1"], "--percent must be a number"),
    (["split", "bot", "--to", "2", "--percent", "nan"], "--percent must be a number"),
    (["split", "bot", "--to", "2", "--percent", "1e400"], "--percent must be a number"),
    (["split", "bot", "--to", "2", "--percent", "ten"], "--percent must be a number"),
    (["split", "bot", "--to", "two", "--percent", "10"], "--to must be an integer"),
    (["split", "bot", "--to", "2"], "needs --to N and --percent P"),
    (["split", "bot", "--cancel", "--to", "2"], "--cancel takes neither"),
    (["split", "bot", "--cancel"], "no split in progress"),
])
def test_refusals_are_one_line_and_change_nothing(versions_cli: Cli, argv: list[str],
                                                  message: str) -> None:
    cli = versions_cli
    before = cli("adapters", "list", "--all")
    command, *rest = argv
    err = cli("adapters", command, "--tenant", "acme", *rest, expect=2)
    assert message in err and len(err) < 300, err
    assert cli("adapters", "list", "--all") == before
    assert cli("adapters", "list", "--tenant", "acme")[0]["version"] == 4


def _pins(data: dict[str, Any]) -> list[tuple[int, bool]]:
    return [(v["version"], v["pinned"]) for v in data["versions"]]


def test_pin_and_unpin(versions_cli: Cli, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI records pins without a server (no share to check); the text says which a
    server applies: the oldest, as many as its share of slots."""
    cli = versions_cli
    data = cli("adapters", "pin", "--tenant", "acme", "bot", "--version", "2")
    assert _pins(data) == [(1, False), (2, True), (4, False)]
    assert data["versions"][1]["pinned_at"] is not None
    assert _pins(cli("adapters", "pin", "--tenant", "acme", "bot", "--version", "4")) == [
        (1, False), (2, True), (4, True)]
    # Again: no change (the pin keeps its age).
    again = cli("adapters", "pin", "--tenant", "acme", "bot", "--version", "2")
    assert again["versions"][1]["pinned_at"] == data["versions"][1]["pinned_at"]
    listed = cli("adapters", "list", "--all")
    assert {(a["version"], a["pinned"]) for a in listed} == {(1, False), (2, True),
                                                             (3, False), (4, True)}
    capsys.readouterr()
    assert run_registry_cli(["adapters", "pin", "--tenant", "acme", "bot", "--version", "1",
                             *cli.options[:-1]]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    assert out.startswith("acme/bot version 1 pinned; pinned, oldest first: acme/bot@2, "
                          "acme/bot@4, acme/bot@1. A server holds the oldest "
                          "floor(--max-pinned-fraction x --max-loras) of them"), out
    assert _pins(cli("adapters", "unpin", "--tenant", "acme", "bot", "--version", "2")) == [
        (1, True), (2, False), (4, True)]
    # Unpinning what is not pinned changes nothing.
    assert _pins(cli("adapters", "unpin", "--tenant", "acme", "bot", "--version", "2")) == [
        (1, True), (2, False), (4, True)]
    # A deleted version is no longer pinned.
    cli("adapters", "delete", "--tenant", "acme", "--name", "bot", "--version", "4")
    listed = cli("adapters", "list", "--all")
    assert {(a["version"], a["pinned"]) for a in listed} == {(1, True), (2, False),
                                                             (3, False), (4, False)}


@pytest.mark.parametrize(("argv", "message"), [
    (["pin", "bot", "--version", "9"], "no version 9"),
    (["pin", "bot", "--version", "3"], "cannot pin adapter bot version 3: that version is "
                                       "deleted"),
    (["pin", "bot", "--version", "0"], "--version must be an integer"),
    (["pin", "bot", "--version", "x"], "--version must be an integer"),
    (["pin", "bot", "--version", "1.5"], "--version must be an integer"),
    (["pin", "bot", "--version", "9" * 5000], "--version must be an integer"),
    (["pin", "nope", "--version", "1"], "no active adapter nope"),
    (["pin", "bot@1", "--version", "1"], "no active adapter bot@1"),
    (["unpin", "bot", "--version", "3"], "cannot unpin adapter bot version 3"),
    (["unpin", "bot", "--version", "9"], "no version 9"),
    (["unpin", "bot", "--version", "-1"], "--version must be an integer"),
])
def test_pin_refusals_are_one_line_and_change_nothing(versions_cli: Cli, argv: list[str],
                                                      message: str) -> None:
    cli = versions_cli
    cli("adapters", "pin", "--tenant", "acme", "bot", "--version", "1")
    before = cli("adapters", "list", "--all")
    command, *rest = argv
    err = cli("adapters", command, "--tenant", "acme", *rest, expect=2)
    assert message in err and len(err) < 300, err
    assert cli("adapters", "list", "--all") == before
    err = cli("adapters", command, "--tenant", "nobody", *rest, expect=2)
    assert len(err) < 300 and cli("adapters", "list", "--all") == before
