"""API key tokens: `rbk_<id>_<secret>`, the id (12 hex digits) naming the stored row, the secret 32
random bytes (url-safe base64). Only the token's sha256 is stored, and a presented token is compared
with it in constant time (hmac.compare_digest). A fast hash is enough here: the token carries 256 bits
of randomness, so there is nothing to guess from its hash; a slow hash (scrypt) protects low-entropy
passwords, and would cost every request milliseconds of CPU."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

PREFIX = "rbk_"
_TOKEN = re.compile(r"^rbk_([0-9a-f]{12})_[A-Za-z0-9_-]{43}$")


def new_token() -> tuple[str, str]:
    """(key id, token): the token is shown once, at creation."""
    key_id = secrets.token_hex(6)
    return key_id, f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def key_id_of(token: str) -> str | None:
    """The key id a well-formed token names; None for anything else (the server's own key, say)."""
    match = _TOKEN.fullmatch(token)
    return None if match is None else match.group(1)


def matches(token: str, stored_hash: str) -> bool:
    """Whether `token` is the one whose hash is stored, in constant time."""
    return hmac.compare_digest(token_hash(token).encode(), stored_hash.encode())
