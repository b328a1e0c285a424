"""`atoll chaos --kubernetes`: delete learner pods at random and report the goodput the run kept.

It deletes learner pods as a Poisson process, mean time between failures `mtbf` seconds per
pod (so the total rate grows with the pods), and leaves their restart to the cluster's
controllers. It acts only where `atoll.cluster.kube` lets it: a namespace labelled
`atoll.dev/enabled: "true"` and pods labelled `app.kubernetes.io/name: atoll`. Goodput over
the window, from every shard's /metrics at its start and end:

    goodput = Δ Σ_shards atoll_accepted_compute_seconds_total / (learner pods × window)

with the learner pods of every cluster named, so that the shards' accepted compute (which
every learner feeds) is divided by every learner that provides it. It reads only the
Kubernetes API and the shards' /metrics port (plain HTTP, beside TLS on the gRPC port), so
unlike status it takes no --tls-* flags.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import random
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO, TypedDict

from atoll.cluster.kube import (
    ADDRESS_TEMPLATE,
    LEARNERS,
    SYNCERS,
    Api,
    KubeError,
    add_cluster_arguments,
    check_address_template,
    check_namespace,
    command_error,
    connect,
    delete_pod,
    flag_adder,
    learner_clusters,
    list_pods,
    pod_address,
)

SCRAPE_TIMEOUT = 5.0  # seconds per /metrics scrape
RELIST_SECONDS = 10.0  # chaos re-counts the learner pods at least this often


def next_failure_in(rng: random.Random, pods: int, mtbf: float) -> float:
    """Seconds to the next failure among `pods` pods that each fail every `mtbf` s on average."""
    return rng.expovariate(pods / mtbf) if pods else math.inf


class Scrape(TypedDict):
    """What chaos reads of one shard's /metrics."""

    compute_seconds: float  # accepted compute, a counter
    rounds: float  # rounds closed, a counter
    versions: dict[int, int]  # fragment -> version


def scrape(address: str, timeout: float = SCRAPE_TIMEOUT) -> Scrape:
    """The counters and gauges chaos reports, from one shard's /metrics."""
    from atoll.wire.metrics import read_metrics

    out: Scrape = {"compute_seconds": 0.0, "rounds": 0.0, "versions": {}}
    for s in read_metrics(address, timeout):
        if s.name == "atoll_accepted_compute_seconds_total":
            out["compute_seconds"] += s.value
        elif s.name == "atoll_rounds_total":
            out["rounds"] += s.value
        elif s.name == "atoll_fragment_version":
            out["versions"][int(s.labels["fragment"])] = int(s.value)
    return out


def _scrape_all(addresses: dict[str, str | None]) -> dict[str, Scrape | None]:
    def one(address: str | None) -> Scrape | None:
        try:
            return scrape(address) if address else None
        except (OSError, ValueError):
            return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(addresses)))) as pool:
        return dict(zip(addresses, pool.map(one, addresses.values())))


def _increase(start: float, end: float) -> float:
    """A counter's increase; a shard restarted in between counts from zero again."""
    return end - start if end >= start else end


