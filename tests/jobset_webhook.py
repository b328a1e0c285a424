"""What the JobSet admission webhook of the JobSet version atoll requires refuses.

JobSet v0.12.0, pkg/webhooks/jobset_webhook.go (kubernetes-sigs/jobset, tag v0.12.0): the
mutating webhook's `Default`, then the validating webhook's `ValidateCreate`, with the
feature gates of a default install (pkg/features/features.go: RestartJob, InPlaceRestart
and ElasticJobSet are alpha and off). The CRD schema (tests/data/) admits things this
webhook refuses, `RestartJob` first of all, so every rendered JobSet passes both.

Written down by hand from that source: when atoll requires another JobSet version, read its
webhook again and update this file (and the version named in docs/kubernetes.md).
"""

from __future__ import annotations

import copy
import re

VERSION = "v0.12.0"
# pkg/features/features.go at v0.12.0: every gate that decides admission, as installed.
DEFAULT_GATES = frozenset()  # RestartJob, InPlaceRestart: alpha, off by default
MAX_INT32 = 2**31 - 1
MAX_REPLICAS_PER_REPLICATED_JOB = 1024  # maxReplicasPerReplicatedJob, with RestartJob
MAX_MANAGED_BY = 63
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
VALID_JOB_FAILURE_REASONS = (
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)
RESTART_JOB_ACTIONS = ("RestartJob", "RestartJobAndIgnoreMaxRestarts")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")


def _dns1035_label(value: str) -> list[str]:
    problems = []
    if len(value) > 63:
        problems.append("must be no more than 63 characters")
    if not _DNS1035.match(value):
        problems.append("must be a DNS-1035 label")
    return problems


def defaulted(jobset: dict) -> dict:
    """The JobSet after the mutating webhook (`Default`): what `ValidateCreate` sees."""
    js = copy.deepcopy(jobset)
    spec = js["spec"]
    spec.setdefault("successPolicy", {"operator": "All"})
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    for rj in spec.get("replicatedJobs", []):
        rj.setdefault("groupName", "default")  # the CRD's default, applied before the webhook
        rj.setdefault("replicas", 1)
        job = rj["template"].setdefault("spec", {})
        job.setdefault("completionMode", "Indexed")
        job["template"].setdefault("spec", {}).setdefault("restartPolicy", "OnFailure")
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    for i, rule in enumerate((spec.get("failurePolicy") or {}).get("rules", [])):
        if not rule.get("name"):
            rule["name"] = f"failurePolicyRule{i}"
    return js


def _failure_policy_errors(spec: dict, names: set[str], gates: frozenset[str]) -> list[str]:
    policy = spec.get("failurePolicy")
    if policy is None:
        return []
    errors = []
    rules = policy.get("rules", [])
    if any(r.get("action") in RESTART_JOB_ACTIONS for r in rules):
        if "RestartJob" not in gates:
            # The webhook returns here: nothing else about the policy is checked.
            return [
                "RestartJob and RestartJobAndIgnoreMaxRestarts failure policy actions are not "
                "allowed when RestartJob feature gate is disabled"
            ]
        if any(rj["replicas"] > MAX_REPLICAS_PER_REPLICATED_JOB for rj in spec["replicatedJobs"]):
            errors.append(
                "JobSet cannot have a failure policy rule with RestartJob or "
                f"RestartJobAndIgnoreMaxRestarts action and a replicated job with replicas > "
                f"{MAX_REPLICAS_PER_REPLICATED_JOB}"
            )
    seen: dict[str, int] = {}
    for rule in rules:
        name = rule["name"]
        if not 1 <= len(name) <= 128:
            errors.append(f"invalid failure policy rule name of length {len(name)}")
        if not RULE_NAME.match(name):
            errors.append(f"invalid failure policy rule name {name!r}")
        seen[name] = seen.get(name, 0) + 1
        for target in rule.get("targetReplicatedJobs", []):
            if target not in names:
                errors.append(f"invalid replicatedJob name {target!r} in failure policy")
        for reason in rule.get("onJobFailureReasons", []):
            if reason not in VALID_JOB_FAILURE_REASONS:
                errors.append(f"invalid job failure reason {reason!r} in failure policy")
    errors += [f"rule names are not unique: {n!r}" for n, count in seen.items() if count > 1]
    return errors


