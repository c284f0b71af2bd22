"""Per-rank bodies of the EP rollout group tests (moerl.rollout.ep_group; imported by the fork server)."""

from __future__ import annotations

import copy
import datetime
import os
import signal
import time

import ep_engine_cases as base
import torch
import torch.distributed as dist

from moerl.ep.traffic import dispatcher_traffic
from moerl.rollout.ep_engine import EPEngine
from moerl.rollout.ep_group import EPFollower, EPGroupEngine, EPGroupError
from moerl.rollout.weight_update import recompute_running

SWITCH_AT = 3
"""Step at which the leader switches to version 1 in the weight-switch case."""


def new_weights() -> dict[str, torch.Tensor]:
    """Version 1: the base model's weights, perturbed (the same on every rank)."""
    g = torch.Generator().manual_seed(11)
    return {
        k: v + 0.3 * torch.randn(v.shape, generator=g)
        for k, v in sorted(base.make_model().state_dict().items())
    }


def _ctrl():
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))


def _group(model):
    return EPEngine(base.new_engine(model), dispatcher="alltoall")


def _run_leader(group, requests, *, late_at=None, switch_at=None, recompute=False) -> list:
    """Run ``requests`` on ``group`` (an ``EPGroupEngine``, or a one-rank ``Engine`` for the reference)."""
    for r in requests:
        group.add_request(r)
    done, steps = [], 0
    while group.num_unfinished:
        done += group.step()
        steps += 1
        if steps == late_at:
            group.add_request(base.late_request())
        if steps == switch_at:
            group.update_weights(new_weights(), 1)
            if recompute:
                is_group = isinstance(group, EPGroupEngine)
                done += group.recompute_running() if is_group else recompute_running(group)
    return done


def run_group_cases(rank: int, world: int) -> dict:
    """Equivalence (all requests through the leader, one admitted mid-run) and a weight switch at
    step ``SWITCH_AT`` (every rank switches at the same step), then the leader closes the group."""
    model = base.make_model()
    ctrl = _ctrl()
    out: dict = {}
    loads: list[int] = []

    def load_version(v):
        loads.append(v)
        return new_weights()

    for case in ("equal", "switch", "recompute"):
        ep = _group(model)
        if rank == 0:
            group = EPGroupEngine(ep, ctrl, timeout_s=30)
            switch = None if case == "equal" else SWITCH_AT
            late = 2 if case == "equal" else None
            done = _run_leader(
                group, base.requests(), late_at=late, switch_at=switch, recompute=case == "recompute"
            )
            out[case] = [
                (c.request_id, c.sample_index, c.token_ids, c.logprobs, c.policy_versions) for c in done
            ]
            out[f"{case}/slots"] = group.num_slots
            group.close()
        else:
            out[f"{case}/steps"] = EPFollower(ep, ctrl, load_version, idle_timeout_s=60).run()
        out[f"{case}/experts"] = [tuple(b.experts.gate_up_proj.shape) for b in ep.engine.model.moe_blocks()]
        out[f"{case}/version"] = ep.version
    out["loads"] = loads
    out.update(_cancel_case(rank, model, ctrl))
    return out


def _cancel_case(rank: int, model, ctrl) -> dict:
    """``cancel_all`` after 2 steps drops every rank's requests (``on_weight_update=abort``); requests
    added afterwards run as on a fresh group."""
    ep = _group(model)
    if rank != 0:
        EPFollower(ep, ctrl, lambda v: {}, idle_timeout_s=60).run()
        return {"cancel/unfinished": ep.num_unfinished}
    group = EPGroupEngine(ep, ctrl, timeout_s=30)
    for r in base.requests():
        group.add_request(r)
    early = group.step() + group.step()
    group.cancel_all()
    assert group.num_unfinished == 0 and not group.running_by_request()
    after = _run_leader(group, [base.late_request(), *base.requests()[:2]])
    group.close()
    return {
        "cancel/early": len(early),
        "cancel": [(c.request_id, c.sample_index, c.token_ids, c.logprobs, c.policy_versions) for c in after],
    }


def run_kill_case(rank: int, world: int, mode: str) -> dict:
    """The last rank is killed by SIGKILL (``mode="kill"``) or hangs (``"hang"``) at its 3rd step; the
    leader must raise ``EPGroupError`` within seconds; returns its message and how long it took."""
    model = base.make_model()
    ctrl = _ctrl()
    ep = _group(model)
    if rank == 0:
        group = EPGroupEngine(ep, ctrl, timeout_s=3)
        for r in base.requests():
            group.add_request(r)
        t_fail = None
        try:
            while True:  # the requests outlast the kill
                group.step()
                t_fail = time.monotonic()
        except EPGroupError as e:
            return {"error": str(e), "seconds": time.monotonic() - t_fail}
        return {"error": None}
    follower = EPFollower(ep, ctrl, lambda v: {}, idle_timeout_s=60)
    real_step, real_report = ep.step, follower._report

    def step():  # killed inside a step: the leader's EP exchange fails
        if follower.num_steps == 2 and rank == world - 1 and mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step()

    def report(done):  # hangs between steps: the leader's command exchange times out
        if follower.num_steps == 3 and rank == world - 1 and mode == "hang":
            time.sleep(8)
        return real_report(done)

    ep.step, follower._report = step, report
    try:
        follower.run()
    except RuntimeError:  # the leader gave up on the group
        pass
    return {}


def run_traffic_case(rank: int, world: int) -> dict:
    """The requests through the leader, then close; every rank's own dispatcher counters, and on the
    leader the group's ``ep_traffic`` after ``close`` (which brings the followers' last reports)."""
    ep = _group(base.make_model())
    ctrl = _ctrl()
    out: dict = {}
    if rank == 0:
        group = EPGroupEngine(ep, ctrl, timeout_s=30)
        _run_leader(group, base.requests())
        group.close()
        out["group"] = group.ep_traffic
    else:
        EPFollower(ep, ctrl, lambda v: new_weights(), idle_timeout_s=60).run()
    out["own"] = dispatcher_traffic(ep.dispatchers)
    return out


def run_paged_group_case(rank: int, world: int) -> dict:
    """The leader's ``EPGroupEngine`` over paged engines whose budget forces preemption (sampled n=8
    groups with a shared preamble, spread over the ranks)."""
    from moerl.rollout import Engine

    model = base.make_model()
    ctrl = _ctrl()
    engine = Engine(copy.deepcopy(model), cache="paged", max_slots=16, kv_token_budget=96, block_size=4)
    ep = EPEngine(engine, dispatcher="alltoall")
    out: dict = {}
    if rank == 0:
        group = EPGroupEngine(ep, ctrl, timeout_s=30)
        done = _run_leader(group, base.paged_requests(routed=False))
        out["done"] = [(c.request_id, c.sample_index, c.token_ids, c.logprobs) for c in done]
        group.close()
    else:
        EPFollower(ep, ctrl, lambda v: {}, idle_timeout_s=60).run()
    out["preemptions"] = engine.stats.preemptions
    out["requests"] = engine.stats.prefill_tokens > 0
    return out
