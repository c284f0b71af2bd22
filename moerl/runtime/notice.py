"""Termination notices: how a rollout worker learns that its machine is about to go away.

A spot (preemptible) machine gets a short warning before it is reclaimed. moerl watches four kinds of
source, each a ``NoticeSource`` with a non-blocking ``check()``:

- ``SigtermNotice``: the process received SIGTERM (what a node drain, ``kill`` or Kubernetes sends when
  it terminates a pod: SIGTERM, then SIGKILL after the pod's ``terminationGracePeriodSeconds``).
- ``ImdsNotice``: the EC2 instance metadata service, IMDSv2 (a session token from ``PUT
  /latest/api/token``, then ``spot/instance-action`` and ``events/recommendations/rebalance`` with it);
  IMDSv2-only instances, the default for new ones, answer a request without a token with 401.
- ``FileNotice``: a file appeared (a node agent, a test or ``moerl.runtime.chaos`` writes it).
- ``HttpNotice``: an HTTP endpoint answers with a cloud spot ``instance-action`` document, e.g. EC2's
  ``http://169.254.169.254/latest/meta-data/spot/instance-action`` returns
  ``{"action": "terminate", "time": "2026-11-29T12:00:00Z"}`` once the machine is marked, and 404 before.

A ``NoticeWatcher`` polls the file and HTTP sources on a daemon thread every ``poll_s`` seconds (SIGTERM
fires at once) and sets a ``threading.Event``; the worker's loop checks ``watcher.is_set()`` between
scheduler steps and then drains (``moerl.runtime.drain``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from moerl.config import FleetConfig
from moerl.runtime.counters import count_comm_error

log = logging.getLogger(__name__)

_ACTIONS = ("terminate", "stop", "hibernate")


@dataclass(frozen=True, slots=True)
class TerminationNotice:
    """A received notice that this worker's machine will be reclaimed."""

    source: str
    """Where it came from: ``"sigterm"``, ``"file"``, ``"http"``, ``"imds"`` or ``"manual"``."""
    action: str
    """What will happen to the machine: ``"terminate"``, ``"stop"`` or ``"hibernate"``; ``"rebalance"``
    for EC2's rebalance recommendation (an early sign of reclaim, no deadline)."""
    received_at: float
    """``time.monotonic()`` when the notice was seen, in seconds."""
    deadline_epoch_s: float | None = None
    """When the machine goes away, seconds since the Unix epoch (the document's ``time``); None: unknown."""

    def seconds_left(self, now_epoch_s: float | None = None) -> float | None:
        """Seconds until ``deadline_epoch_s`` (may be negative), or None when the notice gave no time."""
        if self.deadline_epoch_s is None:
            return None
        return self.deadline_epoch_s - (time.time() if now_epoch_s is None else now_epoch_s)


def parse_instance_action(text: str, *, source: str, received_at: float) -> TerminationNotice:
    """Parse a spot ``instance-action`` JSON document into a notice.

    Args:
        text: ``{"action": "terminate"|"stop"|"hibernate", "time": "<ISO 8601, UTC>"}``; an empty text
            is a notice without details (action ``terminate``, no deadline).
        source: recorded in the notice.
        received_at: monotonic time of receipt, in seconds.

    Raises:
        ValueError: not JSON, not an object, an unknown ``action`` or an unparsable ``time``.
    """
    if not text.strip():
        return TerminationNotice(source, "terminate", received_at)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"instance-action document is not JSON ({e}): {text[:80]!r}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"instance-action document must be a JSON object, got {text[:80]!r}")
    action = str(doc.get("action", "terminate")).lower()
    if action not in _ACTIONS:
        raise ValueError(
            f"instance-action: unknown action {doc.get('action')!r}; expected one of {list(_ACTIONS)}"
        )
    deadline = None
    if doc.get("time") is not None:
        try:
            when = dt.datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00"))
        except ValueError as e:
            raise ValueError(f"instance-action: time {doc['time']!r} is not ISO 8601") from e
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        deadline = when.timestamp()
    return TerminationNotice(source, action, received_at, deadline)


