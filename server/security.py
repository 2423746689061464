"""Random secrets stored only as hashes and compared in constant time.

API keys and device tokens look like ``mbzu_<id>_<secret>`` / ``mbzd_<id>_<secret>``: the id finds the row
without searching by secret, and the secret's SHA-256 is compared with ``hmac.compare_digest``, so response time
says nothing about how much of a guess was right. SHA-256 (not a slow password hash) is enough because the secrets
are 256 random bits, not something a person chose. A token whose id names no row is rejected after the same work
as one with a wrong secret (``secret_matches`` with no hash; the device-token cache reads the row on every
rejection, ``server.deps.get_device_identity``), so that the time of a rejection does not say which ids exist.

Enrollment codes are shorter (people type them): 12 characters from a 32-letter alphabet, **60 bits**, looked up
by hash, one-time and short-lived (``ttl_s``). Guesses are not rate-limited: at 425 guesses/s (a loopback server's
rate) a guesser holding the whole request rate finds one of ``n`` live codes after about 2**60 / (425 n) seconds,
some 86 million years for n = 1, so that the code's length, not a throttle, is the defence.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from shared.schemas import MAX_DB_INT

USER_KEY = "mbzu"
DEVICE_TOKEN = "mbzd"
_TOKEN = re.compile(r"^(mbz[ud])_([1-9][0-9]{0,18})_([A-Za-z0-9_-]{43})$")
_CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O or 1/I to misread


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def make_token(kind: str, row_id: int, secret: str) -> str:
    return f"{kind}_{row_id}_{secret}"


def parse_token(token: str) -> tuple[str, int, str] | None:
    """(kind, row id, secret), or None when the token is not one of ours (an id no row can have included)."""
    match = _TOKEN.match(token)
    if match is None or int(match.group(2)) > MAX_DB_INT:
        return None
    return match.group(1), int(match.group(2)), match.group(3)


def secret_matches(secret: str, stored_hash: str | None) -> bool:
    """Whether ``secret`` hashes to ``stored_hash``; with None (no row has the token's id) the same work is done
    against a hash no secret has, so that a rejection takes as long for an unknown id as for a wrong secret."""
    matches = hmac.compare_digest(hash_secret(secret), stored_hash if stored_hash is not None else _NO_HASH)
    return matches and stored_hash is not None


_NO_HASH = "0" * 64  # the shape of a stored hash, which no secret's SHA-256 is in practice


def constant_time_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def new_enrollment_code() -> str:
    """Twelve characters from a 32-letter alphabet (60 bits), shown as ``XXXX-XXXX-XXXX``."""
    chars = "".join(secrets.choice(_CODE_ALPHABET) for _ in range(12))
    return f"{chars[:4]}-{chars[4:8]}-{chars[8:]}"


def normalize_code(code: str) -> str:
    """Codes are matched case-insensitively and with or without dashes or spaces."""
    chars = re.sub(r"[\s-]", "", code).upper()
    return f"{chars[:4]}-{chars[4:8]}-{chars[8:]}"
