"""The forms of a Ray cluster address that ``ray.init(address=...)`` accepts, checked without connecting.

Ray 2.x reads ``address`` as follows (``ray._private.worker.init``, ``ray.client_builder``,
``ray._private.services.canonicalize_bootstrap_address``): ``auto`` (a running cluster, found through
``RAY_ADDRESS`` or the last ``ray start``) and ``local`` (a new instance); an address with ``://`` is a
Ray Client address: ``ray://host[:port]``, or ``<module>://...`` for a Python module that provides a
``ClientBuilder`` (``http://`` and ``https://`` are refused); anything else must be the GCS address
``host:port`` (``[v6 address]:port`` for IPv6), else Ray raises ``ValueError: Invalid address format``.
"""

from __future__ import annotations

import importlib.util

from moerl.configlib import ConfigError

FORMS = "expected host:port, ray://host:port, auto or local (the forms ray.init takes)"


def ray_head(address: str) -> tuple[str, int] | None:
    """The ``(host, port)`` that ``address`` connects to, for a probe before ``ray.init``; None for
    ``auto``, ``local``, a ``ray://host`` without port and another module's client address (left to Ray).

    Raises:
        ConfigError: ``runtime.ray_address=...`` in a form Ray refuses (one line listing the forms), or a
            port that is not a number in 1-65535.
    """
    if address in ("auto", "local"):
        return None
    if "://" in address:
        scheme, _, inner = address.partition("://")
        if scheme in ("http", "https"):
            raise ConfigError(
                f"runtime.ray_address={address!r} is an HTTP address (the dashboard's?); Ray connects to the "
                "GCS address host:port (port 6379 by default) or ray://host:10001"
            )
        if scheme != "ray":
            if not scheme.isidentifier() or _find_module(scheme) is None:
                raise ConfigError(f"runtime.ray_address={address!r}: no Ray client for {scheme}://; {FORMS}")
            return None
        if ":" not in inner.rsplit("]", 1)[-1]:
            return None if inner.strip() else _refuse(address)
        return _host_port(address, inner)
    return _host_port(address, address)


def _find_module(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _host_port(address: str, target: str) -> tuple[str, int]:
    if target.startswith("["):  # IPv6: [host]:port
        host, sep, port = target[1:].partition("]:")
        if not sep:
            _refuse(address)
    elif target.count(":") == 1:
        host, port = target.split(":")
    else:
        _refuse(address)
    if not host.strip() or not port.isdigit() or not 0 < int(port) < 65536:
        _refuse(address)
    return host, int(port)


def _refuse(address: str):
    raise ConfigError(f"runtime.ray_address={address!r}: {FORMS}")
