"""Random secrets stored only as hashes and compared in constant time.

API keys and device tokens look like ``mbzu_<id>_<secret>`` / ``mbzd_<id>_<secret>``: the id finds the row
without searching by secret, and the secret's SHA-256 is compared with ``hmac.compare_digest``, so response time
says nothing about how much of a guess was right. SHA-256 (not a slow password hash) is enough because the secrets
are 256 random bits, not something a person chose. Enrollment codes are shorter (people type them); they are
looked up by hash and are one-time and short-lived.
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


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


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
