"""``moerl cluster render``: every manifest validates against the real schemas, and maps the run.

KubeRay CRDs (../shared/schemas/kuberay) and the eksctl schema (../shared/schemas/eksctl) are read from
the shared folder (skipped without it); core kinds are validated by ``kubernetes-validate``. The CRD
schemas are made strict (unknown fields rejected, like ``kubectl apply --validate=strict``), and the pod
templates inside the RayJob are validated as core ``PodTemplate`` objects too.
"""

import copy
import functools
import json
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from _needs import program

from moerl.cli import main
from moerl.cluster.kuberay import NOTICE_FILE, grace_period_s
from moerl.cluster.render import cluster_run_config, manifests, render
from moerl.cluster.resources import RAY_RESOURCE
from moerl.config import ConfigError, load_config

IMAGE = "cluster.image=registry.example/moerl:0.1.0"
"""The image a user built and pushed (``moerl cluster render`` refuses without one)."""

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT.parent / "shared" / "schemas"
RECIPES = [ROOT / "configs" / "cluster_mission.yaml", ROOT / "configs" / "cluster_qwen3_30b_1node.yaml"]
K8S_VERSION = "1.33.0"

needs_schemas = pytest.mark.skipif(not SCHEMAS.is_dir(), reason="../shared/schemas is absent")


