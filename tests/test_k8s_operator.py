"""Tests for k8s/components/operator and operator-tls: what each operator Job may do.

* atoll-status reads the API (get and list, never delete), mounts the operator token
  alone, and dials every shard by the name the shards' certificate holds;
* atoll-chaos alone may delete (learner) pods, with an account of its own, and mounts
  no atoll token at all;
* atoll-reshard talks to the shards only: no API token, the operator token alone, a
  command line that `atoll reshard` accepts, and a NetworkPolicy that admits it.
"""

from __future__ import annotations

import pytest
from test_k8s_manifests import (
    KUBERNETES_VERSIONS,
    NAMESPACE,
    _selects,
    atoll_parser,
    find,
    k8s_expand,
    needs_kubectl,
    one,
    render,
    validate,
)

# the operator component as the docs add it: plaintext, and beside the shards' TLS
VARIANTS = [("operator",), ("tls", "operator-tls")]
TOKEN_SECRET = "atoll-token"  # base/common: keys `token` (every learner's) and `operator-token`


def _job(objs, name: str) -> tuple[dict, dict]:
    """(pod spec, its one container) of Job `name`."""
    spec = one(objs, "Job", name)["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return spec, c


def _mount(container: dict, volume: str) -> str:
    (path,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return path


def _flag(container: dict, flag: str) -> str | None:
    values = [a.split("=", 1)[1] for a in container["args"] if a.startswith(flag + "=")]
    assert len(values) <= 1, f"{flag} given twice"
    return values[0] if values else None


def _here(arg: str, paths: dict[str, str]) -> str:
    """`--flag=PATH` with a path in the pod replaced by the test's file."""
    flag, eq, value = arg.partition("=")
    return f"{flag}={paths[value]}" if eq and value in paths else arg


def _role_of(objs, account: str) -> dict:
    """The one Role bound to ServiceAccount `account` (and the binding names it)."""
    bindings = [
        b
        for b in find(objs, "RoleBinding")
        if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in b["subjects"]
    ]
    assert len(bindings) == 1, f"{account}: {len(bindings)} RoleBindings"
    assert not find(objs, "ClusterRoleBinding")
    return one(objs, "Role", bindings[0]["roleRef"]["name"])


def _grants(role: dict) -> set[tuple[str, str]]:
    """(resource, verb) pairs of a core-group Role."""
    assert all(r["apiGroups"] == [""] for r in role["rules"]), role["metadata"]["name"]
    return {(res, v) for r in role["rules"] for res in r["resources"] for v in r["verbs"]}


def _token_volumes(spec: dict) -> list[dict]:
    return [
        v["secret"]
        for v in spec.get("volumes", [])
        if "secret" in v and v["secret"]["secretName"].startswith(TOKEN_SECRET)
    ]


def _syncer(objs) -> tuple[dict, dict]:
    """(the StatefulSet, its `grpc` container port)."""
    sts = one(objs, "StatefulSet", "atoll-syncer")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return sts, {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]


@needs_kubectl
@pytest.mark.parametrize("components", VARIANTS, ids="+".join)
def test_operator_objects_validate_strictly(components):
    for o in render("syncer", components):
        if o["metadata"]["labels"].get("app.kubernetes.io/component") in ("operator", "reshard"):
            for kubernetes in KUBERNETES_VERSIONS:
                validate(o, kubernetes)


@needs_kubectl
@pytest.mark.parametrize("components", VARIANTS, ids="+".join)
def test_each_job_has_its_own_rights(components):
    """Status reads, chaos also deletes pods, reshard has no API token at all."""
    objs = render("syncer", components)
    status, _ = _job(objs, "atoll-status")
    chaos, _ = _job(objs, "atoll-chaos")
    reshard, _ = _job(objs, "atoll-reshard")
    assert status["serviceAccountName"] != chaos["serviceAccountName"]
    namespace = {("namespaces", "get")}
    read = _grants(_role_of(objs, status["serviceAccountName"]))
    assert read == namespace | {("pods", "get"), ("pods", "list")}
    assert _grants(_role_of(objs, chaos["serviceAccountName"])) == read | {("pods", "delete")}
    for role in find(objs, "Role"):  # the namespace rule names the run's namespace alone
        for r in role["rules"]:
            if "namespaces" in r["resources"]:
                assert r["resourceNames"] == [NAMESPACE]
    assert status["automountServiceAccountToken"] is chaos["automountServiceAccountToken"] is True
    assert reshard["automountServiceAccountToken"] is False
    assert reshard.get("serviceAccountName", "default") == "default"
    # an account mounts its token only where a Job asks for it
    for account in find(objs, "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False


@needs_kubectl
@pytest.mark.parametrize("components", VARIANTS, ids="+".join)
def test_only_the_operator_token_is_mounted(components):
    """The Secret's `token` key holds every learner's token: no operator Job may see it."""
    objs = render("syncer", components)
    for name in ("atoll-status", "atoll-reshard"):
        spec, c = _job(objs, name)
        (secret,) = _token_volumes(spec)
        assert secret["items"] == [{"key": "operator-token", "path": "operator-token"}], name
        token = next(v["name"] for v in spec["volumes"] if v.get("secret") == secret)
        assert _flag(c, "--token-file") == f"{_mount(c, token)}/operator-token", name
    chaos, _ = _job(objs, "atoll-chaos")
    assert _token_volumes(chaos) == []  # /metrics needs no token


@needs_kubectl
@pytest.mark.parametrize("components", VARIANTS, ids="+".join)
def test_status_dials_shards_by_their_certificate_names(components):
    """The headless Service's per-pod names (what the drain dials and the certificate holds),
    at the pod's `grpc` port; never the pod IP, which the certificate does not name."""
    from atoll.cluster.drain import DEFAULT_DRAIN_SHARDS

    objs = render("syncer", components)
    sts, grpc = _syncer(objs)
    headless = one(objs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    _, c = _job(objs, "atoll-status")
    args = atoll_parser().parse_args(
        [k8s_expand(a, {"POD_NAMESPACE": NAMESPACE}) for a in c["args"]]
    )
    assert args.command == "status" and not args.shards and args.namespace == NAMESPACE
    for i in range(3):
        pod = f"{sts['metadata']['name']}-{i}"
        address = args.address_template.format(
            pod=pod, ip="10.0.0.7", port=grpc, namespace=NAMESPACE, index=i
        )
        assert address == f"{pod}.{headless['metadata']['name']}:{grpc}"
        assert address == DEFAULT_DRAIN_SHARDS.replace("{i}", str(i))
    if "tls" in components:
        assert str(args.tls_ca) == f"{_mount(c, 'tls')}/ca.crt"


@needs_kubectl
@pytest.mark.parametrize("components", VARIANTS, ids="+".join)
def test_reshard_job_is_a_valid_reshard(components, tmp_path, monkeypatch):
    """Suspended; its N from the ConfigMap atoll-reshard; the args, expanded as the kubelet
    does, are accepted by `atoll reshard` itself up to the point it dials the shards."""
    from atoll.cluster import reshard
    from atoll.cluster.drain import DEFAULT_DRAIN_SHARDS

    objs = render("syncer", components)
    job = one(objs, "Job", "atoll-reshard")
    assert job["spec"]["suspend"] is True
    spec, c = _job(objs, "atoll-reshard")
    (env,) = c["env"]
    ref = env["valueFrom"]["configMapKeyRef"]
    assert (ref["name"], ref["key"]) == ("atoll-reshard", "to")
    assert not find(objs, "ConfigMap", "atoll-reshard")  # the operator's, never reset by apply

    # the same shards, by the same names, as the shards' own drain
    sts, grpc = _syncer(objs)
    pattern = _flag(c, "--shards")
    assert pattern == f"{sts['metadata']['name']}-{{i}}.{sts['spec']['serviceName']}:{grpc}"
    assert pattern == DEFAULT_DRAIN_SHARDS

    # the files the pod mounts, here
    token = tmp_path / "operator-token"
    token.write_text("operator-token-0123456789abcdef0123")  # the key holds a bare line
    (tmp_path / "ca.crt").write_text("pem")
    local = {f"{_mount(c, 'token')}/operator-token": str(token)}
    if "tls" in components:
        local[f"{_mount(c, 'tls')}/ca.crt"] = str(tmp_path / "ca.crt")
    argv = [_here(k8s_expand(a, {env["name"]: "4"}), local) for a in c["args"]]
    parser = atoll_parser()
    args = parser.parse_args(argv)
    assert args.command == "reshard" and args.to == 4
    assert (args.tls_ca is not None) == ("tls" in components) and args.tls_cert is None
    ran = []
    monkeypatch.setattr(reshard, "run", lambda *a: ran.append(a) or 0)
    assert reshard.main(args, parser) == 0
    ((spec_given, to, operator, tls),) = ran
    assert (spec_given, to, operator) == (pattern, 4, token.read_text())
    assert (tls is not None) == ("tls" in components)

    # Started before the ConfigMap exists, `--to` stays unexpanded: a flag error (exit 2),
    # which fails the Job at once instead of retrying.
    with pytest.raises(SystemExit) as e:
        parser.parse_args([k8s_expand(a, {}) for a in c["args"]])
    assert e.value.code == 2
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"] == {
        "containerName": c["name"],
        "operator": "In",
        "values": [2],
    }
    assert spec["restartPolicy"] == "Never"  # what a podFailurePolicy needs


@needs_kubectl
@pytest.mark.parametrize("components", VARIANTS, ids="+".join)
def test_network_policy_admits_the_reshard_job_to_grpc_alone(components):
    """Some policy on the shards admits the reshard pods to `grpc` (from this namespace), and
    none admits them anywhere else: it needs nothing more."""
    objs = render("syncer", components)
    sts, _ = _syncer(objs)
    shard_labels = sts["spec"]["template"]["metadata"]["labels"]
    pod_labels = one(objs, "Job", "atoll-reshard")["spec"]["template"]["metadata"]["labels"]
    ports = set()
    for policy in find(objs, "NetworkPolicy"):
        if not _selects(policy["spec"]["podSelector"], shard_labels):
            continue
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                if "podSelector" in peer and _selects(peer["podSelector"], pod_labels):
                    # no namespaceSelector: the policy's own namespace, the Job's
                    assert "namespaceSelector" not in peer, policy["metadata"]["name"]
                    ports |= {p["port"] for p in rule["ports"]}
    assert ports == {"grpc"}
