"""The dashboard's plumbing: who is signed in, CSRF, pages and their error pages (the pages themselves:
``server.dashboard.pages``).

Signing in takes the same credential as the REST API (a user's API key, or the admin token), checked by the same
code (``server.deps.get_user_or_admin``). The browser then holds a session cookie: 256 random bits, of which the
server keeps only the SHA-256 (``tables.WebSession``), ``HttpOnly`` (no script reads it), ``Secure`` (sent over
HTTPS only; browsers treat ``localhost`` and ``127.0.0.1`` as secure, so a local server works over plain HTTP),
``SameSite=Strict`` (no other site's page sends it) and scoped to ``/ui``. Signing out deletes the row, so a copy
of the cookie is worthless from then on. An admin session lasts only as long as the admin token it was opened with:
its row holds that token's SHA-256, and once the server's token is another (rotated) or none, the session is
deleted at its next request, so that rotating the token signs every admin browser out as well.

CSRF: every form carries the session's own random token (the synchronizer-token pattern) and every POST compares
it in constant time, 403 when it is missing or wrong. The sign-in form, which has no session yet, comes with a
random cookie, and its token is the HMAC of that cookie under the server's key (``sign_in_token``; the key is
made once, at random, and shared by every API process through the database: ``accounts.server_key``): a cookie
another site (a sibling subdomain, a man in the middle of plain HTTP) set in the browser, with a form token of its
choosing, matches nothing, so no other site can sign a browser in to an account of its choosing. A sign-in the
browser says another site sent (``Sec-Fetch-Site`` other than same-origin or none) is refused too. The pages run no
JavaScript at all, and their Content-Security-Policy says so.

Guessing: failed sign-ins are counted per account and client address, and per client address
(``SignInThrottle``); past either limit a sign-in answers 429 with ``Retry-After`` before its key is checked.
The address is the connection's peer (``X-Forwarded-For`` only from ``MOBIZO_TRUSTED_PROXIES``), so nobody can
keep another user out: their failures count against their own address. A user (and the admin) holds at most
``ui_sessions_per_user`` sessions: signing in past it ends their oldest, so that sign-ins in a loop add no rows.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import accounts, queries
from server.deps import SessionDep, SettingsDep
from server.limits import Failures
from server.security import USER_KEY, constant_time_equal, hash_secret, new_secret, parse_token
from server.settings import Settings
from server.tables import User, WebSession

PREFIX = "/ui"
SESSION_COOKIE = "mobizo_session"
SIGN_IN_COOKIE = "mobizo_sign_in"
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
templates = Jinja2Templates(directory=Path(__file__).parent / "templates")


@dataclass(frozen=True)
class Viewer:
    """Who is signed in: a user, or the admin (``user`` None), and the CSRF token of their forms."""

    user: User | None
    csrf: str
    token_hash: str

    @property
    def admin(self) -> bool:
        return self.user is None

    @property
    def name(self) -> str:
        return "admin" if self.user is None else self.user.name


class SignInRequired(Exception):
    """No valid session cookie: the page answers with a redirect to the sign-in form."""


async def sign_in_required(request: Request, exc: SignInRequired) -> Response:
    return RedirectResponse(f"{PREFIX}/login", status.HTTP_303_SEE_OTHER)


def current_viewer(request: Request, session: SessionDep, settings: SettingsDep) -> Viewer:
    """The session the cookie names; a redirect to the sign-in form without one. A session that no longer holds
    (an admin's whose token was rotated or unset, a user's whose user is gone) is deleted and redirects too."""
    cookie = request.cookies.get(SESSION_COOKIE)
    row = queries.web_session(session, hash_secret(cookie)) if cookie else None
    user = session.get(User, row.user_id) if row is not None and row.user_id is not None else None
    if row is None:
        raise SignInRequired
    if not _still_valid(row, user, settings):
        accounts.close_web_session(session, row.token_hash)
        raise SignInRequired
    return Viewer(user, row.csrf_token, row.token_hash)


def _still_valid(row: WebSession, user: User | None, settings: Settings) -> bool:
    """A user's session while the user exists; the admin's while the server's admin token is the one it was
    opened with (a row without one, or a server without a token: never)."""
    if row.user_id is not None:
        return user is not None
    if settings.admin_token is None or row.admin_token_hash is None:
        return False
    return constant_time_equal(row.admin_token_hash, hash_secret(settings.admin_token))


CurrentViewer = Annotated[Viewer, Depends(current_viewer)]


def check_csrf(expected: str, sent: str) -> None:
    if not sent or not expected or not constant_time_equal(sent, expected):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the form's CSRF token is missing or wrong: reload the page")


def sign_in_token(request: Request, cookie: str) -> str:
    """The sign-in form's token for the sign-in ``cookie``: its HMAC under the server's key (``tables.ServerKey``),
    which only this server can compute; "" without a cookie."""
    if not cookie:
        return ""
    return hmac.new(request.app.state.sign_in_key.encode(), cookie.encode(), hashlib.sha256).hexdigest()


def check_sign_in_form(request: Request, sent: str) -> None:
    """403 unless the form's token is the one this server gave with the browser's sign-in cookie, and the browser
    does not say another site sent the form."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "a sign-in sent from another site is refused")
    check_csrf(sign_in_token(request, request.cookies.get(SIGN_IN_COOKIE, "")), sent)