def instance_action_document(action: str = "terminate", seconds_from_now: float = 120.0) -> str:
    """A spot ``instance-action`` JSON document for a termination ``seconds_from_now`` from now (UTC)."""
    when = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds_from_now)
    return json.dumps({"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")})


class NoticeSource(Protocol):
    """A place to look for a termination notice; ``check`` must not block for long."""

    name: str

    def check(self) -> TerminationNotice | None:
        """The notice if one has been given, else None."""
        ...


class FileNotice:
    """A notice is given when ``path`` exists; its content, if any, is an ``instance-action`` document.

    An unreadable or malformed file still counts as a notice (action ``terminate``, no deadline): a
    half-written notice must not be missed.
    """

    name = "file"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def check(self) -> TerminationNotice | None:
        if not self.path.exists():
            return None
        now = time.monotonic()
        try:
            return parse_instance_action(self.path.read_text(), source=self.name, received_at=now)
        except (OSError, ValueError) as e:
            log.warning("notice file %s is malformed (%s); treating it as a terminate notice", self.path, e)
            return TerminationNotice(self.name, "terminate", now)


class HttpNotice:
    """Polls a metadata endpoint: 200 with an ``instance-action`` document is a notice; 404 means none.

    Connection errors, timeouts and other statuses are not notices; they are counted in ``num_errors``
    and logged once, so an unreachable endpoint never stops a worker.

    Args:
        url: the endpoint (``http://`` or ``https://``).
        timeout_s: socket timeout of one poll, in seconds.
    """

    name = "http"

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpNotice: url {url!r} must start with http:// or https://")
        self.url = url
        self.timeout_s = timeout_s
        self.num_errors = 0

    def check(self) -> TerminationNotice | None:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:
                body = resp.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            if e.code == 401:  # IMDSv2 wants a session token: ImdsNotice does the token exchange
                self._error("HTTP 401 (an IMDSv2-only metadata service: set fleet.imds_url instead)")
            elif e.code != 404:
                self._error(f"HTTP {e.code}")
            return None
        except (urllib.error.URLError, OSError) as e:
            self._error(repr(e))
            return None
        try:
            return parse_instance_action(body, source=self.name, received_at=time.monotonic())
        except ValueError as e:
            self._error(str(e))
            return None

    def _error(self, what: str) -> None:
        if self.num_errors == 0:
            log.warning("notice endpoint %s: %s (further errors are counted, not logged)", self.url, what)
        self.num_errors += 1
        count_comm_error("provider")  # moerl_comm_errors_total{kind="provider"}, via the heartbeat


