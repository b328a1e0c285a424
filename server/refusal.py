"""Why a shard refuses a call: the domain's own refusal, with no transport in it.

The domain (`state`, `shard`, `recovery`, `moves`) raises `ShardError(Why.X, message)`;
the servicer (`server/service.py`) alone turns each reason into a gRPC status code
(`service.STATUS`), so a client can branch on the code and read the message.
"""

from __future__ import annotations

import enum


class Why(enum.Enum):
    """The reason for a refusal, by what the caller can do about it."""

    MALFORMED = "malformed"  # a value out of its type or range: never succeeds as sent
    NOT_FOUND = "not found"  # a fragment the plan does not have
    OUT_OF_STEP = "out of step"  # does not follow the shard's state (plan, map, owner, move)
    BUSY = "busy"  # retry shortly: recovering, a fragment moving or changed, the log failed
    TOO_BIG = "too big"  # past a size limit or a budget of bytes held (the message names it)
    TIMED_OUT = "timed out"  # a stream that sent nothing for too long
    DENIED = "denied"  # a token acting beyond what it is bound to
    UNKNOWN_CALLER = "unknown caller"  # no token, or one the shard does not know
    BROKEN = "broken"  # the shard itself failed (a bug; logged with its traceback)


class ShardError(Exception):
    """A refused call: why, a message saying what to fix, and trailing metadata a
    client acts on (the owner a fragment moved to)."""

    def __init__(self, why: Why, message: str, metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.why = why
        self.metadata = metadata


def broken(e: BaseException) -> ShardError:
    """The refusal for an error the shard did not expect (a bug: the caller logs it with
    its traceback): INTERNAL, naming the error."""
    return ShardError(Why.BROKEN, f"the shard failed: {type(e).__name__}: {e}")
