"""`atoll drain`: the syncer pod's preStop hook in Kubernetes.

A pod that a scale-down takes away (its ordinal at or past the StatefulSet's replicas)
hands its fragments to the shards that stay before it stops, by `atoll reshard`'s moves
(atoll/cluster/reshard.py); any other stop (a restart, an eviction, a node drain) keeps
them, since the pod comes back on the same volume.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc

from atoll.cluster.reshard import PROBE_SECONDS, NoPlanError, operator_token, reshard
from atoll.cluster.reshard import answers as shard_is_up
from atoll.commands import (
    Terminated,
    add_tls_arguments,
    check_tls_pairs,
    non_negative_int,
    raise_terminated,
)
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import ShardClient, TlsFiles

DRAIN_POLL_SECONDS = 1.0  # between a leaving shard's rounds (`atoll drain --poll`)
# A drain's calls give up after this: the last move started before its --timeout still
# ends inside the pod's grace period
DRAIN_CALL_SECONDS = 15.0
# The most a move can take: MOVE_CALLS calls (Describe of target and source, Freeze,
# Export, Adopt, Commit) and two health checks of its target (`move`)
MOVE_CALLS = 6
MOVE_SECONDS = MOVE_CALLS * DRAIN_CALL_SECONDS + 2 * PROBE_SECONDS


class DrainError(RuntimeError):
    """The drain could not finish; the message says what is left and how to finish it."""


TRANSIENT = (  # what a drain waits out: shards restarting, moves another planner began
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


class _Dialled:
    """Shard clients made on first use, by index; `answers(i)`: whether shard i is up."""

    def __init__(self, connect: Callable[[int], ShardClient]):
        self.connect = connect
        self.made: dict[int, ShardClient] = {}

    def client(self, i: int) -> ShardClient:
        if i not in self.made:
            self.made[i] = self.connect(i)
        return self.made[i]

    def answers(self, i: int) -> bool:
        if shard_is_up(self.client(i)):
            return True
        self.forget(i)  # down or restarting: the next use dials afresh
        return False

    def forget(self, i: int) -> None:
        """Closes shard i's client: the next use dials afresh (a channel that failed while
        its shard restarted may wait out a long reconnect backoff before trying again)."""
        if i in self.made:
            self.made.pop(i).close()

    def close(self) -> None:
        for c in self.made.values():
            c.close()


def _plan_drain(
    index: int,
    kept: int,
    client: Callable[[int], ShardClient],
    answers: Callable[[int], bool],
    say: Callable[[str], None],
    deadline: float,
    clock: Callable[[], float],
) -> dict[str, Any] | None:
    """The planner's part of a drain: every move off shards `kept` and past, made by
    `reshard` over every shard up to the last that answers; None if no shard has a plan."""
    known = index + 1
    while answers(known):
        known += 1
    say(f"shard {index} plans the moves off shards {kept} to {known - 1}")
    shards = [client(i) for i in range(known)]
    try:
        return reshard(shards, kept, say, until=deadline, clock=clock)
    except NoPlanError:
        return None  # no fragment anywhere yet


def _frozen(d: pb.DescribeResponse) -> str:
    """The fragments a shard's Describe shows frozen mid-move, for a drain that stops
    ("" if none: every fragment it holds takes pushes)."""
    return "".join(
        f"; fragment {f.fragment} is frozen mid-move to shard {f.moving_to}, which may hold "
        "it already: it takes no pushes until that shard answers and the move ends"
        for f in d.fragments
        if f.moving_version
    )


def drain(
    index: int,
    replicas: Callable[[], int],
    connect: Callable[[int], ShardClient],
    timeout: float,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    ordered: bool = False,
    shards: str = "HOST-{i}:PORT",
    poll: float | None = None,
) -> dict[str, Any]:
    """Shard `index` is stopping; `replicas()` says how many pods its StatefulSet keeps
    (asked again each round: a second scale-down may come), `connect(i)` makes shard i's
    client.

    A shard that stays (index < replicas) keeps its fragments: it restarts on its volume.
    Of the shards a scale-down takes away, one plans and makes every move (`reshard` to
    the replicas, balanced) so that no two planners race for a map version: with
    podManagementPolicy Parallel every leaving pod stops at once and the lowest leaving
    shard that answers plans; with OrderedReady (`ordered`) they stop one at a time,
    highest first, while the rest still run, so each plans in its turn. Every leaving
    shard, the planner too, returns only once it owns no fragment and moves none; until
    `timeout` it asks again after anything transient (a shard restarting, a move another
    planner began: the rerun finishes it), `poll` s apart (default DRAIN_POLL_SECONDS).

    A shard that stays but restarts meanwhile (a rolling update) is waited for: no
    fragment is frozen for it until it answers SERVING (`reshard`), and one whose target
    stopped serving before it was sent the state is thawed, so a drain that runs out of
    time leaves each fragment serving where it was. The DrainError then says what this
    shard still holds, which shards did not serve, and the `atoll reshard` (over the
    `shards` pattern) that finishes."""
    deadline = clock() + timeout
    dialled = _Dialled(connect)
    client, answers = dialled.client, dialled.answers
    moves: list[dict[str, Any]] = []
    planned: dict[str, Any] = {}  # the map the last plan left: map_version, owners
    left = "its fragments"  # what the last round found on this shard
    frozen = ""  # which of them are frozen mid-move
    waiting: set[int] = set()  # shards the last plan's moves waited for
    try:
        while True:
            kept = replicas()
            if index < kept:
                say(f"shard {index} stays ({kept} replicas): it keeps its fragments")
                return {"shard": index, "replicas": kept, "drained": False, "moves": moves}
            if kept < 1:
                raise DrainError(
                    "the StatefulSet scales to 0: no shard is left to take the fragments, "
                    "which stay on the shards' volumes (scale up again to serve them)"
                )
            try:
                if ordered or not any(answers(i) for i in range(kept, index)):
                    result = _plan_drain(index, kept, client, answers, say, deadline, clock)
                    if result is not None:
                        moves += result["moves"]
                        planned = {k: result[k] for k in ("map_version", "owners")}
                        waiting = _waited_for(result)
                        for s in waiting - {index}:
                            dialled.forget(s)
                own = client(index).describe(timeout=PROBE_SECONDS)
                held = sorted(f.fragment for f in own.fragments)
                if not held:
                    say(f"shard {index} owns no fragment any more")
                    drained = {"shard": index, "replicas": kept, "drained": True}
                    return {**drained, "moves": moves, **planned}
                left, frozen = f"fragments {held}", _frozen(own)
                say(f"shard {index} still holds {left}{frozen}")
            except grpc.RpcError as e:
                if e.code() not in TRANSIENT:
                    raise
                say(f"{e.code().name}: {e.details()}; asking again")
                left = f"its fragments ({e.code().name})"
            except (ValueError, RuntimeError) as e:  # a shard owning fragments is not up
                say(f"{e}; asking again")
            if clock() >= deadline:
                raise _left_behind(index, kept, left, frozen, waiting, timeout, shards)
            time.sleep(DRAIN_POLL_SECONDS if poll is None else poll)
    finally:
        dialled.close()


def _waited_for(result: dict[str, Any]) -> set[int]:
    """The shards the moves a plan skipped were waiting for (sources and targets)."""
    return {s for m in result.get("skipped", []) for s in (m["source"], m["target"])}


def _left_behind(
    index: int, kept: int, left: str, frozen: str, waiting: set[int], timeout: float, shards: str
) -> DrainError:
    """Why a drain out of time stops, what shard `index` still holds and how to finish."""
    others = sorted(waiting - {index})
    why = f" (shards {others} did not serve)" if others else ""
    return DrainError(
        f"shard {index} still holds {left} after {timeout:g} s{why}"
        f"{frozen or ', none frozen'}; they stay on its volume, served by no "
        f"shard once its pod stops. To finish: scale the StatefulSet back up to "
        f"{index + 1} or more (the pod returns with them), run atoll reshard --shards "
        f"'{shards}' --to {kept} (with the operator token) once shards 0 to "
        f"{kept - 1} answer, then scale down again"
    )


def statefulset_scale(namespace: str, name: str) -> tuple[int, bool] | None:
    """(spec.replicas, whether its pods stop one at a time) of StatefulSet `name` (None:
    it is gone, as when a run is deleted)."""
    from kubernetes import client
    from urllib3.exceptions import HTTPError

    from atoll.cluster.kube import KubeError, connect

    api = client.AppsV1Api(connect().api_client)
    try:
        # unparsed (_preload_content=False): a urllib3 response, whatever the client's types say
        answer: Any = api.read_namespaced_stateful_set(
            name, namespace, _request_timeout=(5.0, 15.0), _preload_content=False
        )
        sts: dict[str, Any] = json.loads(
            answer.data
        )  # only spec.replicas is read: no model to validate
    except client.exceptions.ApiException as e:
        if e.status == 404:
            return None
        hint = " (the syncer's Role must allow get on statefulsets)" if e.status == 403 else ""
        raise KubeError(
            f"reading StatefulSet {namespace}/{name}: {e.status} {e.reason}{hint}"
        ) from None
    except (OSError, HTTPError) as e:
        raise KubeError(
            f"reading StatefulSet {namespace}/{name}: cannot reach the Kubernetes API "
            f"({type(e).__name__})"
        ) from None
    except ValueError as e:
        raise KubeError(f"reading StatefulSet {namespace}/{name}: not JSON ({e})") from None
    spec = sts.get("spec") or {}
    replicas = spec.get("replicas")  # the API server always fills it in (default 1)
    if not isinstance(replicas, int) or replicas < 0:
        raise KubeError(f"StatefulSet {namespace}/{name} has spec.replicas {replicas!r}")
    return replicas, spec.get("podManagementPolicy", "OrderedReady") != "Parallel"


SERVICE_ACCOUNT_NAMESPACE = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def add_drain_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll drain`."""
    p.add_argument(
        "--shards",
        default=None,
        help="the shards' address pattern, 'HOST-{i}:PORT' "
        "(env ATOLL_DRAIN_SHARDS; default atoll-syncer-{i}.atoll-syncer:50051)",
    )
    p.add_argument(
        "--shard-index",
        type=non_negative_int,
        default=None,
        help="this shard (default: ATOLL_SHARD_INDEX, or the ordinal ending ATOLL_POD_NAME)",
    )
    p.add_argument(
        "--replicas",
        type=non_negative_int,
        default=None,
        help="the shards that stay (default: the StatefulSet's spec.replicas, read from the "
        "Kubernetes API)",
    )
    p.add_argument("--statefulset", default="atoll-syncer", help="the shards' StatefulSet")
    p.add_argument(
        "--namespace",
        default=None,
        help="its namespace (env ATOLL_NAMESPACE; default: the pod's own)",
    )
    p.add_argument(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="the shards' token file; its first token bound to no learner is used "
        "(env ATOLL_TOKEN_FILE)",
    )
    add_tls_arguments(p)
    for action in p._actions:  # the preStop hook gives no flags: each has its env default
        if action.dest in ENV_DRAIN_TLS:
            action.help = f"{action.help} (env {ENV_DRAIN_TLS[action.dest]})"
    p.add_argument(
        "--timeout",
        type=float,
        default=480.0,
        help="seconds a leaving shard waits for its fragments to move (keep under the pod's "
        "terminationGracePeriodSeconds)",
    )
    p.add_argument(
        "--poll",
        type=float,
        default=DRAIN_POLL_SECONDS,
        help="seconds between a leaving shard's rounds: planning, then asking whether it "
        "still holds a fragment (default %(default)g)",
    )


