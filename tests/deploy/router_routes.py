"""The router's FastAPI app built without a running router, for tests that check which routes
the deployments' probes and scrapes name."""

from types import SimpleNamespace


def router_app():
    from pdserve.services.router.api.http_app import build_app
    from pdserve.services.router.config import RouterConfig

    # routes are registered up front; the state is used per request (the edge middleware reads
    # only its limits at build time)
    return build_app(SimpleNamespace(metrics=None, config=RouterConfig()))
