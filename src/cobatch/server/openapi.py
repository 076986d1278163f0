"""/openapi.json: the spec clients, gateways and fuzzers work from.

Routes read their bodies themselves (server/request_body.py: the size limit, malformed JSON and validation
errors all answered in the protocol's error shape), so FastAPI cannot see the body models. A route names its
model with `@accepts(Model)`, and the spec gets each such model as the route's JSON request body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

Endpoint = TypeVar("Endpoint", bound=Callable)


def accepts(model: type[BaseModel]) -> Callable[[Endpoint], Endpoint]:
    """Mark an endpoint as taking `model` as its JSON body (for the spec only: the endpoint still reads it)."""
    def mark(endpoint: Endpoint) -> Endpoint:
        endpoint.__body_model__ = model
        return endpoint
    return mark


def build_openapi(app: FastAPI, routers: list[APIRouter]) -> dict:
    """FastAPI's spec of `app`, plus the body model of each `@accepts` route of `routers` (included unprefixed)."""
    spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    bodies = [(route, route.endpoint.__body_model__) for router in routers for route in router.routes
              if isinstance(route, APIRoute) and hasattr(route.endpoint, "__body_model__")]
    # One schema pass over every model: pydantic gives same-named models (two CompletionRequests) distinct keys.
    refs, defs = models_json_schema([(model, "validation") for model in dict.fromkeys(m for _, m in bodies)],
                                    ref_template="#/components/schemas/{model}")
    spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for route, model in bodies:
        for method in route.methods:
            operation = spec["paths"][route.path_format][method.lower()]
            operation["requestBody"] = {"required": True,
                                        "content": {"application/json": {"schema": refs[(model, "validation")]}}}
    return spec


def install(app: FastAPI, routers: list[APIRouter]) -> None:
    """Serve the spec built above (cached after the first request)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, routers)
        return app.openapi_schema
    app.openapi = openapi
