"""`atoll status` and `atoll chaos --kubernetes`: read and disturb a run in its clusters.

Both act only on a namespace labelled `atoll.dev/enabled: "true"` and only on pods
labelled `app.kubernetes.io/name: atoll`, whatever a label selector returns (the label
check is repeated on every pod before it is shown or deleted).

A run is one syncer cluster (`--context`, or the pod's own cluster inside a pod) and any
number of learner clusters (`--learner-context`, each a kubeconfig context): the shards
are found in the first, learner pods in all of them.

* status: syncer pods (StatefulSet `atoll-syncer`, shard index = ordinal) and learner
  pods with phase, readiness, restarts, node and region; each ready shard is asked
  for its fragments' versions and open rounds by gRPC Describe, at the pod IP and its
  `grpc` port unless `--address-template` says how to reach it (the in-cluster Job:
  `{pod}.atoll-syncer:{port}`, the headless Service's per-pod name, which the shards'
  TLS certificate holds where it holds no pod IP).
* chaos: deletes learner pods as a Poisson process, mean time between failures
  `mtbf` seconds per pod (so the total rate grows with the pods), and leaves their
  restart to the cluster's controllers. Goodput over the window, from every shard's
  /metrics at its start and end:

      goodput = Δ Σ_shards atoll_accepted_compute_seconds_total / (learner pods × window)

  with the learner pods of every cluster named, so that the shards' accepted compute
  (which every learner feeds) is divided by every learner that provides it. It reads
  only the Kubernetes API and the shards' /metrics port (plain HTTP, beside TLS on the
  gRPC port), so unlike status it takes no --tls-* flags.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ipaddress
import json
import math
import os
import pathlib
import random
import re
import sys
import time

from atoll.commands import add_tls_arguments, shard_addresses, tls_from_args

NAME, PART_OF, COMPONENT = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/component",
)
ENABLED, REGION = "atoll.dev/enabled", "atoll.dev/region"
SYNCERS = {COMPONENT: "syncer", NAME: "atoll"}
LEARNERS = {COMPONENT: "learner", NAME: "atoll"}
ADDRESS_TEMPLATE = "{ip}:{port}"  # fields: pod, ip, port, namespace, index (shard ordinal)
CONNECT_TIMEOUT = 5.0  # seconds to connect to the Kubernetes API
API_TIMEOUT = 15.0  # seconds to read one answer of the Kubernetes API
DESCRIBE_DEADLINE = 5.0  # seconds per Describe; a shard slower than this is reported unreachable
SCRAPE_TIMEOUT = 5.0  # seconds per /metrics scrape
RELIST_SECONDS = 10.0  # chaos re-counts the learner pods at least this often
# Deleted pods get this grace before SIGKILL: short enough to be a crash, yet the API still
# waits for the kubelet, so a replacement never runs beside the pod it replaces.
DELETE_GRACE_SECONDS = 1


class KubeError(Exception):
    """A problem the user can fix (config, reachability, RBAC, labels); the message says how."""


class NoKubeConfig(KubeError):
    """No kubeconfig and no service account: there is no cluster to ask."""


# --- the API ---


def connect(kubeconfig: str | None = None, context: str | None = None):
    """A CoreV1Api: in-cluster config inside a pod (unless a kubeconfig or context is given),
    else the kubeconfig (`kubeconfig`, then $KUBECONFIG, then ~/.kube/config)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    configuration.retries = (
        1  # urllib3's default of 3 makes an unreachable API four connect timeouts
    )
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(client_configuration=configuration)
            return client.CoreV1Api(client.ApiClient(configuration))
        except config.ConfigException:
            pass  # a pod without a service account token: a kubeconfig may still work
    path = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        config.load_kube_config(
            config_file=path,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )
    except (config.ConfigException, OSError, ValueError) as e:
        where = (
            f"--kubeconfig {kubeconfig}"
            if kubeconfig
            else (f"KUBECONFIG={path}" if os.environ.get("KUBECONFIG") else path)
        )
        raise NoKubeConfig(
            f"no usable Kubernetes config ({where}: {e}); give --kubeconfig and --context, "
            "set KUBECONFIG, or run inside a pod with a service account"
        ) from None
    return client.CoreV1Api(client.ApiClient(configuration))


