"""The dashboard: server-rendered pages for people, a sub-application mounted at ``/ui`` (``web.PREFIX``) beside the
REST API, with its own error handlers: any error of a page is a page (``web.error_page``), and a page that needs a
signed-in browser without one redirects to the sign-in form. The REST API's errors stay JSON
(``server.responses``), and neither side looks at the other's paths.

- ``pages``: the pages and their forms (jobs, devices, adapters, the admin's view and cohorts);
- ``web``: who is signed in (the session cookie, ``tables.WebSession``), CSRF, the sign-in throttle, rendering;
- ``charts``: the pages' charts as inline SVG;
- ``templates/``: the Jinja2 templates.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import State
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.dashboard import pages, web

PREFIX = web.PREFIX


def create_dashboard(state: State) -> FastAPI:
    """The dashboard's application, sharing the API's ``state`` (settings, database, store, throttle): mount it at
    ``PREFIX``."""
    dashboard = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    dashboard.state = state
    dashboard.include_router(pages.router)
    dashboard.add_exception_handler(StarletteHTTPException, web.http_error)
    dashboard.add_exception_handler(RequestValidationError, web.validation_error)
    dashboard.add_exception_handler(web.SignInRequired, web.sign_in_required)
    return dashboard
