"""Copy a Hugging Face model folder from an object store to a local folder: the train pods' init container.

    python3 -m moerl.cluster.fetch s3://bucket/models/Qwen3-30B-A3B /models/Qwen3-30B-A3B \\
        --options '{"client_kwargs": {"region_name": "us-east-1"}}'

The files go to a hidden sibling folder first, which is renamed to the target only once every file is
there, so a reader (``moerl train``'s ``init_from``) never sees half a model; an existing target with a
``config.json`` is kept (a restarted pod does not download again). Any fsspec URL works (``s3://``
through s3fs, ``file://``, ``memory://``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import fsspec


class FetchError(RuntimeError):
    """The source is not a model folder, or a download failed."""


def fetch_model(url: str, dest: str | Path, options: dict | None = None) -> Path:
    """Copy the folder at ``url`` to ``dest`` (see the module docstring); returns ``dest``.

    Args:
        url: fsspec URL of a Hugging Face model folder (``config.json`` at its top).
        dest: local folder to create; its parent is created too.
        options: fsspec options of the URL's filesystem (``storage.options``).

    Raises:
        FetchError: no ``config.json`` at ``url``, or a download failed (nothing is left at ``dest``).
    """
    dest = Path(dest)
    if (dest / "config.json").is_file():
        return dest
    fs, root = fsspec.core.url_to_fs(url.rstrip("/"), **(options or {}))
    if not fs.isfile(f"{root}/config.json"):
        raise FetchError(f"{url}: no config.json there; expected a Hugging Face model folder")
    partial = dest.parent / f".{dest.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for path in fs.find(root):
            target = partial / os.path.relpath(path, root)
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(target))
    except Exception as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise FetchError(f"{url}: download failed ({type(e).__name__}: {e})") from e
    shutil.rmtree(dest, ignore_errors=True)  # a target without config.json: an earlier, broken copy
    partial.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    """``python3 -m moerl.cluster.fetch URL DEST [--options JSON]``; exit 1 with one line on an error."""
    parser = argparse.ArgumentParser(
        prog="python3 -m moerl.cluster.fetch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("url", help="fsspec URL of the model folder, e.g. s3://bucket/models/NAME")
    parser.add_argument("dest", help="local folder to create")
    parser.add_argument("--options", default="{}", help="fsspec options as JSON (storage.options)")
    args = parser.parse_args(argv)
    try:
        path = fetch_model(args.url, args.dest, json.loads(args.options))
    except (FetchError, ValueError) as e:
        print(f"moerl.cluster.fetch: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