def _call(api, what: str, method: str, *args, absent_ok: bool = False, **kwargs):
    """One API call with timeouts; failures become a KubeError that says what to do.
    With `absent_ok`, a 404 returns None."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return getattr(api, method)(
            *args, _request_timeout=(CONNECT_TIMEOUT, API_TIMEOUT), **kwargs
        )
    except ApiException as e:
        if e.status == 404 and absent_ok:
            return None
        if e.status in (401, 403):
            raise KubeError(
                f"{what}: forbidden ({e.status} {e.reason}); the account needs a Role of "
                "k8s/components/operator: atoll-operator for status (get the namespace; get "
                "and list pods), atoll-chaos for chaos (and delete pods)"
            ) from None
        raise KubeError(f"{what}: the API answered {e.status} {e.reason}") from None
    except (HTTPError, OSError) as e:
        host = api.api_client.configuration.host
        raise KubeError(
            f"{what}: cannot reach the Kubernetes API at {host} ({type(e).__name__}); "
            "check --kubeconfig/--context and that the cluster is up"
        ) from None


def check_namespace(api, namespace: str) -> None:
    """Refuses any namespace not labelled atoll.dev/enabled=true (or that does not exist)."""
    ns = _call(api, f"reading namespace {namespace!r}", "read_namespace", namespace, absent_ok=True)
    if ns is None:
        raise KubeError(f"namespace {namespace!r} does not exist (check --namespace and --context)")
    if (ns.metadata.labels or {}).get(ENABLED) != "true":
        raise KubeError(
            f"namespace {namespace!r} is not labelled {ENABLED}=true; atoll acts only on "
            f"namespaces marked for it (kubectl label namespace {namespace} {ENABLED}=true)"
        )


def learner_clusters(
    api, learner_contexts, kubeconfig: str | None
) -> list[tuple[str | None, object]]:
    """(context, API) of every cluster that may hold learner pods: the syncer's (context None)
    first, then each of `learner_contexts`, read from `kubeconfig`."""
    return [(None, api)] + [(c, connect(kubeconfig, c)) for c in learner_contexts or ()]


def list_pods(api, namespace: str, labels: dict[str, str]) -> list:
    """Pods carrying every label in `labels`, sorted by name; checked here as well as by the API."""
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    pods = _call(
        api,
        f"listing pods in {namespace!r}",
        "list_namespaced_pod",
        namespace,
        label_selector=selector,
    ).items
    return sorted(
        (p for p in pods if labels.items() <= (p.metadata.labels or {}).items()),
        key=lambda p: p.metadata.name,
    )


def pod_row(pod) -> dict:
    """What status shows of one pod."""
    status = pod.status
    ready = any(
        c.type == "Ready" and c.status == "True" for c in (status and status.conditions) or ()
    )
    return {
        "pod": pod.metadata.name,
        "phase": (status and status.phase) or "Unknown",
        "ready": ready,
        "restarts": sum(c.restart_count or 0 for c in (status and status.container_statuses) or ()),
        "node": pod.spec.node_name if pod.spec else None,
        "region": (pod.metadata.labels or {}).get(REGION),
    }


def shard_index(pod) -> int | None:
    m = re.search(r"-(\d+)$", pod.metadata.name)
    return int(m.group(1)) if m else None


def pod_address(pod, port_name: str, template: str = ADDRESS_TEMPLATE) -> str | None:
    """HOST:PORT of the pod's container port called `port_name`, through `template`."""
    ports = [
        p.container_port for c in pod.spec.containers for p in c.ports or () if p.name == port_name
    ]
    ip = pod.status.pod_ip if pod.status else None
    if not ports or (not ip and "{ip}" in template):
        return None
    return template.format(
        pod=pod.metadata.name,
        ip=ip,
        port=ports[0],
        namespace=pod.metadata.namespace,
        index=shard_index(pod),
    )


# --- status ---


