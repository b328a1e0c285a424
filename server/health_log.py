"""What a running shard says when its round timer fails or its health changes: one
readable line each, a traceback only for a failure nobody foresaw."""

from __future__ import annotations

import logging

from atoll.server.refusal import ShardError

log = logging.getLogger("atoll.syncer")


def tick_failed(error: Exception, in_a_row: int) -> None:
    """A round-timer tick failed: a refusal the shard made (a full disk refusing a round
    close, say) in one line, anything else with its traceback."""
    if isinstance(error, ShardError):
        log.warning("round timer: tick failed (%d in a row): %s", in_a_row, error)
    else:
        log.exception("round timer: tick failed (%d in a row)", in_a_row)


def health_changed(serving: bool, log_failure: str | None, tick_failures: int) -> None:
    """Health is about to say SERVING or NOT_SERVING; says why."""
    if serving:
        log.info("health says SERVING: the round timer is ticking again")
    elif log_failure is not None:
        log.error("health says NOT_SERVING: %s", log_failure)
    else:
        log.error(
            "round timer: %d failures in a row; health says NOT_SERVING until a tick succeeds",
            tick_failures,
        )
