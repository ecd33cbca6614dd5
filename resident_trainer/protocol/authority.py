"""Authority: nothing runs unless a job carries the exact string configured
in RESIDENT_TRAINER_AUTHORITY.

Comparisons are constant-time (``hmac.compare_digest``) so response timing
does not reveal how much of a guess was right. An empty configured authority
means nothing is authorised. The authority itself never travels: the head
checks the job's string, then broadcasts only an HMAC tag of the job's
identity, which every worker recomputes with its own configured authority.
"""

from __future__ import annotations

import hashlib
import hmac


def authority_ok(expected: str, presented: str | None) -> bool:
    """True only when `expected` is non-empty and `presented` equals it."""
    if not isinstance(expected, str):
        raise TypeError(f"expected authority must be a str, got {type(expected).__name__}")
    if presented is not None and not isinstance(presented, str):
        raise TypeError(f"presented authority must be a str or None, got {type(presented).__name__}")
    if not expected:
        return False
    # compare_digest on bytes: it accepts any content, and str inputs must be ASCII.
    return hmac.compare_digest(expected.encode(), (presented or "").encode())


def start_tag(authority: str, *fields: object) -> str:
    """HMAC-SHA256 (hex) of the job's identity `fields`, keyed by `authority`."""
    if not authority:
        raise ValueError("start_tag needs a non-empty authority")
    msg = "\x1f".join(str(f) for f in fields).encode()
    return hmac.new(authority.encode(), msg, hashlib.sha256).hexdigest()


def tag_ok(authority: str, tag: object, *fields: object) -> bool:
    """True when `tag` is start_tag(authority, *fields) and authority is set."""
    if not authority or not isinstance(tag, str):
        return False
    return hmac.compare_digest(start_tag(authority, *fields).encode(), tag.encode())