def describe_shard(
    address: str, deadline: float = DESCRIBE_DEADLINE, token: str | None = None, tls=None
) -> dict:
    """{"describe": ...} from one shard's Describe, or {"error": ...} when it does not answer
    (`tls`: a wire.client.TlsFiles, or None for plaintext)."""
    import grpc

    from atoll.wire.client import ShardClient

    shard = ShardClient(address, "", token=token, tls=tls, deadline=deadline)
    try:
        d = shard.describe()
    except grpc.RpcError as e:
        return {"error": f"unreachable ({e.code().name}: {e.details()})"}
    finally:
        shard.close()
    return {
        "describe": {
            "shard_index": d.shard_index,
            "num_shards": d.num_shards,
            "plan_fingerprint": d.plan_fingerprint,
            "fragments": [
                {
                    "fragment": f.fragment,
                    "initialized": f.initialized,
                    "version": f.version,
                    "round_size": f.round_size,
                    # a move in progress (docs/resharding.md): to that shard, under that map version
                    "moving_to": f.moving_to if f.moving_version else None,
                    "moving_version": f.moving_version or None,
                }
                for f in d.fragments
            ],
            "live_learners": sorted(d.live_learners),
            "map_version": d.map_version,
            "owners": list(d.owners),
        }
    }


def _tls_hint(address: str, tls) -> str:
    """Why a shard dialled by IP over TLS may not answer: its certificate names hosts."""
    if tls is None:
        return ""
    try:
        ipaddress.ip_address(address.rpartition(":")[0].strip("[]"))
    except ValueError:
        return ""  # a name: the certificate may well hold it
    return (
        "; dialled by IP over TLS: if the shards' certificate holds no IP address, dial a "
        "name it holds (in a cluster, --address-template '{pod}.atoll-syncer:{port}')"
    )


def _describe_all(shards: list[dict], deadline: float, token: str | None, tls=None) -> list[dict]:
    """Fills in each shard row's Describe (in parallel, so one dead shard costs one deadline)."""
    asked = [s for s in shards if s["address"] and s["ready"] is not False]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(asked)))) as pool:
        answers = pool.map(lambda s: describe_shard(s["address"], deadline, token, tls), asked)
        for shard, answer in zip(asked, answers):
            if "error" in answer:
                answer["error"] += _tls_hint(shard["address"], tls)
            shard.update(answer)
    for s in shards:
        if "describe" not in s and "error" not in s:
            s["error"] = (
                "not asked: no pod IP or no 'grpc' port"
                if not s["address"]
                else "not asked: pod not ready"
            )
    return shards


def status(
    namespace: str,
    *,
    api=None,
    kubeconfig: str | None = None,
    context: str | None = None,
    learner_contexts: tuple[str, ...] = (),
    learner_kubeconfig: str | None = None,
    address_template: str = ADDRESS_TEMPLATE,
    deadline: float = DESCRIBE_DEADLINE,
    token: str | None = None,
    tls=None,
) -> dict:
    """Shards and learners of the run in `namespace`, with every ready shard's Describe.

    Args:
      learner_contexts: kubeconfig contexts of learner clusters (in `learner_kubeconfig`, else
        `kubeconfig`), listed besides the syncer's own cluster.

    Returns:
      {"namespace", "shards": [{"index", "pod", "phase", "ready", "restarts", "node", "address",
      "describe" (shard_index, num_shards, fragments [{fragment, version, round_size, ...}],
      live_learners) or "error"}], "learners": [{"pod", "context" (None: the syncer's cluster),
      "region", "phase", "ready", "restarts", "node"}]}.
      Example: `status("atoll")["shards"][0]["describe"]["fragments"][0]["version"]`.
    """
    api = api or connect(kubeconfig, context)
    check_namespace(api, namespace)
    clusters = learner_clusters(api, learner_contexts, learner_kubeconfig or kubeconfig)
    for _, other in clusters[1:]:
        check_namespace(other, namespace)
    shards = [
        {"index": shard_index(p), **pod_row(p), "address": pod_address(p, "grpc", address_template)}
        for p in list_pods(api, namespace, SYNCERS)
    ]
    for s in shards:
        s.pop("region")
    learners = [
        {"context": c, **pod_row(p)}
        for c, cluster in clusters
        for p in list_pods(cluster, namespace, LEARNERS)
    ]
    return {
        "namespace": namespace,
        "shards": _describe_all(shards, deadline, token, tls),
        "learners": learners,
    }


def status_of_addresses(
    addresses: list[str], deadline: float = DESCRIBE_DEADLINE, token: str | None = None, tls=None
) -> dict:
    """The same report for shards given as HOST:PORT, without Kubernetes (no pods, no learners)."""
    shards = [
        {
            "index": i,
            "pod": None,
            "phase": None,
            "ready": None,
            "restarts": None,
            "node": None,
            "address": a,
        }
        for i, a in enumerate(addresses)
    ]
    return {
        "namespace": None,
        "shards": _describe_all(shards, deadline, token, tls),
        "learners": None,
    }


