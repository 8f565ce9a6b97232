"""Secrets for API tokens and node join tokens: how they are made, hashed and compared.

Secrets are 32 random bytes (256 bits) from the OS's CSPRNG. Only their sha256 is stored. A
slow password hash (bcrypt, argon2) exists to make guessing *low-entropy* human passwords
expensive; guessing one of 2**256 secrets is infeasible whatever the hash costs, so a fast,
unsalted sha256 loses nothing, and it lets a request find its token with one indexed equality
lookup instead of trying a slow hash against every stored row.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

API_TOKEN_PREFIX = "htk_"
JOIN_TOKEN_PREFIX = "htj_"
SHOWN_PREFIX_LENGTH = 12


def new_secret(prefix: str) -> str:
    """A fresh secret: a readable prefix (to spot leaked tokens) and 256 random bits."""
    return prefix + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    """The hex sha256 of a secret, the only form in which it is stored."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def secrets_equal(given: str, expected: str) -> bool:
    """Compare two secrets in constant time."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))
