"""`atoll status`, and the Kubernetes API as it and `atoll chaos --kubernetes` use it.

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
* the API helpers both commands use (connect, check_namespace, list_pods, delete_pod) and
  the cluster flags they share; `atoll chaos --kubernetes` itself is atoll/cluster/kube_chaos.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ipaddress
import json
import os
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from atoll.commands import add_tls_arguments, address_list, tls_from_args

# the kubernetes client ships no types: its API and pod objects are Any to mypy
Api = Any  # kubernetes.client.CoreV1Api
Pod = Any  # kubernetes.client.V1Pod

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
# Deleted pods get this grace before SIGKILL: short enough to be a crash, yet the API still
# waits for the kubelet, so a replacement never runs beside the pod it replaces.
DELETE_GRACE_SECONDS = 1


class KubeError(Exception):
    """A problem the user can fix (config, reachability, RBAC, labels); the message says how."""


class NoKubeConfig(KubeError):
    """No kubeconfig and no service account: there is no cluster to ask."""


# --- the API ---


def connect(kubeconfig: str | None = None, context: str | None = None) -> Api:
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


def _call(
    api: Api, what: str, method: str, *args: Any, absent_ok: bool = False, **kwargs: Any
) -> Any:
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


def check_namespace(api: Api, namespace: str) -> None:
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
    api: Api, learner_contexts: Sequence[str] | None, kubeconfig: str | None
) -> list[tuple[str | None, Api]]:
    """(context, API) of every cluster that may hold learner pods: the syncer's (context None)
    first, then each of `learner_contexts`, read from `kubeconfig`."""
    return [(None, api)] + [(c, connect(kubeconfig, c)) for c in learner_contexts or ()]


def list_pods(api: Api, namespace: str, labels: dict[str, str]) -> list[Pod]:
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


def pod_row(pod: Pod) -> dict[str, Any]:
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


def shard_index(pod: Pod) -> int | None:
    m = re.search(r"-(\d+)$", pod.metadata.name)
    return int(m.group(1)) if m else None


def pod_address(pod: Pod, port_name: str, template: str = ADDRESS_TEMPLATE) -> str | None:
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


def delete_pod(api: Api, name: str, namespace: str) -> bool:
    """Deletes one pod; False when it was gone already."""
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


# --- status ---


def describe_shard(
    address: str, deadline: float = DESCRIBE_DEADLINE, token: str | None = None, tls: Any = None
) -> dict[str, Any]:
    """{"describe": ...} from one shard's Describe, or {"error": ...} when it does not answer
    (`tls`: a wire.client.TlsFiles, or None for plaintext)."""
    import grpc

    from atoll.wire.client import ShardClient

    shard = ShardClient(address, "", token=token, tls=tls, deadline=deadline)
    try:
        if not shard.listening():  # a refused connection answers at once, not at the deadline
            return {"error": "unreachable (UNAVAILABLE: nothing answers at this address)"}
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


def _tls_hint(address: str, tls: Any) -> str:
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


def _describe_all(
    shards: list[dict[str, Any]], deadline: float, token: str | None, tls: Any = None
) -> list[dict[str, Any]]:
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
    api: Api | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
    learner_contexts: tuple[str, ...] = (),
    learner_kubeconfig: str | None = None,
    address_template: str = ADDRESS_TEMPLATE,
    deadline: float = DESCRIBE_DEADLINE,
    token: str | None = None,
    tls: Any = None,
) -> dict[str, Any]:
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
    addresses: list[str],
    deadline: float = DESCRIBE_DEADLINE,
    token: str | None = None,
    tls: Any = None,
) -> dict[str, Any]:
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


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """Rows under a header, each column padded to its widest cell ("-" for None)."""
    cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def _yes(v: object) -> str | None:
    return None if v is None else ("yes" if v else "no")


def _fragments(d: dict[str, Any]) -> str:
    """A shard's fragments as FRAGMENT:VERSION/OPEN ROUND (->SHARD it is moving to)."""
    return (
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
    )


