"""Cluster deployment: Kubernetes manifests (KubeRay, eksctl, EFA, alert rules), a TorchX component,
and the Ray resource mapping that keeps each actor on its node group. See ``moerl.config_cluster``."""
