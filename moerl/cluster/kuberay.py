"""The KubeRay ``RayJob`` of a run: a Ray head on the memory group and one worker group per node group.

Every worker group runs one Ray pod per node (the pod requests the node's GPUs, EFA interfaces, most of
its vCPUs and memory) and advertises its Ray custom resource (``moerl.cluster.resources``). The job's
driver (``moerl train``) asks for a training node (``entrypointResources``); the Ray head itself takes
no work (``num-cpus: 0``). The ``rollout`` group runs on Spot nodes between ``min_nodes`` and
``max_nodes`` (the Ray autoscaler's ``minReplicas``/``maxReplicas``) and is drained, not killed: its
pods get a termination grace period longer than ``fleet.drain_grace_s`` and a preStop hook that writes
the termination notice the workers watch (``fleet.notice_file``) and then waits out the drain.

Every pod mounts the run config (the ConfigMap) at ``CONFIG_DIR``: the driver runs on whichever train
pod Ray picks. With ``cluster.model_url`` every train pod first copies the policy's model folder into
its own ``MODEL_DIR`` (an init container, ``moerl.cluster.fetch``): the driver and the trainer ranks on
the other train nodes read ``init_from`` there; the rollout workers get it through the weight store.
"""

from __future__ import annotations

import json
import math

from moerl.cluster.resources import DRIVER_REQUEST, node_resources, run_groups
from moerl.config import RunConfig
from moerl.config_cluster import ClusterConfig, NodeGroupConfig

GROUP_LABEL = "moerl.io/group"
"""Node label (set by eksctl on each managed node group) that the pods select."""
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
"""Taint of the GPU node groups: only pods that tolerate it (moerl's GPU pods) are placed there."""
CONFIG_DIR = "/etc/moerl"
"""Where the run config (ConfigMap) is mounted in every Ray pod (the driver runs on a train pod)."""
MODEL_DIR = "/models"
"""Pod-local folder (an emptyDir) of the train pods that ``cluster.model_url`` is copied into."""
NOTICE_DIR = "/var/run/moerl"
"""Pod-local folder of the termination notice file (an emptyDir shared by the pod's processes)."""
NOTICE_FILE = f"{NOTICE_DIR}/notice.json"
"""The file the preStop hook writes and the rollout workers watch (``fleet.notice_file``)."""
GRACE_MARGIN_S = 30
"""Seconds of termination grace beyond ``fleet.drain_grace_s``: delivering the drained work and exiting."""


def grace_period_s(cfg: RunConfig) -> int:
    """The rollout pods' ``terminationGracePeriodSeconds``: ``ceil(fleet.drain_grace_s) + GRACE_MARGIN_S``."""
    return math.ceil(cfg.fleet.drain_grace_s) + GRACE_MARGIN_S


def model_folder(url: str) -> str:
    """Where the train pods copy the model folder at ``url``: ``MODEL_DIR/<last part of the URL>``."""
    return f"{MODEL_DIR}/{url.rstrip('/').rsplit('/', 1)[-1]}"


def _quantity_gib(gib: int) -> str:
    return f"{gib}Gi"


def _container(cluster: ClusterConfig, name: str, spec: NodeGroupConfig, *, cpus: int, mem_gib: int) -> dict:
    limits: dict[str, str | int] = {"cpu": str(cpus), "memory": _quantity_gib(mem_gib)}
    if spec.gpus_per_node:
        limits["nvidia.com/gpu"] = spec.gpus_per_node
    if spec.efa_interfaces:
        limits["vpc.amazonaws.com/efa"] = spec.efa_interfaces
    mounts = [
        {"name": "notice", "mountPath": NOTICE_DIR},
        {"name": "run-config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    if spec.shm_gib:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return {
        "name": name,
        "image": cluster.image,
        "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "env": [{"name": "AWS_REGION", "value": cluster.region}],
        "volumeMounts": mounts,
    }


def _pod_template(cfg: RunConfig, group: str, container: dict, spec: NodeGroupConfig) -> dict:
    cluster = cfg.cluster
    volumes: list[dict] = [
        {"name": "notice", "emptyDir": {}},
        {"name": "run-config", "configMap": {"name": config_map_name(cfg)}},
    ]
    if spec.shm_gib:
        volumes.append(
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _quantity_gib(spec.shm_gib)}}
        )
    pod = {
        "serviceAccountName": cluster.service_account,
        "nodeSelector": {
            GROUP_LABEL: group,
            "topology.kubernetes.io/zone": cluster.zone,
            "eks.amazonaws.com/capacityType": "SPOT" if spec.spot else "ON_DEMAND",
        },
        "containers": [container],
        "volumes": volumes,
    }
    if spec.gpus_per_node:
        pod["tolerations"] = [{**GPU_TAINT, "operator": "Equal"}]
    return {"metadata": {"labels": {"app.kubernetes.io/name": "moerl", GROUP_LABEL: group}}, "spec": pod}