def _shard_lines(shards: list[dict[str, Any]]) -> list[str]:
    rows = []
    for s in shards:
        d = s.get("describe")
        rows.append(
            [
                d["shard_index"] if d else s["index"],
                s["pod"],
                s["phase"],
                _yes(s["ready"]),
                s["restarts"],
                s["node"],
                s["address"],
                len(d["live_learners"]) if d else None,
                d.get("map_version") if d else None,
                _fragments(d) if d else s["error"],
            ]
        )
    header = ["SHARD", "POD", "PHASE", "READY", "RESTARTS", "NODE", "ADDRESS", "LIVE", "MAP"]
    return _table(header + ["FRAGMENT:VERSION/OPEN ROUND (->SHARD: MOVING THERE)"], rows)


def _learner_lines(learners: list[dict[str, Any]] | None) -> list[str]:
    if learners is None:
        return []
    if not learners:
        return ["", "no learner pods"]
    lines = [""] + _table(
        ["LEARNER", "CONTEXT", "REGION", "PHASE", "READY", "RESTARTS", "NODE"],
        [
            [r["pod"], r.get("context"), r["region"], r["phase"], _yes(r["ready"])]
            + [r["restarts"], r["node"]]
            for r in learners
        ],
    )
    ready = sum(r["ready"] for r in learners)
    return lines + [f"{ready}/{len(learners)} learner pods ready"]


def render_status(report: dict[str, Any]) -> str:
    """The report as aligned text tables."""
    where = (
        f"namespace {report['namespace']}" if report["namespace"] else "shards given by --shards"
    )
    lines = [where, ""] + _shard_lines(report["shards"])
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
    return "\n".join(lines + _learner_lines(report["learners"]))


# --- CLI glue ---


def flag_adder(p: argparse._ActionsContainer, have: set[str]) -> Callable[..., None]:
    """add_argument that leaves a flag already defined (by the local mode of `atoll chaos`) alone."""

    def add(flag: str, **kwargs: Any) -> None:
        if flag not in have:
            p.add_argument(flag, **kwargs)

    return add


def add_cluster_arguments(add: Callable[..., None]) -> None:
    """The flags that say which clusters and namespace a run is in and how to reach its pods."""
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
    add = flag_adder(p, set())
    add(
        "--kubernetes",
        action="store_true",
        help="find shards and learners in a cluster (the default unless --shards is given)",
    )
    add_cluster_arguments(add)
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


def check_address_template(template: str, parser: argparse.ArgumentParser) -> None:
    """Refuses (by `parser.error`) an --address-template naming a field that does not exist."""
    try:
        template.format(pod="p", ip="10.0.0.1", port=1, namespace="n", index=0)
    except (KeyError, IndexError, ValueError) as e:
        parser.error(
            f"--address-template {template!r}: {e!r}; fields are {{pod}} {{ip}} {{port}} "
            "{namespace} {index}"
        )


def command_error(command: str, e: Exception) -> int:
    """Prints a user error of `atoll COMMAND` in one line; its exit status."""
    print(f"atoll {command}: error: {e}", file=sys.stderr)
    return 2


def status_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`atoll status`: 0 when every shard answered, 1 when some did not, 2 on a user error."""
    if args.kubernetes and args.shards:
        parser.error("give --kubernetes or --shards, not both")
    if args.deadline <= 0:
        parser.error(f"--deadline must be > 0 seconds, got {args.deadline}")
    check_address_template(args.address_template, parser)
    addresses = None
    if args.shards is not None:
        try:
            addresses = address_list(args.shards)
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
        return command_error(
            "status", KubeError(f"{e}; or ask shards directly: --shards HOST:PORT,...")
        )
    except KubeError as e:
        return command_error("status", e)
    print(json.dumps(report, indent=2) if args.json else render_status(report))
    return 0 if all("describe" in s for s in report["shards"]) else 1
