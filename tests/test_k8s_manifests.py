"""Tests for k8s/: every overlay renders, validates strictly, and keeps the conventions.

Core objects are validated with kubernetes-validate's strict schemas (unknown fields
are errors) for the oldest and newest Kubernetes we support. JobSets, a custom
resource those schemas do not know, are validated against the JobSet CRD's OpenAPI
schema (tests/data/, made strict the same way), and each replicated Job inside them
is validated again as a core batch/v1 Job, pod template included.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import prometheus_client.parser
import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
DATA = pathlib.Path(__file__).resolve().parent / "data"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
SYNCER_OVERLAYS = ["syncer", "all-in-one"]
LEARNER_OVERLAYS = ["learners-tpu-v5p", "learners-tpu-v6e", "learners-cpu", "all-in-one"]
# overlay -> (accelerator node label, chips per host)
TPU_OVERLAYS = {"learners-tpu-v5p": ("tpu-v5p-slice", 4), "learners-tpu-v6e": ("tpu-v6e-slice", 8)}
KUBERNETES_VERSIONS = ["1.27", "1.37"]
NAMESPACE = "atoll"
COMMON_LABELS = {"app.kubernetes.io/name": "atoll", "app.kubernetes.io/part-of": "atoll"}
CLUSTER_SCOPED = {"Namespace"}

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl not installed: it renders the kustomize overlays")


# -- validation ---------------------------------------------------------------------


def _strict(schema):
    """The CRD schema with unknown fields refused wherever it lists the known ones."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _jobset_validator() -> jsonschema.Draft202012Validator:
    crd = yaml.safe_load((DATA / "jobset.x-k8s.io_jobsets.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return jsonschema.Draft202012Validator(_strict(version["schema"]["openAPIV3Schema"]))


def validate(obj: dict, kubernetes: str) -> None:
    """Raises unless `obj` is valid, strictly, for that Kubernetes version.

    A kind with no known schema raises too (kubernetes_validate.SchemaNotFoundError):
    nothing passes unchecked.
    """
    if obj.get("apiVersion") == "jobset.x-k8s.io/v1alpha2" and obj.get("kind") == "JobSet":
        _jobset_validator().validate(obj)
        for rj in obj["spec"]["replicatedJobs"]:
            job = {"apiVersion": "batch/v1", "kind": "Job",
                   "metadata": {"name": f"{obj['metadata']['name']}-{rj['name']}"},
                   "spec": rj["template"]["spec"]}
            kubernetes_validate.validate(job, kubernetes, strict=True)
        return
    kubernetes_validate.validate(obj, kubernetes, strict=True)


# -- rendering ----------------------------------------------------------------------


def _kustomize(path: pathlib.Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    return tuple(_kustomize(K8S / "overlays" / overlay))


def find(objs, kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs, kind: str, name: str | None = None) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(objs) -> list[dict]:
    """Every pod template in the rendered objects, whatever owns it."""
    out = []
    for o in objs:
        if o["kind"] in ("StatefulSet", "Deployment", "Job"):
            out.append(o["spec"]["template"])
        elif o["kind"] == "JobSet":
            out += [rj["template"]["spec"]["template"] for rj in o["spec"]["replicatedJobs"]]
    return out


def learner_templates(objs) -> list[dict]:
    return [t for t in pod_templates(objs) if t["metadata"]["labels"].get("app.kubernetes.io/component") == "learner"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# -- every overlay ------------------------------------------------------------------


def test_every_overlay_is_tested():
    assert set(OVERLAYS) == {"syncer", "learners-tpu-v5p", "learners-tpu-v6e", "learners-cpu", "all-in-one"}


@needs_kubectl
@pytest.mark.parametrize("kubernetes", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay, kubernetes):
    objs = render(overlay)
    assert objs, f"{overlay} rendered nothing"
    for o in objs:
        try:
            validate(o, kubernetes)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            pytest.fail(f"{overlay}: {o['kind']}/{o['metadata']['name']} invalid for Kubernetes {kubernetes}: {e}")


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_labels_and_namespace(overlay):
    objs = render(overlay)
    namespace = one(objs, "Namespace", NAMESPACE)
    assert namespace["metadata"]["labels"]["atoll.dev/enabled"] == "true"
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        assert COMMON_LABELS.items() <= o["metadata"].get("labels", {}).items(), where
        if o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"].get("namespace") == NAMESPACE, where
    for t in pod_templates(objs):
        assert COMMON_LABELS.items() <= t["metadata"]["labels"].items()
        assert t["spec"]["securityContext"]["runAsNonRoot"] is True
        assert t["spec"]["automountServiceAccountToken"] is False


# -- the syncer ---------------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_syncer_statefulset(overlay):
    objs = render(overlay)
    sts = one(objs, "StatefulSet", "atoll-syncer")
    template = sts["spec"]["template"]
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "syncer"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "9090"
    (c,) = template["spec"]["containers"]
    assert c["args"][0] == "syncer"
    assert {(p["name"], p["containerPort"]) for p in c["ports"]} == {("grpc", 50051), ("metrics", 9090)}
    assert "--listen=0.0.0.0:50051" in c["args"] and "--metrics-port=9090" in c["args"]
    env = env_of(c)
    # The shard index is the pod ordinal, read from the pod name.
    assert env["ATOLL_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "ATOLL_SHARD_INDEX" not in env
    # The write-ahead log lives on the claim template's volume, at the data dir.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == env["ATOLL_DATA_DIR"]["value"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert template["spec"]["securityContext"]["fsGroup"] == 10001
    # Every $(VAR) in the args comes from the settings ConfigMap.
    config = one(objs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])
    for arg in c["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in config["data"] or var in env, f"{arg}: {var} is set nowhere"
    assert int(config["data"]["ATOLL_NUM_SHARDS"]) == sts["spec"]["replicas"]
    assert c["resources"]["requests"] and c["resources"]["limits"]


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_syncer_grpc_probes(overlay):
    (c,) = one(render(overlay), "StatefulSet", "atoll-syncer")["spec"]["template"]["spec"]["containers"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = c[kind]["grpc"]
        # A number, not the port's name: kubelet's gRPC probe takes only a number.
        assert type(grpc["port"]) is int and grpc["port"] == 50051, f"{kind}: {grpc}"
        # No service: the probe asks for the server's overall health, which the shard sets.
        assert grpc.get("service", "") == "", f"{kind} probes service {grpc['service']!r}"


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_syncer_services(overlay):
    objs = render(overlay)
    shards = one(objs, "StatefulSet", "atoll-syncer")["spec"]["replicas"]
    headless = one(objs, "Service", "atoll-syncer")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"]["app.kubernetes.io/component"] == "syncer"
    per_shard = [s for s in find(objs, "Service") if re.fullmatch(r"atoll-syncer-\d+", s["metadata"]["name"])]
    assert sorted(s["metadata"]["name"] for s in per_shard) == [f"atoll-syncer-{i}" for i in range(shards)]
    for s in per_shard:
        # Exactly one pod: the StatefulSet pod of the same ordinal.
        assert s["spec"]["selector"] == {"statefulset.kubernetes.io/pod-name": s["metadata"]["name"]}
        assert {p["name"]: p["port"] for p in s["spec"]["ports"]}["grpc"] == 50051


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_syncer_disruption_budget_and_network_policy(overlay):
    objs = render(overlay)
    syncer = {"app.kubernetes.io/name": "atoll", "app.kubernetes.io/component": "syncer"}
    assert one(objs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == syncer
    policy = one(objs, "NetworkPolicy", "atoll-syncer")
    assert policy["spec"]["podSelector"]["matchLabels"] == syncer
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    assert set(by_port) == {"grpc", "metrics"}
    learners = [f for f in by_port["grpc"] if "podSelector" in f]
    assert learners == [{"namespaceSelector": {"matchLabels": {"atoll.dev/enabled": "true"}},
                         "podSelector": {"matchLabels": {"app.kubernetes.io/component": "learner"}}}]
    assert any("ipBlock" in f for f in by_port["grpc"]), "no ipBlock for learners in other clusters"
    assert all("ipBlock" not in f for f in by_port["metrics"])


@needs_kubectl
def test_tls_component(tmp_path):
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{rel}/overlays/syncer]\ncomponents: [{rel}/components/tls]\n")
    objs = _kustomize(tmp_path)
    for o in objs:
        for kubernetes in KUBERNETES_VERSIONS:
            validate(o, kubernetes)
    (c,) = one(objs, "StatefulSet", "atoll-syncer")["spec"]["template"]["spec"]["containers"]
    assert "--tls-cert=/etc/atoll/tls/tls.crt" in c["args"] and "--tls-key=/etc/atoll/tls/tls.key" in c["args"]
    # Kubelet's gRPC probes cannot speak TLS.
    assert all("grpc" not in c[k] and c[k]["tcpSocket"]["port"] == 50051
               for k in ("startupProbe", "readinessProbe", "livenessProbe"))


# -- the learners -------------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("overlay", LEARNER_OVERLAYS)
def test_learner_pods(overlay):
    objs = render(overlay)
    templates = learner_templates(objs)
    assert templates, f"{overlay} has no learner pods"
    config = one(objs, "ConfigMap", "atoll-learner-config")["data"]
    syncer_config = next(o for o in render("syncer") if o["kind"] == "ConfigMap"
                         and o["metadata"]["name"].startswith("atoll-syncer-config"))["data"]
    assert config["ATOLL_NUM_SHARDS"] == syncer_config["ATOLL_NUM_SHARDS"]
    assert "{i}" in config["ATOLL_SHARDS"] and config["ATOLL_SHARDS"].endswith(":50051")
    assert int(config["ATOLL_FRAGMENTS"]) >= int(config["ATOLL_NUM_SHARDS"])
    for t in templates:
        labels = t["metadata"]["labels"]
        assert labels.get("atoll.dev/region"), "learner pods carry atoll.dev/region"
        assert t["metadata"]["annotations"]["prometheus.io/port"] == "9091"
        (c,) = t["spec"]["containers"]
        assert c["args"][0] == "learner" and "--metrics-port=9091" in c["args"]
        assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("metrics", 9091)]
        env = env_of(c)
        assert env["ATOLL_REGION"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['atoll.dev/region']"
        assert env["ATOLL_LEARNER_ID"]["value"].startswith("$(ATOLL_REGION)-")
        defined = set(config) | set(env)
        for text in c["args"] + [e.get("value", "") for e in env.values()]:
            for var in re.findall(r"\$\((\w+)\)", text):
                assert var in defined, f"{text}: {var} is set nowhere"
        if "ATOLL_LEARNER_INDEX" not in env:
            assert 0 <= int(config["ATOLL_LEARNER_INDEX"]) < int(config["ATOLL_NUM_LEARNERS"])


def _chips(topology: str) -> int:
    n = 1
    for d in topology.split("x"):
        n *= int(d)
    return n


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(TPU_OVERLAYS))
def test_tpu_jobset(overlay):
    accelerator, chips_per_host = TPU_OVERLAYS[overlay]
    jobset = one(render(overlay), "JobSet")
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] > 0, "a failed learner must be restarted"
    for rj in jobset["spec"]["replicatedJobs"]:
        job = rj["template"]["spec"]
        pod = job["template"]["spec"]
        selector = pod["nodeSelector"]
        assert selector["cloud.google.com/gke-tpu-accelerator"] == accelerator
        hosts = _chips(selector["cloud.google.com/gke-tpu-topology"]) // chips_per_host
        assert job["parallelism"] == job["completions"] == hosts, "one pod per host of the slice"
        assert hosts == 1, "a learner runs on one host (learner.main.multi_host_refusal)"
        assert pod["restartPolicy"] == "Never"
        (c,) = pod["containers"]
        res = c["resources"]
        assert res["requests"]["google.com/tpu"] == res["limits"]["google.com/tpu"] == str(chips_per_host)
        assert job["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "learner"


# -- the dashboard ------------------------------------------------------------------

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                 "unless", "offset"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (not functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)  # matchers, ranges
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        follows = expr[m.end():].lstrip()[:1]
        if m.group() not in _PROMQL_WORDS and follows != "(":
            names.add(m.group())
    return names


def test_promql_metric_names():
    assert promql_metric_names(
        'sum by (le) (rate(atoll_push_staleness_bucket{job="x"}[5m])) / count(up{a="b"})'
    ) == {"atoll_push_staleness_bucket", "up"}
    assert promql_metric_names("histogram_quantile(0.9, x_bucket)") == {"x_bucket"}


# Sample names Prometheus stores for each metric type (a labelled metric with no
# children yet is exposed with HELP and TYPE only, no samples).
_SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("", "_sum", "_count"), "info": ("_info",)}


@functools.cache
def exposed_metric_names() -> frozenset[str]:
    """Sample names a shard and a learner expose, as Prometheus stores them."""
    from learner.loop import _Metrics
    from server.metrics import ShardMetrics

    shard = ShardMetrics(0, gauges=lambda: ({0: (1, 0)}, 1, 0.0))
    texts = [shard.text(), prometheus_client.generate_latest(_Metrics("learner-0").registry).decode()]
    families = [f for text in texts for f in prometheus_client.parser.text_string_to_metric_families(text)]
    return frozenset({s.name for f in families for s in f.samples}
                     | {f.name + suffix for f in families for suffix in _SAMPLE_SUFFIXES[f.type]})


def test_dashboard():
    dashboard = json.loads((K8S / "dashboards" / "atoll.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}
    for title in ("Goodput", "Fragment versions", "Push staleness", "Bytes", "Rounds closed per second",
                  "Live learners"):
        assert title in exprs, f"dashboard lacks {title!r}"
    assert any("atoll_accepted_compute_seconds_total" in e and 'app_kubernetes_io_component="learner"' in e
               for e in exprs["Goodput"])
    known = exposed_metric_names() | {"up"}  # up: Prometheus's own, per scrape target
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            unknown = promql_metric_names(t["expr"]) - known
            assert not unknown, f"panel {p['title']!r} reads unknown metrics {sorted(unknown)}"


# -- the checks can fail ------------------------------------------------------------


def _statefulset() -> dict:
    path = K8S / "base" / "syncer" / "statefulset.yaml"
    sts = yaml.safe_load(path.read_text())
    sts["metadata"]["namespace"] = NAMESPACE
    return sts


def _jobset() -> dict:
    return yaml.safe_load((K8S / "overlays" / "learners-tpu-v5p" / "jobset.yaml").read_text())


def _container(obj: dict) -> dict:
    if obj["kind"] == "JobSet":
        return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    return obj["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("kubernetes", KUBERNETES_VERSIONS)
def test_unbroken_sources_validate(kubernetes):
    validate(_statefulset(), kubernetes)
    validate(_jobset(), kubernetes)


def _probe_port_as_string(o):
    _container(o)["readinessProbe"]["grpc"]["port"] = "50051"


def _misspelled_probe(o):
    c = _container(o)
    c["readinesProbe"] = c.pop("readinessProbe")


def _port_as_string(o):
    _container(o)["ports"][0]["containerPort"] = "9091"


def _misspelled_container_field(o):
    c = _container(o)
    c["resource"] = c.pop("resources")


def _misspelled_template_field(o):
    spec = (o["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"] if o["kind"] == "JobSet"
            else o["spec"]["template"]["spec"])
    spec["nodeSelectr"] = spec.pop("nodeSelector", {"a": "b"})


def _misspelled_jobset_field(o):
    o["spec"]["failurPolicy"] = o["spec"].pop("failurePolicy")


def _replicas_as_string(o):
    o["spec"]["replicatedJobs"][0]["replicas"] = "1"


BREAKAGES = [(_statefulset, _probe_port_as_string), (_statefulset, _misspelled_probe),
             (_statefulset, _misspelled_template_field), (_jobset, _port_as_string),
             (_jobset, _misspelled_container_field), (_jobset, _misspelled_template_field),
             (_jobset, _misspelled_jobset_field), (_jobset, _replicas_as_string)]


@pytest.mark.parametrize("kubernetes", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("make, breakage", BREAKAGES, ids=[f"{m.__name__[1:]}-{b.__name__[1:]}" for m, b in BREAKAGES])
def test_broken_manifest_is_rejected(make, breakage, kubernetes):
    obj = make()
    broken = copy.deepcopy(obj)
    breakage(broken)
    assert broken != obj
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(broken, kubernetes)


def test_unknown_kind_is_rejected():
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
               "metadata": {"name": "atoll"}, "spec": {}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(monitor, "1.37")
