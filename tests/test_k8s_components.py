"""Tests for the optional pieces around the overlays: the Kueue queue the learners wait in
(k8s/kueue-queues), monitoring split into scraping for every cluster and alerts for the
syncer's alone, and the shards' certificate kept by cert-manager (components/cert-manager).

Rendering and strict validation are test_k8s_manifests.py's: the Kueue and cert-manager
objects are checked against their CRDs' schemas there (CRDS, tests/data/).
"""

from __future__ import annotations

import copy
import re
from fractions import Fraction

import jsonschema
import prometheus_client
import pytest
from test_k8s_manifests import (
    COMBINATIONS,
    COMMON_LABELS,
    LEARNER_OVERLAYS,
    NAMESPACE,
    SYNCER_OVERLAYS,
    _families,
    _selects,
    _validate_all,
    find,
    learner_settings,
    needs_kubectl,
    one,
    promql_metric_names,
    render,
    render_dir,
    validate,
)

# -- Kueue ----------------------------------------------------------------------------

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# The learner overlays the queue is for, all at once (all-in-one is a try-out cluster
# without Kueue).
QUEUED_OVERLAYS = [o for o in LEARNER_OVERLAYS if o != "all-in-one"]
TPU_NODE_LABELS = ("cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology")

_SUFFIXES = {
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}


