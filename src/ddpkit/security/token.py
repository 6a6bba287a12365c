"""The job token: a shared secret every rank must hold to be admitted at rendezvous.

The token comes from ``DDPKIT_JOB_TOKEN`` (the secret itself) or ``DDPKIT_JOB_TOKEN_FILE`` (a file
holding it; surrounding whitespace is ignored). ddpkit never prints or logs it, and never writes
it to the store: the store sees only HMAC-SHA256 values (RFC 2104) keyed with it.

At rendezvous (:func:`ddpkit.runtime.rendezvous.join`) the first process to arrive records
the job: its world size, a random 32-byte challenge, and ``verifier = HMAC(token, challenge ||
"verify")``. Each later process checks its own token against the verifier and refuses to join on
a mismatch (a misconfigured or foreign process stops itself with a clear error). Each admitted
rank's claim carries ``HMAC(token, challenge || rank || claim)``, and every rank verifies every
claim before the process group is created, so a client that skips ddpkit's checks and writes a
claim by hand makes the job fail loudly instead of being admitted.

Generate a token with ``python -c "import secrets; print(secrets.token_hex(32))"``: the
verifier is visible to anyone who can read the store, so a short or guessable token could be
found offline.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from ddpkit.errors import ConfigError

TOKEN_ENV = "DDPKIT_JOB_TOKEN"
TOKEN_FILE_ENV = "DDPKIT_JOB_TOKEN_FILE"
MIN_TOKEN_BYTES = 16


def load_token(environ: dict[str, str] | None = None) -> bytes | None:
    """The job token from the environment, or ``None`` when the job has none.

    Raises:
        ConfigError: both variables are set; the file is missing, unreadable, not text or
            empty; the token is shorter than 16 bytes. (The message never contains the token.)
    """
    env = os.environ if environ is None else environ
    value, path = env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV)
    if value and path:
        raise ConfigError(
            f"job token given twice: {TOKEN_ENV} and {TOKEN_FILE_ENV} are both set. Set one."
        )
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(
                f"cannot read the job token: {TOKEN_FILE_ENV}={path}: {why}. Point it at a "
                "readable text file holding the token."
            ) from None
        if not value:  # never fail open: a token was asked for
            raise ConfigError(
                f"empty job token: {TOKEN_FILE_ENV}={path} holds no token. Write the token into "
                'it (python -c "import secrets; print(secrets.token_hex(32))"), or unset it.'
            )
    if not value:
        return None
    token = value.encode()
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"job token too short: {len(token)} bytes, at least {MIN_TOKEN_BYTES} needed. "
            'Generate one: python -c "import secrets; print(secrets.token_hex(32))".'
        )
    return token


def mac(token: bytes, *parts: str) -> str:
    """``HMAC-SHA256(token, parts joined by "|")`` as hex."""
    return hmac.new(token, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def same(a: str, b: str) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(a.encode(), b.encode())