def render_status(report: dict) -> str:
    """The report as aligned text tables."""

    def table(header: list[str], rows: list[list]) -> list[str]:
        cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]

    def yes(v):
        return None if v is None else ("yes" if v else "no")

    rows = []
    for s in report["shards"]:
        d = s.get("describe")
        index = d["shard_index"] if d else s["index"]
        versions = (
            "  ".join(
                (
                    f"{f['fragment']}:v{f['version']}/{f['round_size']}"
                    if f["initialized"]
                    else f"{f['fragment']}:-"
                )
                + (f"->{f['moving_to']}" if f.get("moving_version") else "")
                for f in d["fragments"]
            )
            or "(no plan yet)"
            if d
            else s["error"]
        )
        rows.append(
            [
                index,
                s["pod"],
                s["phase"],
                yes(s["ready"]),
                s["restarts"],
                s["node"],
                s["address"],
                len(d["live_learners"]) if d else None,
                d.get("map_version") if d else None,
                versions,
            ]
        )
    where = (
        f"namespace {report['namespace']}" if report["namespace"] else "shards given by --shards"
    )
    lines = [where, ""] + table(
        [
            "SHARD",
            "POD",
            "PHASE",
            "READY",
            "RESTARTS",
            "NODE",
            "ADDRESS",
            "LIVE",
            "MAP",
            "FRAGMENT:VERSION/OPEN ROUND (->SHARD: MOVING THERE)",
        ],
        rows,
    )
    moving = [
        f"fragment {f['fragment']}: shard {s['describe']['shard_index']} -> {f['moving_to']} "
        f"(map version {f['moving_version']})"
        for s in report["shards"]
        if s.get("describe")
        for f in s["describe"]["fragments"]
        if f.get("moving_version")
    ]
    if moving:
        lines += ["", "moves in progress (finish them with atoll reshard):"] + moving
    if report["learners"] == []:
        lines += ["", "no learner pods"]
    elif report["learners"] is not None:
        lines += [""] + table(
            ["LEARNER", "CONTEXT", "REGION", "PHASE", "READY", "RESTARTS", "NODE"],
            [
                [
                    r["pod"],
                    r.get("context"),
                    r["region"],
                    r["phase"],
                    yes(r["ready"]),
                    r["restarts"],
                    r["node"],
                ]
                for r in report["learners"]
            ],
        )
        ready = sum(r["ready"] for r in report["learners"])
        lines.append(f"{ready}/{len(report['learners'])} learner pods ready")
    return "\n".join(lines)


# --- chaos ---


def next_failure_in(rng: random.Random, pods: int, mtbf: float) -> float:
    """Seconds to the next failure among `pods` pods that each fail every `mtbf` s on average."""
    return rng.expovariate(pods / mtbf) if pods else math.inf


def scrape(address: str, timeout: float = SCRAPE_TIMEOUT) -> dict:
    """The counters and gauges chaos reports, from one shard's /metrics."""
    from atoll.wire.metrics import read_metrics

    out = {"compute_seconds": 0.0, "rounds": 0.0, "versions": {}}
    for s in read_metrics(address, timeout):
        if s.name == "atoll_accepted_compute_seconds_total":
            out["compute_seconds"] += s.value
        elif s.name == "atoll_rounds_total":
            out["rounds"] += s.value
        elif s.name == "atoll_fragment_version":
            out["versions"][int(s.labels["fragment"])] = int(s.value)
    return out


