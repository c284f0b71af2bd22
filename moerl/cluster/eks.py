"""The EKS side of a deployment: the eksctl ``ClusterConfig`` and the EFA device-plugin ``DaemonSet``.

One managed node group per worker group, all in the first Availability Zone of
``cluster.availability_zones`` (EFA and GPUDirect RDMA need the training nodes in one zone and one
placement group; eksctl makes the placement group for an ``efaEnabled`` group). GPU groups are tainted
``nvidia.com/gpu=true:NoSchedule``; the rollout group is Spot capacity. The pods' service account gets
an IAM role for S3 through IRSA (``iam.withOIDC``). Nodes come and go with the Kubernetes Cluster
Autoscaler (``withAddonPolicies.autoScaler``; docs/cluster.md installs it), which follows the Ray pods the
KubeRay autoscaler adds or removes.

The service account's IAM role has one inline policy: the run's S3 bucket and prefixes only
(``moerl.cluster.iam.s3_policy``), plus ``cluster.s3_policy_arn`` when one is set.
"""

from __future__ import annotations

from moerl.cluster.iam import s3_policy
from moerl.cluster.kuberay import GPU_TAINT, GROUP_LABEL
from moerl.cluster.resources import run_groups
from moerl.config import RunConfig
from moerl.config_cluster import NodeGroupConfig

EFA_PLUGIN_NAME = "aws-efa-k8s-device-plugin"


def managed_node_group(cfg: RunConfig, group: str) -> dict:
    """The eksctl ``managedNodeGroups`` entry of ``group``."""
    cluster = cfg.cluster
    spec: NodeGroupConfig = getattr(cluster, group)
    node_group = {
        "name": f"{group}",
        "instanceTypes": list(spec.instance_types),
        "minSize": spec.min_nodes,
        "maxSize": spec.max_nodes,
        "desiredCapacity": spec.min_nodes,
        "availabilityZones": [cluster.zone],
        "privateNetworking": True,
        "disableIMDSv1": True,  # IMDSv2 only; the workers poll it with session tokens
        "volumeSize": spec.volume_gib,
        "spot": spec.spot,
        "labels": {GROUP_LABEL: group},
        "tags": {
            "moerl.io/group": group,
            f"k8s.io/cluster-autoscaler/node-template/label/{GROUP_LABEL}": group,
        },
        "iam": {"withAddonPolicies": {"autoScaler": True, "cloudWatch": True}},
    }
    if spec.gpus_per_node and cluster.taint_gpu_nodes:
        node_group["taints"] = [dict(GPU_TAINT)]
    if spec.efa_interfaces:
        node_group["efaEnabled"] = True
    return node_group


def eksctl_cluster_config(cfg: RunConfig) -> dict:
    """The eksctl ``ClusterConfig`` (apiVersion ``eksctl.io/v1alpha5``) of the deployment.

    Raises:
        ConfigError: the run's S3 URLs are not valid (``moerl.cluster.iam.s3_policy``).
    """
    cluster = cfg.cluster
    account = {
        "metadata": {"name": cluster.service_account, "namespace": cluster.namespace},
        "attachPolicy": s3_policy(cfg),  # inline: the run's bucket and prefixes, nothing else
    }
    if cluster.s3_policy_arn is not None:
        account["attachPolicyARNs"] = [cluster.s3_policy_arn]
    return {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {
            "name": cluster.name,
            "region": cluster.region,
            "version": cluster.kubernetes_version,
            "tags": {"app": "moerl"},
        },
        "availabilityZones": list(cluster.availability_zones),
        "iam": {
            "withOIDC": True,
            "serviceAccounts": [account],
        },
        "addons": [{"name": "vpc-cni"}, {"name": "coredns"}, {"name": "kube-proxy"}],
        "managedNodeGroups": [managed_node_group(cfg, g) for g in run_groups(cfg)],
    }


def efa_device_plugin(cfg: RunConfig) -> dict:
    """The EFA Kubernetes device plugin ``DaemonSet`` on the groups with EFA (advertises
    ``vpc.amazonaws.com/efa`` to the kubelet through ``/var/lib/kubelet/device-plugins``)."""
    cluster = cfg.cluster
    efa_groups = [g for g in run_groups(cfg) if getattr(cluster, g).efa_interfaces]
    labels = {"name": EFA_PLUGIN_NAME}
    container = {
        "name": EFA_PLUGIN_NAME,
        "image": cluster.efa_plugin_image,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "resources": {"requests": {"cpu": "10m", "memory": "20Mi"}},
        "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"}],
    }
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": GROUP_LABEL, "operator": "In", "values": efa_groups}]}
                ]
            }
        }
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": EFA_PLUGIN_NAME, "namespace": "kube-system", "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "priorityClassName": "system-node-critical",
                    "hostNetwork": True,
                    "affinity": affinity,
                    "tolerations": [
                        {"key": "CriticalAddonsOnly", "operator": "Exists"},
                        {"key": GPU_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"},
                    ],
                    "containers": [container],
                    "volumes": [
                        {"name": "device-plugin", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}
                    ],
                },
            },
        },
    }