class ImdsNotice:
    """Polls the EC2 instance metadata service with IMDSv2 session tokens.

    One poll: a token (``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``, reused
    until shortly before its TTL ends, fetched again after a 401), then ``GET
    /latest/meta-data/spot/instance-action`` with the token (200: an ``instance-action`` document, a
    notice; 404: none), then, if ``rebalance``, ``GET /latest/meta-data/events/recommendations/rebalance``
    (200 with ``{"noticeTime": ...}``: a notice with action ``rebalance``; 404: none). Errors are counted
    in ``num_errors`` and logged once, never notices (as ``HttpNotice``).

    Args:
        base_url: the service, ``http://169.254.169.254`` on EC2 (a pod reaches it when the node's
            metadata hop limit is 2).
        rebalance: treat a rebalance recommendation as a notice.
        token_ttl_s: lifetime asked for each token, seconds (IMDS allows 1 to 21600).
        timeout_s: socket timeout of one request, seconds.
    """

    name = "imds"
    TOKEN_PATH = "/latest/api/token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"

    def __init__(
        self, base_url: str, *, rebalance: bool = True, token_ttl_s: int = 21600, timeout_s: float = 2.0
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"ImdsNotice: base_url {base_url!r} must start with http:// or https://")
        if not 1 <= token_ttl_s <= 21600:
            raise ValueError(f"ImdsNotice: token_ttl_s={token_ttl_s} must be in [1, 21600] seconds")
        self.base_url = base_url.rstrip("/")
        self.rebalance = rebalance
        self.token_ttl_s = token_ttl_s
        self.timeout_s = timeout_s
        self.num_errors = 0
        self._token: str | None = None
        self._token_expires = 0.0  # time.monotonic() after which the token is fetched again

    def _fetch_token(self) -> str:
        req = urllib.request.Request(
            self.base_url + self.TOKEN_PATH,
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            token = resp.read().decode("ascii", errors="replace").strip()
        self._token = token
        self._token_expires = time.monotonic() + 0.9 * self.token_ttl_s
        return token

    def _get(self, path: str) -> str | None:
        """The body at ``path`` (200), or None (404); a 401 fetches a new token and asks once more."""
        for attempt in range(2):
            if self._token is None or time.monotonic() >= self._token_expires or attempt:
                self._fetch_token()
            req = urllib.request.Request(
                self.base_url + path, headers={"X-aws-ec2-metadata-token": self._token}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.read().decode("utf-8", errors="replace")
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code != 401 or attempt:
                    raise
        return None  # pragma: no cover - the loop returns or raises

    def check(self) -> TerminationNotice | None:
        try:
            body = self._get(self.ACTION_PATH)
            if body is not None:
                return parse_instance_action(body, source=self.name, received_at=time.monotonic())
            if self.rebalance and self._get(self.REBALANCE_PATH) is not None:
                return TerminationNotice(self.name, "rebalance", time.monotonic())
        except urllib.error.HTTPError as e:
            self._error(f"HTTP {e.code}")
        except (urllib.error.URLError, OSError) as e:
            self._error(repr(e))
        except ValueError as e:
            self._error(str(e))
        return None

    def _error(self, what: str) -> None:
        if self.num_errors == 0:
            log.warning("IMDS %s: %s (further errors are counted, not logged)", self.base_url, what)
        self.num_errors += 1


class SigtermNotice:
    """SIGTERM is a notice. ``install()`` sets the handler (main thread only) and remembers the old one.

    The handler only records the signal (and calls ``on_signal``): the drain runs in the worker's loop,
    never inside the signal handler.
    """

    name = "sigterm"

    def __init__(self) -> None:
        self._received_at: float | None = None
        self._previous = None
        self.on_signal: Callable[[], None] | None = None
        self.is_installed = False

    def install(self) -> bool:
        """Install the SIGTERM handler; False (and nothing changed) when not on the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.info("SIGTERM notice: not on the main thread, handler not installed")
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self.is_installed = True
        return True

    def uninstall(self) -> None:
        """Restore the handler that was there before ``install``."""
        if self.is_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self.is_installed = False

    def _handle(self, signum, frame) -> None:
        self._received_at = time.monotonic()
        if self.on_signal is not None:
            self.on_signal()

    def check(self) -> TerminationNotice | None:
        if self._received_at is None:
            return None
        return TerminationNotice(self.name, "terminate", self._received_at)


class NoticeWatcher:
    """Watches notice sources and sets ``event`` on the first notice.

    Args:
        sources: where to look (checked in order on every poll).
        poll_s: seconds between polls of the polled sources.
        on_notice: called once (on the watcher's thread, or the signal handler's) with the first notice.

    Use ``start()`` / ``stop()`` (or ``with``); ``notify()`` gives a notice by hand (tests, actor calls).
    """

    def __init__(
        self,
        sources: Sequence[NoticeSource],
        *,
        poll_s: float = 5.0,
        on_notice: Callable[[TerminationNotice], None] | None = None,
    ) -> None:
        if poll_s <= 0:
            raise ValueError(f"NoticeWatcher: poll_s={poll_s} must be > 0 seconds")
        self.sources = list(sources)
        self.poll_s = poll_s
        self.on_notice = on_notice
        self.event = threading.Event()
        self.notice: TerminationNotice | None = None
        self._lock = threading.RLock()  # re-entrant: the SIGTERM handler may interrupt notify()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for source in self.sources:
            if isinstance(source, SigtermNotice):
                source.on_signal = lambda s=source: self.notify(s.check())

    def is_set(self) -> bool:
        """Whether a notice has been received."""
        return self.event.is_set()

    def notify(self, notice: TerminationNotice | None = None) -> None:
        """Record ``notice`` (default: a manual terminate notice) unless one was already received."""
        notice = notice or TerminationNotice("manual", "terminate", time.monotonic())
        with self._lock:
            if self.notice is not None:
                return
            self.notice = notice
        self.event.set()
        log.warning("termination notice from %s: %s", notice.source, notice.action)
        if self.on_notice is not None:
            self.on_notice(notice)

    def poll_once(self) -> TerminationNotice | None:
        """Check every source once; records and returns the first notice found."""
        if self.notice is None:
            for source in self.sources:
                found = source.check()
                if found is not None:
                    self.notify(found)
                    break
        return self.notice

    def start(self) -> NoticeWatcher:
        """Install the SIGTERM handler (where possible) and start the polling thread."""
        for source in self.sources:
            if isinstance(source, SigtermNotice):
                source.install()
        if any(not isinstance(s, SigtermNotice) for s in self.sources):
            self._thread = threading.Thread(target=self._loop, name="notice-watcher", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set() and self.poll_once() is None:
            self._stop.wait(self.poll_s)

    def stop(self, *, resend_sigterm_after_s: float | None = None) -> None:
        """Stop polling and restore the SIGTERM handler that was there before ``start``.

        Args:
            resend_sigterm_after_s: if the notice was a SIGTERM, send SIGTERM to this process again after
                this many seconds, now to the restored handler: a process whose runtime stops on SIGTERM
                (a Ray worker) then exits once its drain is done and its result delivered. None: do not.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 5)
        for source in self.sources:
            if isinstance(source, SigtermNotice):
                source.uninstall()
        if resend_sigterm_after_s is not None and self.notice is not None and self.notice.source == "sigterm":
            timer = threading.Timer(resend_sigterm_after_s, os.kill, (os.getpid(), signal.SIGTERM))
            timer.daemon = True
            timer.start()

    def __enter__(self) -> NoticeWatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def notice_file_for(cfg: FleetConfig, worker_id: str, default_dir: str | Path | None) -> Path | None:
    """The notice file path of ``worker_id``: ``cfg.notice_file`` with ``{worker_id}`` filled in, else
    ``default_dir/<worker_id>.json`` (None when neither is given)."""
    if cfg.notice_file is not None:
        return Path(cfg.notice_file.replace("{worker_id}", worker_id))
    return None if default_dir is None else Path(default_dir) / f"{worker_id}.json"


def watcher_from_config(
    cfg: FleetConfig,
    worker_id: str,
    *,
    default_notice_dir: str | Path | None = None,
    on_notice: Callable[[TerminationNotice], None] | None = None,
) -> NoticeWatcher:
    """A (not yet started) watcher over the sources ``cfg`` configures for ``worker_id``."""
    sources: list[NoticeSource] = []
    if cfg.handle_sigterm:
        sources.append(SigtermNotice())
    path = notice_file_for(cfg, worker_id, default_notice_dir)
    if path is not None:
        sources.append(FileNotice(path))
    if cfg.notice_url is not None:
        sources.append(HttpNotice(cfg.notice_url))
    if cfg.imds_url is not None:
        sources.append(ImdsNotice(cfg.imds_url, rebalance=cfg.imds_rebalance))
    return NoticeWatcher(sources, poll_s=cfg.notice_poll_s, on_notice=on_notice)
