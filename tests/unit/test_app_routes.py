"""The request path stays on the event loop: FastAPI runs a plain ``def`` endpoint or
dependency in its thread pool, and that trip waits twice for the GIL (out to a worker, back to
the loop), each time up to the switch interval while the engine thread runs Python."""

from __future__ import annotations

import inspect

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from service.api.app import create_app
from service.config import Settings


def _calls(dependant: Dependant):
    yield dependant.call
    for sub in dependant.dependencies:
        yield from _calls(sub)


def _routes(routes):
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif (router := getattr(route, "original_router", None)) is not None:  # an included router
            yield from _routes(router.routes)


def test_no_route_or_dependency_runs_in_the_thread_pool():
    app = create_app(Settings())  # models load in the lifespan, which does not run here
    routes = list(_routes(app.routes))
    assert any(r.path == "/v1/chat/completions" for r in routes)
    sync = [(r.path, c.__name__) for r in routes for c in _calls(r.dependant) if not inspect.iscoroutinefunction(c)]
    assert sync == []