def chaos(
    namespace: str,
    mtbf_seconds: float,
    duration_seconds: float,
    seed: int = 0,
    *,
    api: Api | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
    learner_contexts: tuple[str, ...] = (),
    learner_kubeconfig: str | None = None,
    dry_run: bool = False,
    address_template: str = ADDRESS_TEMPLATE,
    out: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Deletes learner pods at random for `duration_seconds` and reports what the run kept.

    Args:
      mtbf_seconds: mean seconds between failures of each learner pod (> 0).
      duration_seconds: how long to inject failures (> 0).
      seed: the schedule's random seed.
      learner_contexts: kubeconfig contexts of learner clusters (in `learner_kubeconfig`, else
        `kubeconfig`) whose learner pods count and may be deleted too; a pod there is named
        "context/pod".
      dry_run: print and return the planned deletions (with today's pods) and delete nothing.

    Returns:
      {"namespace", "learner_pods", "failures_injected", "deleted": [pod names], "window_seconds",
      "accepted_compute_seconds", "goodput", "rounds_closed", "version_advance": {fragment: n},
      "unscraped_shards", "interrupted" (Ctrl-C ended the window early)}; with dry_run,
      {"namespace", "learner_pods", "duration_seconds", "dry_run", "would_delete": [{"at_seconds",
      "pod"}]}. Example: `chaos("atoll", 600, 1800, seed=1)["goodput"]`.
    """
    if not (math.isfinite(mtbf_seconds) and mtbf_seconds > 0):
        raise KubeError(f"--mtbf must be a positive number of seconds, got {mtbf_seconds}")
    if not (math.isfinite(duration_seconds) and duration_seconds > 0):
        raise KubeError(f"--duration must be a positive number of seconds, got {duration_seconds}")
    out = out or sys.stderr
    api = api or connect(kubeconfig, context)
    check_namespace(api, namespace)  # before anything else is read or touched
    clusters = learner_clusters(api, learner_contexts, learner_kubeconfig or kubeconfig)
    for _, other in clusters[1:]:
        check_namespace(other, namespace)
    rng = random.Random(seed)
    learners = list(_alive(clusters, namespace))
    if dry_run:
        return _dry_run(namespace, rng, learners, mtbf_seconds, duration_seconds, out)
    if not learners:
        where = "" if not learner_contexts else f" (nor in contexts {', '.join(learner_contexts)})"
        raise KubeError(
            f"no learner pods ({','.join(f'{k}={v}' for k, v in LEARNERS.items())}) "
            f"in namespace {namespace!r}{where}; learners in other clusters: --learner-context"
        )
    shards = _metrics_addresses(api, namespace, address_template, out)
    before, start = _scrape_all(shards), clock()
    deleted, interrupted = _inject(
        clusters, namespace, rng, mtbf_seconds, start + duration_seconds, out, clock, sleep
    )
    after, window = _scrape_all(shards), clock() - start
    return {
        "namespace": namespace,
        "learner_pods": len(learners),
        "failures_injected": len(deleted),
        "deleted": deleted,
        "window_seconds": window,
        **_kept(before, after, len(learners) * window),
        "interrupted": interrupted,
    }


def _dry_run(
    namespace: str,
    rng: random.Random,
    learners: list[str],
    mtbf: float,
    duration: float,
    out: TextIO | None,
) -> dict[str, Any]:
    """The deletions a run of `duration` seconds would draw among today's `learners`, printed."""
    plan: list[dict[str, Any]] = []
    t = next_failure_in(rng, len(learners), mtbf)
    while t < duration:
        plan.append({"at_seconds": round(t, 3), "pod": rng.choice(learners)})
        print(f"would delete pod {plan[-1]['pod']} at {t:.2f} s", file=out, flush=True)
        t += next_failure_in(rng, len(learners), mtbf)
    return {
        "namespace": namespace,
        "learner_pods": len(learners),
        "duration_seconds": duration,
        "dry_run": True,
        "would_delete": plan,
    }


def _metrics_addresses(
    api: Api, namespace: str, template: str, out: TextIO | None
) -> dict[str, str | None]:
    """{syncer pod: its /metrics HOST:PORT or None}; says so when this cluster holds none."""
    shards = {
        p.metadata.name: pod_address(p, "metrics", template)
        for p in list_pods(api, namespace, SYNCERS)
    }
    if not shards:
        print(
            f"no syncer pods in namespace {namespace!r} of this cluster, so no goodput: run from the "
            "syncer's cluster (--context) and name the learners' with --learner-context",
            file=out,
            flush=True,
        )
    return shards


def _inject(
    clusters: list[tuple[str | None, Api]],
    namespace: str,
    rng: random.Random,
    mtbf: float,
    end: float,
    out: TextIO | None,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> tuple[list[str], bool]:
    """Deletes learner pods until `end` on `clock`: (the pods deleted, whether Ctrl-C cut it short)."""
    start, deleted = clock(), list[str]()
    try:
        while (now := clock()) < end:
            wait = next_failure_in(rng, len(_alive(clusters, namespace)), mtbf)
            if wait > min(RELIST_SECONDS, end - now):
                # memoryless: drawing again after a re-count is fair
                sleep(min(RELIST_SECONDS, end - now))
                continue
            sleep(wait)
            alive = _alive(clusters, namespace)
            if alive and delete_pod(*alive[victim := rng.choice(list(alive))], namespace):
                deleted.append(victim)
                print(f"{clock() - start:7.1f} s  deleted pod {victim}", file=out, flush=True)
    except KeyboardInterrupt:  # Ctrl-C ends the window early; the report still comes
        return deleted, True
    return deleted, False


def _kept(
    before: dict[str, Scrape | None], after: dict[str, Scrape | None], learner_seconds: float
) -> dict[str, Any]:
    """What the shards scraped at both ends of the window kept: accepted compute, goodput (None
    unless every shard was scraped twice), rounds, version advance and the shards unscraped."""
    pairs = {s: (b, a) for s, b in before.items() if b is not None and (a := after[s]) is not None}
    scraped = list(pairs)
    compute = sum(_increase(b["compute_seconds"], a["compute_seconds"]) for b, a in pairs.values())
    advance: dict[int, int] = {}
    for b, a in pairs.values():
        for p, v in a["versions"].items():
            advance[p] = v - b["versions"].get(p, 0)
    whole = bool(before) and len(scraped) == len(before)
    return {
        "accepted_compute_seconds": compute,
        "goodput": compute / learner_seconds if whole else None,
        "rounds_closed": int(sum(_increase(b["rounds"], a["rounds"]) for b, a in pairs.values())),
        "version_advance": dict(sorted(advance.items())),
        "unscraped_shards": sorted(set(before) - set(scraped)),
    }


def _alive(
    clusters: list[tuple[str | None, object]], namespace: str
) -> dict[str, tuple[object, str]]:
    """Learner pods not already terminating, in cluster order then by name: {shown name: (API, pod)},
    the shown name being "pod" in the syncer's cluster and "context/pod" in a learner cluster."""
    alive = {}
    for c, cluster in clusters:
        for p in list_pods(cluster, namespace, LEARNERS):
            if not p.metadata.deletion_timestamp:
                alive[p.metadata.name if c is None else f"{c}/{p.metadata.name}"] = (
                    cluster,
                    p.metadata.name,
                )
    return alive


def render_chaos(r: dict[str, Any]) -> str:
    if r.get("dry_run"):
        return (
            f"dry run in {r['namespace']}: {len(r['would_delete'])} deletions planned over "
            f"{r['duration_seconds']:g} s among {r['learner_pods']} learner pods; nothing was deleted"
        )
    goodput = (
        f"{100 * r['goodput']:.1f} %"
        if r["goodput"] is not None
        else "n/a (no syncer pods here: give the syncer's --context and the learners' --learner-context)"
        if not r["unscraped_shards"]
        else f"n/a (no /metrics from {', '.join(r['unscraped_shards'])})"
    )
    advance = "  ".join(f"{p}:+{n}" for p, n in r["version_advance"].items()) or "-"
    return "\n".join(
        [
            f"atoll chaos --kubernetes in {r['namespace']}: {r['failures_injected']} learner pods deleted "
            f"over {r['window_seconds']:.0f} s ({r['learner_pods']} provisioned)",
            f"  goodput {goodput}  ({r['accepted_compute_seconds']:.1f} accepted learner-seconds)",
            f"  rounds closed {r['rounds_closed']}  version advance per fragment {advance}",
        ]
    )


# --- CLI glue ---


def add_chaos_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll chaos --kubernetes`. `--mtbf`, `--duration`, `--seed` and `--json` mean the
    same in the local mode; whichever mode adds a shared flag first owns it (default None)."""
    have = {o for action in p._actions for o in action.option_strings}
    add = flag_adder(p.add_argument_group("--kubernetes (delete learner pods in a cluster)"), have)
    add_cluster_arguments(add)
    add("--dry-run", action="store_true", help="print the pods it would delete, delete none")
    add = flag_adder(p, have)
    add(
        "--mtbf",
        type=float,
        default=None,
        metavar="SECONDS",
        help="mean seconds between failures of each learner (pod); required with --kubernetes",
    )
    add(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds to inject failures for; required with --kubernetes",
    )
    add("--seed", type=int, default=None, help="failure schedule seed (default 0)")
    add("--json", action="store_true", help="print one JSON object on stdout")


def chaos_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll chaos --kubernetes`: 0 when done, 130 when Ctrl-C cut it short (still reported), 2 on a
    user error."""
    if args.mtbf is None or args.duration is None:
        parser.error("--kubernetes deletes pods: give --mtbf SECONDS and --duration SECONDS")
    for flag, value in (("--mtbf", args.mtbf), ("--duration", args.duration)):
        if not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} must be a positive number of seconds, got {value}")
    check_address_template(args.address_template, parser)
    try:
        result = chaos(
            args.namespace,
            args.mtbf,
            args.duration,
            args.seed or 0,
            kubeconfig=args.kubeconfig,
            context=args.context,
            learner_contexts=tuple(args.learner_context),
            learner_kubeconfig=args.learner_kubeconfig,
            dry_run=args.dry_run,
            address_template=args.address_template,
            out=sys.stderr if args.json else sys.stdout,
        )
    except KubeError as e:
        return command_error("chaos", e)
    print(json.dumps(result, indent=2) if args.json else render_chaos(result))
    return 130 if result.get("interrupted") else 0
