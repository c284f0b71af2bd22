"""Least-privilege S3 access of a cluster run: the IAM policy document of its pods' service account.

A run touches S3 under a few URLs of its config, and nothing else:

    storage.url          read + write   the run folders (<url>/<name>-<timestamp>: checkpoints, metrics, ...)
    runtime.store_url    read + write   the weight store, when it is not under the run folder
    cluster.resume_from  read + write   the stored run a job continues (it writes there again)
    cluster.model_url    read           the Hugging Face folder the train pods copy (``moerl.cluster.fetch``)

The policy (IAM JSON policy grammar, ``Version`` 2012-10-17) grants, per bucket: ``s3:ListBucket`` on the
bucket only for keys under those prefixes (``Condition`` ``StringLike`` on ``s3:prefix``) and the bucket's
location; and on the objects under each prefix (``bucket/prefix/*``)
``s3:GetObject`` (read) plus ``s3:PutObject``, ``s3:DeleteObject``, ``s3:AbortMultipartUpload`` and
``s3:ListMultipartUploadParts`` (write; a multipart upload's create, part and complete calls are
``s3:PutObject``). No wildcard action, no other bucket, no ``AmazonS3FullAccess``.
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/example-policies-s3.html)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moerl.config import ConfigError, RunConfig

VERSION = "2012-10-17"
"""The IAM policy language version."""
READ_ACTIONS = ("s3:GetObject",)
"""Object actions of a read-only prefix."""
WRITE_ACTIONS = (
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
)
"""Object actions of a read-write prefix."""
BUCKET_ACTIONS = ("s3:GetBucketLocation",)
"""Bucket actions granted without a prefix condition (the SDKs look up a bucket's region; it names no
object)."""

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True, slots=True)
class S3Prefix:
    """One place a run reads or writes: a bucket and a key prefix ("" for the whole bucket)."""

    bucket: str
    prefix: str
    is_write: bool


def parse_s3_url(field: str, url: str, *, is_write: bool) -> S3Prefix:
    """``s3://bucket[/prefix]`` of config field ``field`` as an ``S3Prefix`` (trailing slashes dropped).

    Raises:
        ConfigError: not an ``s3://`` URL, or a bucket name S3 does not allow (3-63 characters of
            lowercase letters, digits, dots and hyphens).
    """
    if not url.startswith("s3://"):
        raise ConfigError(f"{field}={url!r} is not an s3:// URL")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not _BUCKET.match(bucket):
        raise ConfigError(f"{field}={url!r}: {bucket!r} is not an S3 bucket name")
    return S3Prefix(bucket, prefix.strip("/"), is_write)


def run_prefixes(cfg: RunConfig) -> list[S3Prefix]:
    """The S3 places of a cluster run (module docstring), in the order of the table there.

    Raises:
        ConfigError: a URL that is not a valid ``s3://`` URL (``parse_s3_url``).
    """
    places = [
        ("storage.url", cfg.storage.url, True),
        ("runtime.store_url", cfg.runtime.store_url, True),
        ("cluster.resume_from", cfg.cluster.resume_from, True),
        ("cluster.model_url", cfg.cluster.model_url, False),
    ]
    return [parse_s3_url(f, url, is_write=w) for f, url, w in places if url is not None]


def _sid(*parts: str) -> str:
    return "".join(re.sub(r"[^A-Za-z0-9]", " ", p).title().replace(" ", "") for p in parts)[:100]


def s3_policy(cfg: RunConfig) -> dict:
    """The IAM policy document (a JSON-ready dict) that grants the run's pods its S3 places only.

    Raises:
        ConfigError: no S3 place (``storage.url`` is not in S3), or an invalid S3 URL.
    """
    places = run_prefixes(cfg)
    if not places:
        raise ConfigError("storage.url is not an s3:// URL: a cluster run's S3 access has nothing to grant")
    statements = []
    for bucket in dict.fromkeys(p.bucket for p in places):
        mine = [p for p in places if p.bucket == bucket]
        arn = f"arn:aws:s3:::{bucket}"
        listing = {
            "Sid": _sid("list", bucket),
            "Effect": "Allow",
            "Action": ["s3:ListBucket"],
            "Resource": [arn],
        }
        if all(p.prefix for p in mine):
            keys = list(dict.fromkeys(k for p in mine for k in (p.prefix, f"{p.prefix}/*")))
            listing["Condition"] = {"StringLike": {"s3:prefix": keys}}
        statements.append(listing)
        statements.append(
            {
                "Sid": _sid("bucket", bucket),
                "Effect": "Allow",
                "Action": list(BUCKET_ACTIONS),
                "Resource": [arn],
            }
        )
        for is_write in (True, False):
            objects = [
                f"{arn}/{p.prefix}/*" if p.prefix else f"{arn}/*" for p in mine if p.is_write == is_write
            ]
            if objects:
                statements.append(
                    {
                        "Sid": _sid("write" if is_write else "read", bucket),
                        "Effect": "Allow",
                        "Action": list(WRITE_ACTIONS if is_write else READ_ACTIONS),
                        "Resource": list(dict.fromkeys(objects)),
                    }
                )
    return {"Version": VERSION, "Statement": statements}