def sign_in(response: Response, session: SessionDep, user: User | None, settings: Settings) -> None:
    """A new session for ``user`` (None: the admin, whose session records the hash of the token it signed in
    with), its cookie set on ``response``."""
    secret = new_secret()
    ttl = timedelta(hours=settings.ui_session_hours)
    admin_token_hash = hash_secret(settings.admin_token) if user is None and settings.admin_token else None
    accounts.open_web_session(
        session,
        hash_secret(secret),
        None if user is None else user.id,
        new_secret(),
        ttl,
        keep=settings.ui_sessions_per_user,
        admin_token_hash=admin_token_hash,
    )
    response.set_cookie(
        SESSION_COOKIE,
        secret,
        max_age=int(ttl.total_seconds()),
        path=PREFIX,
        secure=True,
        httponly=True,
        samesite="strict",
    )
    response.delete_cookie(SIGN_IN_COOKIE, path=PREFIX, secure=True, httponly=True, samesite="strict")


class SignInThrottle:
    """Failed sign-ins per account from one client address, and per client address at all accounts, each within
    ``sign_in_window_s`` (``sign_in_failures_per_account``, ``sign_in_failures_per_address``). Past either limit a
    sign-in is refused before its key is checked, so that a guess made then tells nothing, right or wrong.

    The account of a key is the user whose id it names (whether or not that user exists: the count does not tell
    which ids do), or the admin for any other key, which can only be a guess at the admin token. Both counts are the
    guesser's own address's, so guessing at someone's key, or at the admin token, never keeps its owner out
    (elsewhere): only a host behind the same address (IPv6: the same /64) shares its count. Guesses spread over many
    addresses are bounded per address only; an API key (256 random bits) and an admin token of 16 characters or
    more are out of reach of guessing anyway (the REST API does not look at these counts).
    """

    def __init__(self, settings: Settings) -> None:
        self.addresses = Failures(settings.sign_in_failures_per_address, settings.sign_in_window_s)
        self.accounts = Failures(settings.sign_in_failures_per_account, settings.sign_in_window_s)

    def refusal(self, address: str, account: str) -> tuple[str, int] | None:
        """(why, seconds to wait) when a sign-in from ``address`` to ``account`` must wait; None when it may try."""
        at = "at the admin token" if account == "admin" else "with this key"
        for failures, key, whence in (
            (self.accounts, f"{account} from {address}", f"{at} from this address"),
            (self.addresses, address, "from this address"),
        ):
            wait = failures.wait_s(key)
            if wait > 0:
                seconds = max(1, math.ceil(wait))
                return f"too many failed sign-ins {whence}: try again in {seconds} s", seconds
        return None

    def failed(self, address: str, account: str) -> None:
        self.addresses.failed(address)
        self.accounts.failed(f"{account} from {address}")


async def get_sign_in_throttle(request: Request) -> SignInThrottle:
    return request.app.state.sign_in_throttle


SignInThrottleDep = Annotated[SignInThrottle, Depends(get_sign_in_throttle)]


def client_address(request: Request) -> str:
    """The address sign-in failures are counted by: the client as uvicorn reports it (the connection's peer; behind
    a proxy, the client its ``X-Forwarded-For`` names only where ``MOBIZO_TRUSTED_PROXIES`` names the proxy:
    ``server.commands.serve``), an IPv6 address by its /64, which one client usually holds whole."""
    host = request.client.host if request.client is not None else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(getattr(address, "ipv4_mapped", None) or address)


def account_of(key: str) -> str:
    """The account a sign-in key tries: ``user <id>`` for what looks like a user's API key, else ``admin``."""
    parsed = parse_token(key)
    return f"user {parsed[1]}" if parsed is not None and parsed[0] == USER_KEY else "admin"


def sign_in_page(request: Request, error: str | None = None, code: int = status.HTTP_200_OK) -> Response:
    """The sign-in form with a new short-lived cookie, its token that cookie's HMAC (``sign_in_token``)."""
    cookie = secrets.token_urlsafe(32)
    response = page(request, "login.html", None, code, error=error, sign_in_token=sign_in_token(request, cookie))
    flags = {"path": PREFIX, "secure": True, "httponly": True, "samesite": "strict"}
    response.set_cookie(SIGN_IN_COOKIE, cookie, max_age=3600, **flags)
    return response


def page(request: Request, name: str, viewer: Viewer | None, code: int = 200, **context: Any) -> Response:
    return templates.TemplateResponse(request, name, {"viewer": viewer, **context}, status_code=code, headers=_HEADERS)


_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """The dashboard's HTTP error handler: a page's error is a page."""
    return error_page(request, exc)


async def validation_error(request: Request, exc: RequestValidationError) -> Response:
    """The dashboard's validation error handler: a malformed address or form is a page (the 422 names nothing of
    what was sent)."""
    return error_page(request, StarletteHTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "invalid request"))


def error_page(request: Request, exc: StarletteHTTPException) -> Response:
    """An error of a dashboard page as a page (a 404 for another tenant's job looks like any missing page)."""
    detail = exc.detail if isinstance(exc.detail, str) else "the request is invalid"
    return page(request, "error.html", None, exc.status_code, error_code=exc.status_code, detail=detail)
