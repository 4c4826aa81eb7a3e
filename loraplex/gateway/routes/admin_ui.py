"""The admin pages (static files, no build step) under ``/admin``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

logger = logging.getLogger("loraplex.gateway")

# The pages' folder in a checkout (or an editable install, as the Docker image has).
ADMIN_UI_DIR: Final = Path(__file__).resolve().parents[3] / "admin_ui"
_UI_HEADERS: Final = {
    # Only the pages' own scripts and styles run, and no other site may frame them: the
    # admin key lives in this tab's sessionStorage.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class AdminUIFiles(StaticFiles):
    """The admin pages, served with headers that keep the admin key in the page."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        if scope["method"] in ("GET", "HEAD"):
            return await super().get_response(path, scope)
        # An unknown path under /admin/ is 404 whatever the method (as under /admin/api/);
        # only a page that exists is 405, and says which methods it has.
        found = await super().get_response(path, {**scope, "method": "GET"})
        if found.status_code == 404:
            raise HTTPException(status_code=404)
        raise HTTPException(status_code=405, headers={"Allow": "GET, HEAD"})

    def file_response(self, full_path: str | os.PathLike[str], stat_result: os.stat_result,
                      scope: Scope, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(_UI_HEADERS)
        return response


def admin_ui_mount(directory: Path = ADMIN_UI_DIR) -> Mount | None:
    """``/admin`` serving the admin pages, or None when the folder is not there (a wheel
    install: the pages ship with the source tree)."""
    if not (directory / "index.html").is_file():
        logger.warning("admin UI not served: %s has no index.html", directory)
        return None
    return Mount("/admin", app=AdminUIFiles(directory=directory, html=True), name="admin_ui")
