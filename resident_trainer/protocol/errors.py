"""Exceptions of the coordination protocol.

Every failure a rank can recover from (the store did not answer, a peer left a
collective) is a `ProtocolError`; the state machines catch only these, so a
programming error still surfaces as itself.
"""

from __future__ import annotations


class ProtocolError(RuntimeError):
    """Base of the protocol's recoverable failures."""


class StoreError(ProtocolError):
    """The key-value store did not complete an operation."""


class StoreUnavailable(StoreError):
    """The store refused or lost the connection (the server may be gone)."""


class StoreTimeout(StoreError):
    """A store operation took longer than the client's timeout."""


class RecordTooLarge(ValueError):
    """A value exceeds what the store accepts; raised before anything is sent,
    because TCPStore drops the whole connection on an oversized payload."""


class ChannelError(ProtocolError):
    """A record's stored tags do not match the key it was read from."""


class FencedOut(ProtocolError):
    """A lease's fencing token is no longer current: its holder has been
    superseded (or its lease expired), and its writes are refused."""


class LinkClosed(ProtocolError):
    """The serving-op link to the head is gone."""


class PeerLost(ProtocolError):
    """A collective lost one of its participants."""


class HotLoadRefused(ProtocolError):
    """A hot-load was refused (disabled, unauthorised, or digests disagree)."""