def _scrape_all(addresses: dict[str, str | None]) -> dict[str, dict | None]:
    def one(address):
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
    api=None,
    kubeconfig: str | None = None,
    context: str | None = None,
    learner_contexts: tuple[str, ...] = (),
    learner_kubeconfig: str | None = None,
    dry_run: bool = False,
    address_template: str = ADDRESS_TEMPLATE,
    out=None,
    clock=time.monotonic,
    sleep=time.sleep,
) -> dict:
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
        plan, t = [], next_failure_in(rng, len(learners), mtbf_seconds)
        while t < duration_seconds:
            plan.append({"at_seconds": round(t, 3), "pod": rng.choice(learners)})
            print(f"would delete pod {plan[-1]['pod']} at {t:.2f} s", file=out, flush=True)
            t += next_failure_in(rng, len(learners), mtbf_seconds)
        return {
            "namespace": namespace,
            "learner_pods": len(learners),
            "duration_seconds": duration_seconds,
            "dry_run": True,
            "would_delete": plan,
        }
    if not learners:
        where = "" if not learner_contexts else f" (nor in contexts {', '.join(learner_contexts)})"
        raise KubeError(
            f"no learner pods ({','.join(f'{k}={v}' for k, v in LEARNERS.items())}) "
            f"in namespace {namespace!r}{where}; learners in other clusters: --learner-context"
        )
    shards = {
        p.metadata.name: pod_address(p, "metrics", address_template)
        for p in list_pods(api, namespace, SYNCERS)
    }
    if not shards:
        print(
            f"no syncer pods in namespace {namespace!r} of this cluster, so no goodput: run from the "
            "syncer's cluster (--context) and name the learners' with --learner-context",
            file=out,
            flush=True,
        )
    before, start = _scrape_all(shards), clock()
    deleted, end, interrupted = [], start + duration_seconds, False
    try:
        while (now := clock()) < end:
            wait = next_failure_in(rng, len(_alive(clusters, namespace)), mtbf_seconds)
            if wait > min(RELIST_SECONDS, end - now):
                sleep(
                    min(RELIST_SECONDS, end - now)
                )  # memoryless: drawing again after a re-count is fair
                continue
            sleep(wait)
            alive = _alive(clusters, namespace)
            if alive and _delete(*alive[victim := rng.choice(list(alive))], namespace):
                deleted.append(victim)
                print(f"{clock() - start:7.1f} s  deleted pod {victim}", file=out, flush=True)
    except KeyboardInterrupt:  # Ctrl-C ends the window early; the report still comes
        interrupted = True
    after, window = _scrape_all(shards), clock() - start
    scraped = [s for s in shards if before[s] is not None and after[s] is not None]
    compute = sum(
        _increase(before[s]["compute_seconds"], after[s]["compute_seconds"]) for s in scraped
    )
    advance: dict[int, int] = {}
    for s in scraped:
        for p, v in after[s]["versions"].items():
            advance[p] = v - before[s]["versions"].get(p, 0)
    whole = bool(shards) and len(scraped) == len(shards)
    return {
        "namespace": namespace,
        "learner_pods": len(learners),
        "failures_injected": len(deleted),
        "deleted": deleted,
        "window_seconds": window,
        "accepted_compute_seconds": compute,
        "goodput": compute / (len(learners) * window) if whole else None,
        "rounds_closed": int(
            sum(_increase(before[s]["rounds"], after[s]["rounds"]) for s in scraped)
        ),
        "version_advance": dict(sorted(advance.items())),
        "unscraped_shards": sorted(set(shards) - set(scraped)),
        "interrupted": interrupted,
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


def _delete(api, name: str, namespace: str) -> bool:
    """Deletes one learner pod; False when it was gone already."""
    return (
        _call(
            api,
            f"deleting pod {name}",
            "delete_namespaced_pod",
            name,
            namespace,
            absent_ok=True,
            grace_period_seconds=DELETE_GRACE_SECONDS,
        )
        is not None
    )


def render_chaos(r: dict) -> str:
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


def _adder(p, have: set[str]):
    """add_argument that leaves a flag already defined (by the local mode of `atoll chaos`) alone."""

    def add(flag: str, **kwargs) -> None:
        if flag not in have:
            p.add_argument(flag, **kwargs)

    return add


def _cluster_arguments(add) -> None:
    add(
        "--namespace",
        default="atoll",
        help="namespace of the run; must be labelled atoll.dev/enabled=true (default %(default)s)",
    )
    add(
        "--kubeconfig",
        default=None,
        help="kubeconfig file (default $KUBECONFIG, ~/.kube/config, "
        "or the in-cluster service account inside a pod)",
    )
    add("--context", default=None, help="kubeconfig context (default its current-context)")
    add(
        "--learner-context",
        action="append",
        default=[],
        metavar="CONTEXT",
        help="a learner cluster's kubeconfig context, besides the syncer's own cluster; repeat for each",
    )
    add(
        "--learner-kubeconfig",
        default=None,
        help="kubeconfig holding the --learner-context contexts (default: the --kubeconfig search)",
    )
    add(
        "--address-template",
        default=ADDRESS_TEMPLATE,
        help="how to reach a pod's port: fields {pod} {ip} {port} {namespace} {index}, e.g. "
        "'{pod}.atoll-syncer:{port}' by the headless Service's per-pod names, which a shard's "
        "TLS certificate holds (default %(default)s)",
    )


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll status`."""
    add = _adder(p, set())
    add(
        "--kubernetes",
        action="store_true",
        help="find shards and learners in a cluster (the default unless --shards is given)",
    )
    _cluster_arguments(add)
    add(
        "--shards",
        default=None,
        metavar="HOST:PORT,...",
        help="describe these shards directly instead of asking Kubernetes",
    )
    add(
        "--deadline",
        type=float,
        default=DESCRIBE_DEADLINE,
        help="seconds to wait for each shard's Describe (default %(default)s)",
    )
    add(
        "--token-file",
        type=pathlib.Path,
        default=None,
        help="file holding a bearer token, when the shards require one",
    )
    add("--json", action="store_true", help="print one JSON object instead of tables")
    add_tls_arguments(p)


def add_chaos_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `atoll chaos --kubernetes`. `--mtbf`, `--duration`, `--seed` and `--json` mean the
    same in the local mode; whichever mode adds a shared flag first owns it (default None)."""
    have = {o for action in p._actions for o in action.option_strings}
    add = _adder(p.add_argument_group("--kubernetes (delete learner pods in a cluster)"), have)
    _cluster_arguments(add)
    add("--dry-run", action="store_true", help="print the pods it would delete, delete none")
    add = _adder(p, have)
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


def _check_template(template: str, parser: argparse.ArgumentParser) -> None:
    try:
        template.format(pod="p", ip="10.0.0.1", port=1, namespace="n", index=0)
    except (KeyError, IndexError, ValueError) as e:
        parser.error(
            f"--address-template {template!r}: {e!r}; fields are {{pod}} {{ip}} {{port}} "
            "{namespace} {index}"
        )


def _fail(command: str, e: Exception) -> int:
    print(f"atoll {command}: error: {e}", file=sys.stderr)
    return 2


def status_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll status`: 0 when every shard answered, 1 when some did not, 2 on a user error."""
    if args.kubernetes and args.shards:
        parser.error("give --kubernetes or --shards, not both")
    if args.deadline <= 0:
        parser.error(f"--deadline must be > 0 seconds, got {args.deadline}")
    _check_template(args.address_template, parser)
    addresses = None
    if args.shards is not None:
        try:
            addresses = shard_addresses(args.shards)
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))
    tls = tls_from_args(args, parser)
    try:
        token = args.token_file.read_text().strip() if args.token_file else None
    except OSError as e:
        parser.error(f"--token-file: {e}")
    try:
        if addresses is not None:
            report = status_of_addresses(addresses, args.deadline, token, tls)
        else:
            report = status(
                args.namespace,
                kubeconfig=args.kubeconfig,
                context=args.context,
                learner_contexts=tuple(args.learner_context),
                learner_kubeconfig=args.learner_kubeconfig,
                address_template=args.address_template,
                deadline=args.deadline,
                token=token,
                tls=tls,
            )
    except NoKubeConfig as e:
        return _fail("status", KubeError(f"{e}; or ask shards directly: --shards HOST:PORT,..."))
    except KubeError as e:
        return _fail("status", e)
    print(json.dumps(report, indent=2) if args.json else render_status(report))
    return 0 if all("describe" in s for s in report["shards"]) else 1


def chaos_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll chaos --kubernetes`: 0 when done, 130 when Ctrl-C cut it short (still reported), 2 on a
    user error."""
    if args.mtbf is None or args.duration is None:
        parser.error("--kubernetes deletes pods: give --mtbf SECONDS and --duration SECONDS")
    for flag, value in (("--mtbf", args.mtbf), ("--duration", args.duration)):
        if not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} must be a positive number of seconds, got {value}")
    _check_template(args.address_template, parser)
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
        return _fail("chaos", e)
    print(json.dumps(result, indent=2) if args.json else render_chaos(result))
    return 130 if result.get("interrupted") else 0
