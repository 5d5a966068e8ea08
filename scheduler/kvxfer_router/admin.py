"""The router's admin app: what operators and tools may see, but clients must not.

``GET /workers`` lists every registered worker with its HTTP URL and engine address: a map
of the internal network and the first step of every attack on the data plane. It is served
only here, on ``admin_host:admin_port`` (127.0.0.1 by default), never on the public port.
``GET /health`` lets tools wait for it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from .app import RouterService


def create_admin_app(service: RouterService) -> FastAPI:
    """The admin app over the state of one router (`app.state.router` of the public app)."""
    app = FastAPI(title="kvxfer router admin", openapi_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The admin server is up."""
        return {"status": "ok"}

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        """Known workers with their registry records and this router's load on each."""
        load = service.dispatcher.load
        return {
            "in_flight": service.admission.in_flight,
            "max_in_flight": service.admission.capacity,
            "policy": service.settings.policy,
            "workers": [dict(w.as_dict(), router_in_flight=load.get(w.worker_id))
                        for w in service.directory.workers()],
        }

    return app
