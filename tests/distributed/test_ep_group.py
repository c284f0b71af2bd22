"""The EP rollout group's engine (moerl.rollout.ep_group) over gloo, float32, greedy.

- The leader's ``EPGroupEngine`` spreads requests over the ranks and gives the tokens and log-probs
  (within 1e-5) of a one-rank engine, a request admitted mid-run included; followers hold only their
  experts.
- ``cancel_all`` (``on_weight_update=abort``) drops the requests of every rank.
- A weight switch lands on every rank at the same step: each sample's tokens carry version 0 up to the
  switch and version 1 after it, on the leader's and on the follower's samples alike; with
  ``recompute`` the ranks re-prefill in lockstep and give a one-rank engine's tokens and log-probs.
- A follower killed by SIGKILL mid-step, or one that stops answering, is an ``EPGroupError`` on the
  leader within seconds (not a hang).
"""

from __future__ import annotations

import copy
import datetime
import multiprocessing as mp
import tempfile
from pathlib import Path

import ep_engine_cases as base
import ep_group_cases as cases
import pytest
import torch
from dist_harness import _PRELOAD, _entry, run_world

from moerl.rollout import Engine

PRELOAD = ("ep_engine_cases", "ep_group_cases")


def _reference() -> dict:
    ref = {}
    for c in base.new_engine(base.make_model()).generate([*base.requests(), base.late_request()]):
        ref[(c.request_id, c.sample_index)] = (c.token_ids, c.logprobs)
    return ref


def _reference_recompute() -> dict:
    """One engine with slots for every sample (all admitted at step 1, as on the group), switched to
    version 1 after step SWITCH_AT with ``recompute_running``."""
    engine = Engine(copy.deepcopy(base.make_model()), max_slots=8, kv_token_budget=8 * 64)
    done = cases._run_leader(engine, base.requests(), switch_at=cases.SWITCH_AT, recompute=True)
    return {(c.request_id, c.sample_index): (c.token_ids, c.logprobs, c.policy_versions) for c in done}


@pytest.mark.parametrize("world", [2, 4])
def test_group_engine_matches_one_rank_and_switches_in_lockstep(world):
    ref = _reference()
    results = run_world(cases.run_group_cases, world, preload=PRELOAD, timeout_s=240)
    leader, followers = results[0], results[1:]
    got = {(rid, j): (tokens, lps) for rid, j, tokens, lps, _ in leader["equal"]}
    assert got.keys() == ref.keys()
    for key, (tokens, lps) in got.items():
        assert tokens == ref[key][0], key
        assert lps == pytest.approx(ref[key][1], abs=1e-5), key
    assert leader["equal/slots"] == 4 * world
    assert all(f["equal/steps"] > 0 for f in followers)  # every follower ran steps ...
    for r in results:  # ... and holds only its experts
        assert r["equal/experts"] == [(4 // world, 16, 16)] * 2
    # weight switch: every sample was admitted at step 1, which prefills (token 0) and decodes (token 1);
    # token i >= 1 comes from step i, so the switch after step SWITCH_AT makes tokens SWITCH_AT + 1 ..
    # version 1, on the leader's and the followers' samples alike
    switched = leader["switch"]
    assert len(switched) == len(got) - 1  # no late request in this case
    for rid, j, tokens, _, versions in switched:
        k = cases.SWITCH_AT + 1
        assert versions == [0] * min(k, len(tokens)) + [1] * max(0, len(tokens) - k), (rid, j)
    assert {r["switch/version"] for r in results} == {1}
    assert all(f["loads"] == [1, 1] for f in followers)  # each follower loaded version 1 once per case
    # recompute: the same switch, then every rank re-prefills its prefixes in lockstep; tokens and
    # log-probs are those of a one-rank engine doing the same (which a fresh prefill gives, unit-tested)
    want = _reference_recompute()
    got = {(rid, j): (tokens, lps, vers) for rid, j, tokens, lps, vers in leader["recompute"]}
    assert got.keys() == want.keys()
    for key, (tokens, lps, vers) in got.items():
        assert tokens == want[key][0] and vers == want[key][2], key
        assert lps == pytest.approx(want[key][1], abs=1e-5), key
    continued = {(rid, j): lps for rid, j, _, lps, _ in switched}
    assert any(  # and the re-prefill mattered: the continued KV cache gives other log-probs
        abs(a - b) > 1e-4
        for key, (_, lps, _) in got.items()
        for a, b in zip(lps, continued[key], strict=True)
    )
    # cancel_all: nothing of the dropped requests comes out later, on any rank; new requests run as usual
    assert leader["cancel/early"] == 0  # 2 steps finish none of them
    after = {(rid, j): (tokens, lps) for rid, j, tokens, lps, _ in leader["cancel"]}
    assert after.keys() == {("late", 0), ("r0", 0), ("r1", 0), ("r1", 1)}
    for key, (tokens, lps) in after.items():
        assert tokens == ref[key][0] and lps == pytest.approx(ref[key][1], abs=1e-5), key
    assert all(f["cancel/unfinished"] == 0 for f in followers)


def _run_with_killed_rank(fn, world: int, *args, timeout_s: float = 120.0) -> dict:
    """``run_world`` for a world whose last rank may die: rank 0's result, or the failure."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + list(PRELOAD))
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, folder, args), daemon=True) for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        for p in procs:
            if p.is_alive():
                p.kill()  # only our own children, by handle
                p.join()
        errors = sorted(Path(folder).glob("error0.txt"))
        assert not errors, errors[0].read_text()
        return torch.load(Path(folder) / "result0.pt", weights_only=False) | {
            "exitcodes": [p.exitcode for p in procs]
        }


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_lost_follower_is_a_group_error_within_seconds(mode):
    out = _run_with_killed_rank(cases.run_kill_case, 2, mode)
    assert out["error"] is not None and "EP" in out["error"], out
    # killed: its sockets close and the leader's collective fails at once; hung: the 3 s timeout
    assert out["seconds"] < (2.0 if mode == "kill" else 6.0), out
    if mode == "kill":
        assert out["exitcodes"][1] == -9


def test_group_engine_over_paged_engines_matches_one_slot_engine():
    """ep 2, paged caches small enough to preempt on every rank: the leader's completions are the
    tokens and log-probs (within 1e-5) of one slot engine running every request."""
    ref = {}
    for c in base.new_engine(base.make_model()).generate(base.paged_requests(routed=False)):
        ref[(c.request_id, c.sample_index)] = (c.token_ids, c.logprobs)
    results = run_world(cases.run_paged_group_case, 2, preload=PRELOAD, timeout_s=240)
    got = {(rid, j): (tokens, lps) for rid, j, tokens, lps in results[0]["done"]}
    assert got.keys() == ref.keys()
    for key, (tokens, lps) in got.items():
        assert tokens == ref[key][0], key
        assert lps == pytest.approx(ref[key][1], abs=1e-5), key
    assert all(r["requests"] for r in results)  # both ranks served requests ...
    assert sum(r["preemptions"] for r in results) > 0  # ... and ran out of blocks
