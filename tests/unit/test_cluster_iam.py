"""The rendered S3 access of a cluster run: an IAM policy document (JSON policy grammar) that grants the
run's bucket and prefixes only, inlined in the eksctl service account; no AmazonS3FullAccess; and no
render without an image."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import yaml

from moerl.cluster.render import render
from moerl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "configs" / "cluster_qwen3_30b_1node.yaml"
RUN = [
    "cluster.image=registry.example/moerl:0.1.0",
    "storage.url=s3://run-bucket/team/runs",
    "cluster.model_url=s3://model-bucket/models/Qwen3-30B-A3B",
]


def _check_policy_grammar(doc) -> None:
    """The IAM JSON policy grammar's structure (Version, Statement: Sid, Effect, Action, Resource,
    Condition), as IAM's validator reads it; Allow statements only, S3 actions and ARNs only."""
    assert set(doc) == {"Version", "Statement"} and doc["Version"] == "2012-10-17"
    assert isinstance(doc["Statement"], list) and doc["Statement"]
    sids = [s["Sid"] for s in doc["Statement"]]
    assert len(sids) == len(set(sids)) and all(sid.isalnum() for sid in sids)
    for s in doc["Statement"]:
        assert set(s) <= {"Sid", "Effect", "Action", "Resource", "Condition"} and s["Effect"] == "Allow"
        assert s["Action"] and all(a.startswith("s3:") and "*" not in a for a in s["Action"]), s
        assert s["Resource"] and all(r.startswith("arn:aws:s3:::") for r in s["Resource"]), s
        assert all(r.split(":::")[1].split("/")[0] not in ("", "*") for r in s["Resource"]), s
        for operator, conditions in s.get("Condition", {}).items():
            assert operator in ("StringLike", "StringEquals") and all(
                isinstance(v, list) for v in conditions.values()
            )


def allows(doc: dict, action: str, resource: str, prefix: str | None = None) -> bool:
    """Whether ``doc`` allows ``action`` on ``resource`` (an ARN; ``prefix``: the request's ``s3:prefix``
    for ListBucket), by IAM's rules for Allow statements: wildcard match of Resource, StringLike
    conditions on the request's keys (a missing key fails the condition)."""
    for s in doc["Statement"]:
        if action not in s["Action"] or not any(fnmatch.fnmatchcase(resource, r) for r in s["Resource"]):
            continue
        like = s.get("Condition", {}).get("StringLike", {})
        if all(prefix is not None and any(fnmatch.fnmatchcase(prefix, p) for p in v) for v in like.values()):
            return True
    return False


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("render")
    render(load_config(QWEN, RUN), out)
    return out


def test_the_policy_grants_the_runs_bucket_and_prefix_only(rendered):
    doc = json.loads((rendered / "iam-s3-policy.json").read_text())
    _check_policy_grammar(doc)
    run, model = "arn:aws:s3:::run-bucket", "arn:aws:s3:::model-bucket"
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert allows(doc, action, f"{run}/team/runs/qwen3-30b-a3b-20261202/checkpoints/step_50/meta.json")
        assert not allows(doc, action, f"{run}/team/other/x")  # the bucket, but not the prefix
        assert not allows(doc, action, f"{run}/team/runsX/x")  # a sibling that shares the prefix's letters
        assert not allows(doc, action, "arn:aws:s3:::another-bucket/team/runs/x")
    assert allows(doc, "s3:ListBucket", run, prefix="team/runs/")
    assert allows(doc, "s3:ListBucket", run, prefix="team/runs/qwen3-30b-a3b-20261202/weights/")
    assert not allows(doc, "s3:ListBucket", run, prefix="")  # not the whole bucket
    assert not allows(doc, "s3:ListBucket", run)  # nor without a prefix
    assert not allows(doc, "s3:ListBucket", run, prefix="team/other/")
    # the model: read, never written
    assert allows(doc, "s3:GetObject", f"{model}/models/Qwen3-30B-A3B/config.json")
    assert allows(doc, "s3:ListBucket", model, prefix="models/Qwen3-30B-A3B/")
    assert not allows(doc, "s3:PutObject", f"{model}/models/Qwen3-30B-A3B/config.json")
    assert not allows(doc, "s3:DeleteObject", f"{model}/models/Qwen3-30B-A3B/config.json")
    assert not allows(doc, "s3:GetObject", f"{model}/models/Other/config.json")
    assert not any(
        allows(doc, a, "arn:aws:s3:::*") for a in ("s3:GetObject", "s3:ListBucket", "s3:PutObject")
    )


def test_the_service_account_gets_that_policy_and_no_managed_full_access(rendered):
    eksctl = yaml.safe_load((rendered / "eksctl-cluster.yaml").read_text())
    (account,) = eksctl["iam"]["serviceAccounts"]
    assert account["attachPolicy"] == json.loads((rendered / "iam-s3-policy.json").read_text())
    assert "attachPolicyARNs" not in account and "AmazonS3FullAccess" not in json.dumps(eksctl)


def test_a_run_with_its_own_store_and_a_resumed_run_gets_those_prefixes_too(tmp_path):
    overrides = [
        *RUN,
        "runtime.store_url=s3://store-bucket/weights",
        "cluster.resume_from=s3://run-bucket/old/r-1",
    ]
    render(load_config(QWEN, overrides), tmp_path)
    doc = json.loads((tmp_path / "iam-s3-policy.json").read_text())
    _check_policy_grammar(doc)
    assert allows(doc, "s3:PutObject", "arn:aws:s3:::store-bucket/weights/v00000001/model.safetensors")
    assert allows(doc, "s3:PutObject", "arn:aws:s3:::run-bucket/old/r-1/metrics.jsonl")
    assert not allows(doc, "s3:PutObject", "arn:aws:s3:::run-bucket/old/r-2/metrics.jsonl")


def test_full_access_and_a_missing_image_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="AmazonS3FullAccess grants every bucket"):
        load_config(QWEN, [*RUN, "cluster.s3_policy_arn=arn:aws:iam::aws:policy/AmazonS3FullAccess"])
    with pytest.raises(ConfigError, match="cluster.image is unset: moerl publishes no image"):
        render(load_config(QWEN, RUN[1:]), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    extra = "arn:aws:iam::123456789012:policy/kms-decrypt"  # an extra policy of the user's: attached beside
    render(load_config(QWEN, [*RUN, f"cluster.s3_policy_arn={extra}"]), tmp_path / "ok")
    (account,) = yaml.safe_load((tmp_path / "ok" / "eksctl-cluster.yaml").read_text())["iam"][
        "serviceAccounts"
    ]
    assert account["attachPolicyARNs"] == [extra] and account["attachPolicy"]["Statement"]
