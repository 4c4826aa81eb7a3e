"""Whether a Ray cluster's address can be reached: checked in seconds, before anything is
loaded (``ray.init`` would retry for minutes, and importing Ray alone takes seconds)."""

from __future__ import annotations

import os
import socket
from typing import Final

from loraplex.errors import ConfigError

ENV_RAY_ADDRESS: Final = "LORAPLEX_RAY_ADDRESS"
CONNECT_TIMEOUT_S: Final = 5.0


def ray_address(configured: str | None) -> str | None:
    """The cluster to join: ``configured``, else ``LORAPLEX_RAY_ADDRESS``; None to start a
    local one."""
    return configured or os.environ.get(ENV_RAY_ADDRESS) or None


def check_reachable(address: str) -> None:
    """ConfigError in one line unless a TCP connection to ``address`` (``host:port``, or
    ``ray://host:port``) opens within CONNECT_TIMEOUT_S."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"the Ray address {address!r} is not host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)),
                                 timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address}: "
                          f"{exc.strerror or exc}") from None