def _coordinator_errors(js: dict) -> list[str]:
    coordinator = js["spec"]["coordinator"]
    by_name = {rj["name"]: rj for rj in js["spec"]["replicatedJobs"]}
    rj = by_name.get(coordinator.get("replicatedJob"))
    if rj is None:
        return [f"coordinator replicatedJob {coordinator.get('replicatedJob')} does not exist"]
    job = rj["template"]["spec"]
    if not 0 <= coordinator.get("jobIndex", 0) < rj["replicas"]:
        return ["coordinator job index is invalid"]
    if job.get("completionMode") != "Indexed" or job.get("completions") is None:
        return ["job for coordinator pod must be indexed completion mode, with completions"]
    if not 0 <= coordinator.get("podIndex", 0) < job["completions"]:
        return ["coordinator pod index is invalid"]
    return []


def admission_errors(jobset: dict, gates: frozenset[str] = DEFAULT_GATES) -> list[str]:
    """Why JobSet `VERSION`'s webhook refuses to create `jobset` (empty: admitted)."""
    js = defaulted(jobset)
    spec, name = js["spec"], js["metadata"]["name"]
    errors = []
    if (spec.get("failurePolicy") or {}).get("restartStrategy") == "InPlaceRestart" and (
        "InPlaceRestart" not in gates
    ):
        errors.append("InPlaceRestart restart strategy needs the InPlaceRestart feature gate")
    rjobs = spec.get("replicatedJobs", [])
    if rjobs and rjobs[0].get("dependsOn") is not None:
        errors.append("DependsOn can't be set for the first ReplicatedJob")
    subdomain = spec["network"].get("subdomain", "")
    if subdomain:
        if len(subdomain) > 253 or not _DNS1123_SUBDOMAIN.match(subdomain):
            errors.append(f"spec.network.subdomain {subdomain!r} is not a DNS-1123 subdomain")
        errors += [f"spec.network.subdomain: {p}" for p in _dns1035_label(subdomain)]
    manager = spec.get("managedBy")
    if manager is not None and (len(manager) > MAX_MANAGED_BY or "/" not in manager):
        errors.append(f"spec.managedBy {manager!r}: a domain-prefixed path of at most 63")
    names: set[str] = set()
    for rj in rjobs:
        names.add(rj["name"])
        job = rj["template"]["spec"]
        if job.get("parallelism", 1) * rj["replicas"] > MAX_INT32:
            errors.append(f"{rj['name']}: replicas x parallelism exceeds {MAX_INT32}")
        errors += [f"{rj['name']}: groupName {p}" for p in _dns1035_label(rj["groupName"])]
        # placement.GenJobName / GenPodName, at the largest indices, plus a pod's 5 characters.
        longest_job = f"{name}-{rj['name']}-{rj['replicas'] - 1}"
        errors += [f"job name {longest_job!r} {p}" for p in _dns1035_label(longest_job)]
        if job.get("completionMode") == "Indexed" and job.get("completions") is not None:
            longest_pod = f"{longest_job}-{job['completions'] - 1}-abcde"
            errors += [f"pod name {longest_pod!r} {p}" for p in _dns1035_label(longest_pod)]
        for dep in rj.get("dependsOn") or []:
            if dep["name"] not in names:
                errors.append(f"replicatedJob {rj['name']} cannot depend on {dep['name']}")
    for target in spec["successPolicy"].get("targetReplicatedJobs", []):
        if target not in names:
            errors.append(f"invalid replicatedJob name {target!r} in the success policy")
    errors += _failure_policy_errors(spec, names, gates)
    if spec.get("coordinator") is not None:
        errors += _coordinator_errors(js)
    return errors