def _strict(schema):
    """A copy of an OpenAPI v3 CRD schema that rejects unknown fields (structural schemas prune them)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def _crd_validator(file_name, version="v1"):
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are large: libyaml when present
    crd = yaml.load((SCHEMAS / "kuberay" / file_name).read_text(), Loader=loader)
    (spec,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(_strict(spec["schema"]["openAPIV3Schema"]))


def _core_validate(doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _pod_templates(rayjob):
    spec = rayjob["spec"]["rayClusterSpec"]
    yield "head", spec["headGroupSpec"]["template"]
    for group in spec["workerGroupSpecs"]:
        yield group["groupName"], group["template"]


REWARD = ("reward.model_path=/models/rm", "reward.num_workers=6", "reward.gpus_per_worker=0.5")
"""A learned reward model on 6 reward workers of half a GPU each: the render adds a ``reward`` group."""
CASES = [(p, ()) for p in RECIPES] + [(RECIPES[0], REWARD)]


@pytest.fixture(params=CASES, ids=lambda c: c[0].stem + ("-reward" if c[1] else ""))
def rendered(request, tmp_path):
    cfg = load_config(request.param[0], [IMAGE, *request.param[1]])
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        yaml.safe_dump({"groups": [{"name": "moerl", "rules": [{"alert": "MoerlDown", "expr": "up == 0"}]}]})
    )
    cfg.cluster.alert_rules = str(rules)
    out = tmp_path / "out"
    result = render(cfg, out)
    docs = {str(p.relative_to(out)): yaml.safe_load(p.read_text()) for p in result.files}
    return cfg, docs, result


@needs_schemas
def test_every_manifest_validates(rendered):
    cfg, docs, result = rendered
    assert result.skipped == ()
    policy = docs.pop(
        "iam-s3-policy.json"
    )  # the service account's IAM policy (tests/unit/test_cluster_iam.py)
    assert policy["Version"] == "2012-10-17"
    kinds = sorted(d["kind"] for d in docs.values())
    assert kinds == ["ClusterConfig", "ConfigMap", "DaemonSet", "Namespace", "PrometheusRule", "RayJob"]
    rayjob = docs["k8s/30-rayjob.yaml"]
    errors = list(_crd_validator("ray.io_rayjobs.yaml").iter_errors(rayjob))
    assert errors == [], [e.message for e in errors]
    # the embedded RayCluster spec validates as a RayCluster too
    raycluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "x", "namespace": cfg.cluster.namespace},
        "spec": rayjob["spec"]["rayClusterSpec"],
    }
    assert list(_crd_validator("ray.io_rayclusters.yaml").iter_errors(raycluster)) == []
    for name, template in _pod_templates(rayjob):
        _core_validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
        )
    for name in ("k8s/00-namespace.yaml", "k8s/10-efa-device-plugin.yaml", "k8s/20-run-config.yaml"):
        _core_validate(docs[name])
    eksctl = json.loads((SCHEMAS / "eksctl" / "schema.json").read_text())
    errors = list(jsonschema.Draft7Validator(eksctl).iter_errors(docs["eksctl-cluster.yaml"]))
    assert errors == [], [e.message for e in errors]


@needs_schemas
def test_the_validators_catch_mistakes(rendered):
    """The checks above can fail: a misspelt field, a wrong type, an unknown node group key."""
    import kubernetes_validate

    _, docs, _ = rendered
    rayjob = copy.deepcopy(docs["k8s/30-rayjob.yaml"])
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert list(_crd_validator("ray.io_rayjobs.yaml").iter_errors(rayjob))
    rayjob = copy.deepcopy(docs["k8s/30-rayjob.yaml"])
    rayjob["spec"]["ttlSecondsAfterFinished"] = "soon"
    assert list(_crd_validator("ray.io_rayjobs.yaml").iter_errors(rayjob))
    daemonset = copy.deepcopy(docs["k8s/10-efa-device-plugin.yaml"])
    daemonset["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        _core_validate(daemonset)
    eks = copy.deepcopy(docs["eksctl-cluster.yaml"])
    eks["managedNodeGroups"][0]["spotInstances"] = True
    eksctl = json.loads((SCHEMAS / "eksctl" / "schema.json").read_text())
    assert list(jsonschema.Draft7Validator(eksctl).iter_errors(eks))


def test_groups_map_the_run(rendered):
    cfg, docs, _ = rendered
    c = cfg.cluster
    rayjob = docs["k8s/30-rayjob.yaml"]
    groups = {g["groupName"]: g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert list(groups) == [
        "train",
        "rollout",
        "cpu",
        "memory",
        *(["reward"] if cfg.reward.model_path else []),
    ]
    for name, group in groups.items():
        assert list(group["resources"]) == [RAY_RESOURCE[name]]  # each group advertises its own resource
        assert group["template"]["spec"]["nodeSelector"]["moerl.io/group"] == name
    train = groups["train"]["template"]["spec"]
    limits = train["containers"][0]["resources"]["limits"]
    assert (
        limits["nvidia.com/gpu"] == c.train.gpus_per_node
        and limits["vpc.amazonaws.com/efa"] == c.train.efa_interfaces
    )
    assert train["nodeSelector"]["eks.amazonaws.com/capacityType"] == "ON_DEMAND"
    assert {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"} in train[
        "tolerations"
    ]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in train["volumes"])
    assert groups["train"]["resources"]["train"] == str(c.train.gpus_per_node)
    rollout = groups["rollout"]
    assert (rollout["minReplicas"], rollout["maxReplicas"]) == (c.rollout.min_nodes, c.rollout.max_nodes)
    pod = rollout["template"]["spec"]
    assert pod["nodeSelector"]["eks.amazonaws.com/capacityType"] == "SPOT"
    assert pod["terminationGracePeriodSeconds"] == grace_period_s(cfg) >= cfg.fleet.drain_grace_s
    prestop = " ".join(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"])
    assert NOTICE_FILE in prestop and f"sleep {int(cfg.fleet.drain_grace_s)}" in prestop
    # the run config the job reads watches the file the preStop hook writes, and runs on the job's Ray
    run = yaml.safe_load(docs["k8s/20-run-config.yaml"]["data"]["run.yaml"])
    assert run["fleet"]["notice_file"] == NOTICE_FILE and run["runtime"]["ray_address"] == "auto"
    assert run["fleet"]["imds_url"] == "http://169.254.169.254"
    assert run["storage"]["url"].startswith("s3://") and run["model"]["device"] == "cuda"
    assert json.loads(rayjob["spec"]["entrypointResources"]) == {"train": 0.001}
    eks = {g["name"]: g for g in docs["eksctl-cluster.yaml"]["managedNodeGroups"]}
    assert all(g["availabilityZones"] == [c.zone] for g in eks.values())
    assert (
        eks["train"]["efaEnabled"] is True
        and eks["train"]["spot"] is False
        and eks["rollout"]["spot"] is True
    )
    assert docs["k8s/40-prometheus-rule.yaml"]["spec"]["groups"][0]["rules"][0]["alert"] == "MoerlDown"


def test_mission_recipe_is_the_mission():
    cfg = load_config(RECIPES[0], [IMAGE, IMAGE])
    c = cfg.cluster
    assert (c.train.max_nodes, c.train.gpus_per_node, cfg.rollout.num_workers) == (16, 8, 32)
    assert cfg.model.family == "deepseek_v3" and cfg.model.num_experts // cfg.model.top_k == 32
    assert cfg.storage.url.startswith("s3://")


@pytest.mark.parametrize(
    "override, match",
    [
        ("storage.url=/tmp/runs", "storage.url='/tmp/runs'.*s3://"),
        ("trainer.num_ranks=256", "more than the train group's 128 GPUs"),
        ("trainer.ep_size=48", "does not divide trainer.num_ranks=128"),
        ("cluster.rollout.max_nodes=16", "32 rollout workers .* need 32 rollout nodes"),
        ("cluster.rollout.min_nodes=40", "min_nodes=40 is larger than cluster.rollout.max_nodes=32"),
        ("cluster.availability_zones=[us-west-2a,us-west-2b]", "not in cluster.region"),
        ("cluster.namespace=Moerl_NS", "lower-case letters"),
        ("cluster.image='bad image name with spaces'", "cluster.image=.* is not a container image reference"),
        ("cluster.efa_plugin_image=Repo/Plugin:v1", "cluster.efa_plugin_image=.* not a container image"),
    ],
)
def test_bad_cluster_configs_are_one_line_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        cluster_run_config(load_config(RECIPES[0], [IMAGE, override]))


def test_cli_writes_nothing_on_a_config_error(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(
            [
                "cluster",
                "render",
                "--set",
                IMAGE,
                "--config",
                str(RECIPES[1]),
                "--set",
                "storage.url=null",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "storage.url=None" in capsys.readouterr().err and not out.exists()
    assert main(["cluster", "render", "--set", IMAGE, "--config", str(RECIPES[1]), "--out", str(out)]) == 0
    assert (out / "k8s" / "30-rayjob.yaml").is_file() and not list(out.rglob(".*tmp*"))


def test_resume_from_a_stored_run():
    url = "s3://my-moerl-bucket/runs/qwen3-30b-a3b-20261201-101500"
    docs, _ = manifests(load_config(RECIPES[1], [IMAGE, f"cluster.resume_from={url}"]))
    assert (
        docs["k8s/30-rayjob.yaml"]["spec"]["entrypoint"] == f"moerl train --resume {url} --ray-address auto"
    )
    with pytest.raises(ConfigError, match="resume_from"):
        load_config(RECIPES[1], [IMAGE, "cluster.resume_from=/local/run"])


def test_missing_alert_rules_are_skipped_with_a_note():
    cfg = load_config(RECIPES[1], [IMAGE, "cluster.alert_rules=/nonexistent/rules.yaml"])
    docs, skipped = manifests(cfg)
    assert "k8s/40-prometheus-rule.yaml" not in docs
    assert skipped == ["k8s/40-prometheus-rule.yaml: cluster.alert_rules='/nonexistent/rules.yaml' not found"]


REPO_RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"


@pytest.mark.parametrize("source", ["fixture", "repo"])
def test_prometheus_rule_groups_pass_promtool(rendered, source, tmp_path):
    promtool = program("promtool")
    cfg, docs, _ = rendered
    if source == "repo":
        cfg.cluster.alert_rules = str(REPO_RULES)
        rule = manifests(cfg)[0]["k8s/40-prometheus-rule.yaml"]
        assert rule["spec"]["groups"] == yaml.safe_load(REPO_RULES.read_text())["groups"]
    else:
        rule = docs["k8s/40-prometheus-rule.yaml"]
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    path = tmp_path / "groups.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "up =="}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(path)], capture_output=True).returncode != 0


def test_without_efa_there_is_no_device_plugin_and_no_efa_request():
    cfg = load_config(RECIPES[1], [IMAGE, "cluster.train.efa_interfaces=0", "cluster.alert_rules=null"])
    docs, skipped = manifests(cfg)
    assert "k8s/10-efa-device-plugin.yaml" not in docs
    assert skipped == ["k8s/10-efa-device-plugin.yaml: no group has EFA interfaces"]
    train = docs["k8s/30-rayjob.yaml"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert "vpc.amazonaws.com/efa" not in train["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "efaEnabled" not in docs["eksctl-cluster.yaml"]["managedNodeGroups"][0]


def test_a_reward_model_adds_a_reward_group(rendered):
    cfg, docs, _ = rendered
    eks_groups = {g["name"]: g for g in docs["eksctl-cluster.yaml"]["managedNodeGroups"]}
    ray_groups = {
        g["groupName"]: g for g in docs["k8s/30-rayjob.yaml"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    }
    if cfg.reward.model_path is None:
        assert "reward" not in eks_groups and "reward" not in ray_groups
        return
    assert eks_groups["reward"]["instanceTypes"] == ["g6e.12xlarge"]  # 4 GPUs a node
    assert ray_groups["reward"]["resources"] == {"reward": "8"}  # 4 GPUs / 0.5 GPU per reward worker
    assert eks_groups["reward"]["taints"] and ray_groups["reward"]["minReplicas"] == 1