def drain_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll drain`: 0 when this shard stays or handed its fragments over, 1 when a shard
    refused, 2 when the drain could not finish or a flag is wrong."""
    from atoll.server.config import ConfigError, shard_index_from_env

    env = drain_defaults()
    spec = args.shards or env["shards"]
    if "{i}" not in spec or "," in spec or ":" not in spec:
        parser.error(f"--shards takes a pattern such as 'HOST-{{i}}:PORT', got {spec!r}")
    try:
        index = args.shard_index if args.shard_index is not None else shard_index_from_env()
    except ConfigError as e:
        parser.error(str(e))
    if index is None:
        parser.error("give --shard-index (or set ATOLL_SHARD_INDEX or ATOLL_POD_NAME)")
    for flag in ("tls_ca", "tls_cert", "tls_key"):  # the preStop hook gives no flags
        if getattr(args, flag) is None and env[flag]:
            setattr(args, flag, pathlib.Path(env[flag]))
    check_tls_pairs(args, parser)  # the files are read only if this shard leaves
    token_file = args.token_file or (pathlib.Path(env["token_file"]) if env["token_file"] else None)
    for flag in ("timeout", "poll"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag} must be above 0")
    tls = (args.tls_ca, args.tls_cert, args.tls_key)
    return drain_main(
        spec,
        index,
        args.replicas,
        args.statefulset,
        args.namespace or env["namespace"],
        token_file,
        tls,
        args.timeout,
        args.poll,
    )


def drain_main(
    spec: str,
    index: int,
    replicas: int | None,
    statefulset: str,
    namespace: str | None,
    token_file: pathlib.Path | None,
    tls_files: tuple[pathlib.Path | None, pathlib.Path | None, pathlib.Path | None],
    timeout: float,
    poll: float = DRAIN_POLL_SECONDS,
) -> int:
    """Drains shard `index` if a scale-down takes it away. `tls_files` is (CA, client
    certificate, key), each None or a path: read only once the shard is known to leave, so a
    restart never fails on a file it does not need."""
    from atoll.cluster.kube import KubeError
    from atoll.server.config import ConfigError

    def say(line: str) -> None:
        print(f"atoll drain: {line}", flush=True)

    stay = "N"  # the shards that stay, once known (for the way out of a stopped drain)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        ordered = False  # --replicas given: as shipped, Parallel
        if replicas is None:
            where = namespace or (
                SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
                if SERVICE_ACCOUNT_NAMESPACE.exists()
                else "atoll"
            )
            scale = statefulset_scale(where, statefulset)
            if scale is None:
                say(f"StatefulSet {where}/{statefulset} is gone: the run is being deleted")
                return 0
            first, ordered = scale

            def kept() -> int:
                now = statefulset_scale(where, statefulset)
                return first if now is None else now[0]

        else:
            first = replicas

            def kept() -> int:
                return first

        stay = str(first)
        if index < first:  # a restart, an eviction: nothing to hand over, no token needed
            say(f"shard {index} stays ({first} replicas): it keeps its fragments")
            return 0
        token = operator_token(token_file) if token_file else None
        for flag, path in zip(("--tls-ca", "--tls-cert", "--tls-key"), tls_files):
            if path is not None and not path.is_file():
                raise DrainError(f"{flag} {path}: no such file (in the Secret's mount)")
        tls_ca, tls_cert, tls_key = tls_files
        tls = TlsFiles(tls_ca, tls_cert, tls_key) if tls_ca else None

        def connect(i: int) -> ShardClient:
            address = spec.replace("{i}", str(i))
            return ShardClient(address, "", token=token, tls=tls, deadline=DRAIN_CALL_SECONDS)

        result = drain(index, kept, connect, timeout, say, ordered=ordered, shards=spec, poll=poll)
    except (DrainError, KubeError, ConfigError, OSError) as e:
        say(str(e))
        return 2
    except grpc.RpcError as e:
        say(f"{e.code().name}: {e.details()}")
        return 1
    except (Terminated, KeyboardInterrupt) as e:
        # a move cut short is finished by the next reshard (every step is durable)
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        say(
            f"stopped by {signal.Signals(signum).name}: what shard {index} still owns stays on "
            f"its volume; run atoll reshard --to {stay} while it is up"
        )
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result), flush=True)
    return 0


ENV_DRAIN_SHARDS = "ATOLL_DRAIN_SHARDS"
ENV_NAMESPACE = "ATOLL_NAMESPACE"
# the drain's TLS files (--tls-ca, --tls-cert, --tls-key) when the hook gives no flags:
# the CA of the shards' certificates, and a client certificate and key for shards that
# require mutual TLS (--tls-client-ca)
ENV_DRAIN_TLS = {
    "tls_ca": "ATOLL_DRAIN_TLS_CA",
    "tls_cert": "ATOLL_DRAIN_TLS_CERT",
    "tls_key": "ATOLL_DRAIN_TLS_KEY",
}
DEFAULT_DRAIN_SHARDS = "atoll-syncer-{i}.atoll-syncer:50051"


def drain_defaults() -> dict[str, Any]:
    """The drain's settings from the syncer pod's environment."""
    return {
        "shards": os.environ.get(ENV_DRAIN_SHARDS, DEFAULT_DRAIN_SHARDS),
        "namespace": os.environ.get(ENV_NAMESPACE),
        "token_file": os.environ.get("ATOLL_TOKEN_FILE"),
        **{key: os.environ.get(name) or None for key, name in ENV_DRAIN_TLS.items()},
    }