def _prestop(cfg: RunConfig) -> dict:
    """Write an instance-action notice atomically, then hold the pod while the workers drain."""
    doc = json.dumps({"action": "terminate"})
    script = (
        f"printf '%s' '{doc}' > {NOTICE_FILE}.tmp && mv {NOTICE_FILE}.tmp {NOTICE_FILE}; "
        f"sleep {math.ceil(cfg.fleet.drain_grace_s)}"
    )
    return {"preStop": {"exec": {"command": ["/bin/sh", "-c", script]}}}


def fetch_command(cfg: RunConfig) -> list[str]:
    """The command that copies ``cluster.model_url`` to ``model_folder`` (``moerl.cluster.fetch``)."""
    url = cfg.cluster.model_url
    options = json.dumps(cfg.storage.options or {})
    return ["python3", "-m", "moerl.cluster.fetch", url, model_folder(url), "--options", options]


def _add_model_fetch(cfg: RunConfig, pod: dict, container: dict) -> None:
    """An init container that copies the policy's model folder into the pod-local ``MODEL_DIR`` (every
    train pod: the driver and the trainer ranks on other nodes read ``init_from`` there)."""
    pod["volumes"].append({"name": "models", "emptyDir": {}})
    container["volumeMounts"].append({"name": "models", "mountPath": MODEL_DIR, "readOnly": True})
    pod["initContainers"] = [
        {
            "name": "fetch-model",
            "image": cfg.cluster.image,
            "imagePullPolicy": "IfNotPresent",
            "command": fetch_command(cfg),
            "env": [{"name": "AWS_REGION", "value": cfg.cluster.region}],
            "volumeMounts": [{"name": "models", "mountPath": MODEL_DIR}],
        }
    ]


def worker_group(cfg: RunConfig, group: str) -> dict:
    """The KubeRay ``workerGroupSpecs`` entry of ``group`` (one Ray pod per node of the group)."""
    cluster = cfg.cluster
    spec: NodeGroupConfig = getattr(cluster, group)
    container = _container(cluster, "ray-worker", spec, cpus=spec.cpus_per_node, mem_gib=spec.memory_gib)
    template = _pod_template(cfg, group, container, spec)
    if group == "train" and cluster.model_url is not None:
        _add_model_fetch(cfg, template["spec"], container)
    if group == "rollout":
        container["lifecycle"] = _prestop(cfg)
        template["spec"]["terminationGracePeriodSeconds"] = grace_period_s(cfg)
    resources = {name: str(int(amount)) for name, amount in node_resources(cfg, group).items()}
    return {
        "groupName": group,
        "replicas": spec.min_nodes,
        "minReplicas": spec.min_nodes,
        "maxReplicas": spec.max_nodes,
        "rayStartParams": {},
        "resources": resources,
        "template": template,
    }


def head_group(cfg: RunConfig, *, cpus: int = 4, mem_gib: int = 32) -> dict:
    """The head: GCS and dashboard on the memory group, no actors (``num-cpus: 0``)."""
    cluster = cfg.cluster
    spec = cluster.memory
    container = _container(cluster, "ray-head", spec, cpus=cpus, mem_gib=mem_gib)
    container["ports"] = [
        {"containerPort": 6379, "name": "gcs"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
    ]
    template = _pod_template(cfg, "memory", container, spec)
    return {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"}, "template": template}


def config_map_name(cfg: RunConfig) -> str:
    """Name of the ConfigMap holding the run config."""
    return f"{cfg.cluster.name}-{cfg.name}-config".lower().replace("_", "-")[:63].rstrip("-")


def job_name(cfg: RunConfig) -> str:
    """Name of the RayJob: ``<cluster.name>-<run name>`` as a DNS label."""
    return f"{cfg.cluster.name}-{cfg.name}".lower().replace("_", "-")[:47].rstrip("-")


def ray_job(cfg: RunConfig, run_config_file: str = "run.yaml") -> dict:
    """The ``RayJob`` (apiVersion ``ray.io/v1``) that runs ``moerl train`` on its own Ray cluster.

    Args:
        cfg: the run config as the cluster runs it (``moerl.cluster.render.cluster_run_config``).
        run_config_file: key of the run config in the ConfigMap.
    """
    cluster = cfg.cluster
    entrypoint = f"moerl train --config {CONFIG_DIR}/{run_config_file}"
    if cluster.resume_from is not None:  # the stored run's own config, on this job's Ray cluster
        entrypoint = f"moerl train --resume {cluster.resume_from} --ray-address auto"
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {
            "name": job_name(cfg),
            "namespace": cluster.namespace,
            "labels": {"app.kubernetes.io/name": "moerl"},
        },
        "spec": {
            "entrypoint": entrypoint,
            "entrypointResources": json.dumps(DRIVER_REQUEST),
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "backoffLimit": 0,
            "rayClusterSpec": {
                "rayVersion": cluster.ray_version,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 300},
                "headGroupSpec": head_group(cfg),
                "workerGroupSpecs": [worker_group(cfg, g) for g in run_groups(cfg)],
            },
        },
    }