def quantity(value: str | int) -> Fraction:
    """A Kubernetes resource quantity ("32", "10m", "256Gi", 8) as an exact number."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    assert m and m.group(2) in _SUFFIXES, f"not a quantity: {value!r}"
    return Fraction(m.group(1)) * _SUFFIXES[m.group(2)]


def kueue_pod_requests(pod: dict) -> dict[str, Fraction]:
    """What Kueue counts for one pod: each container's requests (its limits where it sets
    none), summed over the containers, or the largest init container's where that is more
    (pkg/workload/resources.go and Kubernetes' PodRequests; no sidecars or overhead here)."""

    def requests(c: dict) -> dict[str, Fraction]:
        res = c.get("resources", {})
        merged = {**res.get("limits", {}), **res.get("requests", {})}
        return {k: quantity(v) for k, v in merged.items()}

    total: dict[str, Fraction] = {}
    for c in pod["containers"]:
        for k, v in requests(c).items():
            total[k] = total.get(k, Fraction(0)) + v
    for c in pod.get("initContainers", []):
        assert c.get("restartPolicy") != "Always", "a sidecar adds up differently"
        for k, v in requests(c).items():
            total[k] = max(total.get(k, Fraction(0)), v)
    return total


def queued_pod_sets(objs) -> list[tuple[str, dict, int]]:
    """(workload, pod spec, pod count) of every pod set Kueue would make a Workload of: a
    JobSet's replicated Jobs (replicas x min(parallelism, completions)), a Job's pods."""

    def pods(job: dict) -> int:
        parallelism = job.get("parallelism", 1)
        return min(parallelism, job.get("completions", parallelism))

    out = []
    for o in objs:
        if QUEUE_LABEL not in o["metadata"].get("labels", {}):
            continue
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "JobSet":
            for rj in o["spec"]["replicatedJobs"]:
                job = rj["template"]["spec"]
                out.append((name, job["template"]["spec"], rj["replicas"] * pods(job)))
        else:
            assert o["kind"] == "Job", name
            out.append((name, o["spec"]["template"]["spec"], pods(o["spec"])))
    return out


def assign_flavors(queue: dict, flavors: dict[str, dict], pod_sets) -> dict[str, str]:
    """Kueue's flavor assignment, every pod set admitted at once: the first flavor of the
    ClusterQueue's order whose node labels the pods' nodeSelector agrees with (on the keys
    the flavors label) and whose nominal quota still has room for every resource they
    request. Returns workload -> flavor; fails where Kueue would not admit one."""
    (group,) = queue["spec"]["resourceGroups"]
    covered = group["coveredResources"]
    keys = {k for f in flavors.values() for k in f.get("spec", {}).get("nodeLabels", {})}
    quota = {
        (f["name"], r["name"]): quantity(r["nominalQuota"])
        for f in group["flavors"]
        for r in f["resources"]
    }
    used = dict.fromkeys(quota, Fraction(0))
    assigned = {}
    for workload, pod, count in pod_sets:
        wanted = {k: v * count for k, v in kueue_pod_requests(pod).items() if v}
        missing = set(wanted) - set(covered)
        assert not missing, f"{workload} requests {sorted(missing)}, which the queue does not cover"
        selector = {k: v for k, v in pod.get("nodeSelector", {}).items() if k in keys}
        for f in group["flavors"]:
            labels = flavors[f["name"]].get("spec", {}).get("nodeLabels", {})
            if any(labels.get(k) != v for k, v in selector.items()):
                continue
            if all(used[f["name"], r] + v <= quota[f["name"], r] for r, v in wanted.items()):
                for r, v in wanted.items():
                    used[f["name"], r] += v
                assigned[workload] = f["name"]
                break
        else:
            pytest.fail(
                f"{workload} ({count} pods, {wanted}) fits no flavor: it would wait forever"
            )
    return assigned


def _queue_objects():
    objs = render_dir("kueue-queues")
    flavors = {f["metadata"]["name"]: f for f in find(objs, "ResourceFlavor")}
    return objs, one(objs, "ClusterQueue"), flavors


@needs_kubectl
def test_kueue_queues_render_and_validate():
    """Cluster objects without a namespace, the LocalQueue in the run's namespace, naming
    the ClusterQueue, which admits that namespace; each flavor's resources are the covered
    ones, in their order (Kueue's rule)."""
    objs, queue, flavors = _queue_objects()
    _validate_all(objs, "k8s/kueue-queues")
    for o in objs:
        assert COMMON_LABELS.items() <= o["metadata"]["labels"].items(), o["metadata"]["name"]
        if o["kind"] in ("ResourceFlavor", "ClusterQueue"):
            assert "namespace" not in o["metadata"], o["metadata"]["name"]
    local = one(objs, "LocalQueue")
    assert local["metadata"]["namespace"] == NAMESPACE
    assert local["spec"]["clusterQueue"] == queue["metadata"]["name"]
    (namespace,) = find(render_dir("namespace"), "Namespace")
    assert _selects(queue["spec"]["namespaceSelector"], namespace["metadata"]["labels"])
    # The queue the kueue component labels the learners with.
    for overlay in QUEUED_OVERLAYS:
        for o in render(overlay, ("kueue",)):
            if QUEUE_LABEL in o["metadata"].get("labels", {}):
                assert o["metadata"]["labels"][QUEUE_LABEL] == local["metadata"]["name"]
    (group,) = queue["spec"]["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] and {f["name"] for f in group["flavors"]} == set(
        flavors
    )
    for f in group["flavors"]:
        assert [r["name"] for r in f["resources"]] == group["coveredResources"], f["name"]


@needs_kubectl
def test_kueue_admits_every_slice_of_the_learner_overlays():
    """Every learner JobSet and Job is queued; the queue covers every resource a learner pod
    requests (init containers counted as Kueue counts them); each slice gets the flavor of
    its accelerator and topology, CPU learners one without node labels; and the quotas hold
    every slice of every learner overlay at once."""
    _, queue, flavors = _queue_objects()
    pod_sets = []
    for overlay in QUEUED_OVERLAYS:
        objs = render(overlay, ("kueue",))
        learners = [
            o
            for o in objs
            if o["kind"] == "JobSet" or (o["kind"] == "Job" and "learner" in o["metadata"]["name"])
        ]
        assert learners
        for o in learners:
            assert QUEUE_LABEL in o["metadata"]["labels"], o["metadata"]["name"]
        pod_sets += [(f"{overlay}: {w}", pod, n) for w, pod, n in queued_pod_sets(objs)]
    requested = {r for _, pod, _ in pod_sets for r in kueue_pod_requests(pod)}
    assert {"cpu", "memory", "google.com/tpu"} <= requested
    (group,) = queue["spec"]["resourceGroups"]
    assert requested <= set(group["coveredResources"])
    assigned = assign_flavors(queue, flavors, pod_sets)
    for workload, pod, _ in pod_sets:
        labels = flavors[assigned[workload]].get("spec", {}).get("nodeLabels", {})
        selector = pod.get("nodeSelector", {})
        if "google.com/tpu" in kueue_pod_requests(pod):
            assert labels == {k: selector[k] for k in TPU_NODE_LABELS}, workload
        else:
            assert labels == {}, f"{workload}: a CPU learner sent to {assigned[workload]}"


def test_kueue_pod_requests_counts_init_containers():
    pod = {
        "initContainers": [{"resources": {"requests": {"cpu": "10m", "memory": "64Gi"}}}],
        "containers": [
            {"resources": {"requests": {"cpu": "2"}, "limits": {"memory": "16Gi"}}},
            {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
        ],
    }
    assert kueue_pod_requests(pod) == {"cpu": Fraction(5, 2), "memory": 64 * 2**30}


@needs_kubectl
def test_the_flavor_checks_can_fail():
    """A TPU flavor ahead of the CPU one takes the CPU learners; a quota one slice short,
    or a resource left uncovered, admits nothing."""
    _, queue, flavors = _queue_objects()
    pod_sets = queued_pod_sets(render("learners-cpu", ("kueue",)))
    wrong_order = copy.deepcopy(queue)
    group = wrong_order["spec"]["resourceGroups"][0]
    group["flavors"].append(group["flavors"].pop(0))
    (taken,) = set(assign_flavors(wrong_order, flavors, pod_sets).values())
    assert flavors[taken]["spec"]["nodeLabels"], "the CPU learners took a TPU flavor"
    tpu = queued_pod_sets(render("learners-tpu-v6e-4x4", ("kueue",)))
    short = copy.deepcopy(queue)
    for f in short["spec"]["resourceGroups"][0]["flavors"]:
        for r in f["resources"]:
            if r["name"] == "google.com/tpu" and quantity(r["nominalQuota"]):
                r["nominalQuota"] = str(quantity(r["nominalQuota"]) - 1)
    with pytest.raises(pytest.fail.Exception, match="fits no flavor"):
        assign_flavors(short, flavors, tpu)
    uncovered = copy.deepcopy(queue)
    group = uncovered["spec"]["resourceGroups"][0]
    group["coveredResources"].remove("memory")
    with pytest.raises(AssertionError, match="memory"):
        assign_flavors(uncovered, flavors, tpu)


# -- alerts only where the shards are -------------------------------------------------

SCRAPING = ("monitoring-gmp", "monitoring-prometheus-operator")
ALERTS = {c: f"{c}-alerts" for c in SCRAPING}


def _alert_rules(objs) -> list[dict]:
    return [
        r
        for o in objs
        if o["kind"] in ("Rules", "PrometheusRule")
        for g in o["spec"]["groups"]
        for r in g["rules"]
    ]


def _learner_metric_names() -> set[str]:
    """Sample names a learner exposes, as Prometheus stores them."""
    from atoll.learner.trainer.loop import _Metrics

    text = prometheus_client.generate_latest(_Metrics("learner-0").registry).decode()
    return {s.name for f in _families(text).values() for s in f.samples}


LEARNER_ONLY = [o for o in LEARNER_OVERLAYS if o not in SYNCER_OVERLAYS]


@needs_kubectl
@pytest.mark.parametrize(
    "overlay, components",
    [(o, (c,)) for o in LEARNER_ONLY for c in SCRAPING]
    + [(o, cs) for o, cs in COMBINATIONS if o in LEARNER_ONLY],
)
def test_learner_clusters_get_no_shard_alerts(overlay, components):
    """A learner cluster has no shard series: an alert there on job="atoll-syncer" (or any
    shard metric) would read nothing, and absent() would fire forever."""
    objs = render(overlay, components)
    assert (
        find(objs, "PodMonitoring")
        or find(objs, "ServiceMonitor")
        or not (set(components) & set(SCRAPING))
    )
    learner = _learner_metric_names() | {"up"}
    for rule in _alert_rules(objs):
        assert 'job="atoll-syncer"' not in rule["expr"], f"{overlay}: {rule['alert']}"
        assert promql_metric_names(rule["expr"]) <= learner, f"{overlay}: {rule['alert']}"


@needs_kubectl
@pytest.mark.parametrize("scraping", SCRAPING)
def test_scraping_and_alerts_are_apart(scraping):
    """The scraping component brings no alert; its alerts component brings the alerts and
    nothing else, and the syncer's cluster takes both."""
    assert not _alert_rules(render("syncer", (scraping,)))
    alerts = render("syncer", (ALERTS[scraping],))
    added = {(o["kind"], o["metadata"]["name"]) for o in alerts} - {
        (o["kind"], o["metadata"]["name"]) for o in render("syncer")
    }
    assert {kind for kind, _ in added} == {
        "Rules" if scraping == "monitoring-gmp" else "PrometheusRule"
    }
    assert any(set(cs) >= {scraping, ALERTS[scraping]} for o, cs in COMBINATIONS if o == "syncer")
    both = render("syncer", (scraping, ALERTS[scraping]))
    assert any('job="atoll-syncer"' in r["expr"] for r in _alert_rules(both))


@needs_kubectl
def test_certificate_alerts_read_the_served_certificate():
    """Two thresholds on the notAfter of the certificate each shard serves, well inside
    cert-manager's renewal window: they fire only when renewal fails."""
    rules = {r["alert"]: r for r in _alert_rules(render("syncer", (ALERTS["monitoring-gmp"],)))}
    soon, imminent = rules["AtollCertificateExpiringSoon"], rules["AtollCertificateExpiryImminent"]
    for rule in (soon, imminent):
        assert promql_metric_names(rule["expr"]) == {
            "atoll_tls_certificate_expiry_timestamp_seconds"
        }
        assert "time()" in rule["expr"] and 'job="atoll-syncer"' in rule["expr"]
    assert (soon["labels"]["severity"], imminent["labels"]["severity"]) == ("warning", "critical")
    days = {
        name: int(re.search(r"< (\d+) \* 86400$", r["expr"]).group(1))
        for name, r in (("soon", soon), ("imminent", imminent))
    }
    renew = _hours(
        one(render("syncer", ("tls", "cert-manager")), "Certificate")["spec"]["renewBefore"]
    )
    assert renew / 24 > days["soon"] > days["imminent"] > 0


# -- cert-manager ---------------------------------------------------------------------


def _hours(duration: str) -> float:
    """A Go duration of hours and minutes ("2160h", "1h30m") in hours."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?", duration)
    assert m and duration, duration
    return int(m.group(1) or 0) + int(m.group(2) or 0) / 60


def _hosts(pattern: str, shards: int) -> set[str]:
    """The hosts of a shard address pattern ('atoll-syncer-{i}.x:50051') for shards 0..n-1."""
    host = pattern.rsplit(":", 1)[0]
    assert "{i}" in host, pattern
    return {host.replace("{i}", str(i)) for i in range(shards)}


def _shard_addresses(overlay: str, objs) -> set[str]:
    """Every address pattern by which something dials the shards of `overlay`: the learners
    (each learner overlay that uses these shards), the drain and atoll-status."""
    from atoll.cluster.drain import DEFAULT_DRAIN_SHARDS

    learners = [overlay] if overlay == "all-in-one" else LEARNER_ONLY
    patterns = {learner_settings(render(o))["ATOLL_SHARDS"] for o in learners}
    syncer_config = next(
        o["data"]
        for o in objs
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("atoll-syncer-config")
    )
    patterns.add(syncer_config.get("ATOLL_DRAIN_SHARDS", DEFAULT_DRAIN_SHARDS))
    for job in find(objs, "Job"):
        for c in job["spec"]["template"]["spec"]["containers"]:
            patterns |= {a.split("=", 1)[1] for a in c.get("args", []) if a.startswith("--shards=")}
    return patterns


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_cert_manager_keeps_the_secret_the_shards_mount(overlay):
    """The Certificate validates, writes the Secret the tls component mounts (and
    operator-tls reads ca.crt from), and names every shard the StatefulSet runs under
    every address a learner, the drain or atoll-status dials."""
    objs = render(overlay, ("tls", "operator-tls", "cert-manager"))
    _validate_all(objs, f"{overlay} with cert-manager")
    cert = one(objs, "Certificate")
    assert cert["metadata"]["namespace"] == NAMESPACE
    spec = cert["spec"]
    sts = one(objs, "StatefulSet", "atoll-syncer")
    (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert spec["secretName"] == volume["secret"]["secretName"]
    status = one(objs, "Job", "atoll-status")["spec"]["template"]["spec"]
    (volume,) = [v for v in status["volumes"] if v["name"] == "tls"]
    assert spec["secretName"] == volume["secret"]["secretName"]
    assert COMMON_LABELS.items() <= spec["secretTemplate"]["labels"].items()
    assert spec["issuerRef"]["name"] and spec["issuerRef"]["kind"] in ("Issuer", "ClusterIssuer")
    assert "server auth" in spec["usages"]
    assert _hours(spec["duration"]) > _hours(spec["renewBefore"]) > 0
    shards = sts["spec"]["replicas"]
    addresses = _shard_addresses(overlay, objs)
    assert len(addresses) >= 2
    for pattern in addresses:
        missing = _hosts(pattern, shards) - set(spec["dnsNames"])
        assert not missing, f"the certificate does not name {sorted(missing)} ({pattern})"


def test_shard_hosts():
    assert _hosts("atoll-syncer-{i}.atoll-syncer:50051", 2) == {
        "atoll-syncer-0.atoll-syncer",
        "atoll-syncer-1.atoll-syncer",
    }
    assert _hours("2160h") == 2160 and _hours("1h30m") == 1.5


def _misspelled_quota(objs):
    cq = one(objs, "ClusterQueue")
    r = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]
    r["nominal"] = r.pop("nominalQuota")
    return cq


def _v1beta1_cohort(objs):
    cq = one(objs, "ClusterQueue")
    cq["spec"]["cohort"] = "atoll"  # v1beta2 calls it cohortName
    return cq


def _misspelled_node_labels(objs):
    flavor = one(objs, "ResourceFlavor", "atoll-tpu-v5p-2x2x1")
    flavor["spec"]["nodeLabel"] = flavor["spec"].pop("nodeLabels")
    return flavor


def _misspelled_cluster_queue(objs):
    local = one(objs, "LocalQueue")
    local["spec"]["clusterqueue"] = local["spec"].pop("clusterQueue")
    return local


def _dns_name_as_string(objs):
    cert = one(objs, "Certificate")
    cert["spec"]["dnsNames"] = cert["spec"]["dnsNames"][0]
    return cert


def _unknown_usage(objs):
    cert = one(objs, "Certificate")
    cert["spec"]["usages"] = ["server-auth"]
    return cert


BREAKAGES = [
    ("kueue", _misspelled_quota),
    ("kueue", _v1beta1_cohort),
    ("kueue", _misspelled_node_labels),
    ("kueue", _misspelled_cluster_queue),
    ("cert-manager", _dns_name_as_string),
    ("cert-manager", _unknown_usage),
]


@needs_kubectl
@pytest.mark.parametrize("source, breakage", BREAKAGES, ids=[b.__name__[1:] for _, b in BREAKAGES])
def test_broken_queue_or_certificate_is_rejected(source, breakage):
    objs = copy.deepcopy(
        render_dir("kueue-queues")
        if source == "kueue"
        else render("syncer", ("tls", "cert-manager"))
    )
    broken = breakage(objs)
    with pytest.raises(jsonschema.ValidationError):
        validate(broken, "1.37")
