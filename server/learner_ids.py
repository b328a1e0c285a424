"""What a learner id may be, wherever a shard takes one: every RPC that names a learner
(Init, Push, Pull, Watch; empty on Pull and Watch for an anonymous reader) and every
state it adopts (an Adopt's answers and contributors).

An id is 1 to MAX_CHARS characters of A-Z a-z 0-9 . _ : - (a Kubernetes pod name, a
hostname with a suffix): plain enough to go as it is into log lines, metric labels,
JSON and file names. Anything else is refused with INVALID_ARGUMENT, saying this rule.
"""

from __future__ import annotations

import re

MAX_CHARS = 128
CHARACTERS = "A-Z a-z 0-9 . _ : -"
LEARNER_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CHARS}}}")


def learner_id_problem(learner_id: object) -> str | None:
    """Why `learner_id` is no learner id (a readable line), or None.

    Example:
      >>> learner_id_problem("us-west1-tpu-3"), learner_id_problem("a b")
      (None, "learner_id 'a b' (3 characters) must be 1-128 of A-Z a-z 0-9 . _ : -")
    """
    if isinstance(learner_id, str) and LEARNER_ID.fullmatch(learner_id) is not None:
        return None
    if not isinstance(learner_id, str):
        return f"learner_id {learner_id!r} is not a string"
    shown = learner_id if len(learner_id) <= 40 else learner_id[:40] + "…"
    return (
        f"learner_id {shown!r} ({len(learner_id)} characters) must be 1-{MAX_CHARS} of {CHARACTERS}"
    )
