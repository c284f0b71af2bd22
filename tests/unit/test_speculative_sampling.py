"""The acceptance rule of speculative sampling leaves the policy's distribution exact (chi-square over a
small vocabulary, deterministic seeds), greedy rows keep the argmax, and the n-gram drafter's lookup."""

import math

import pytest
import torch

from moerl.rollout.sampler import SamplingRows, sample_key
from moerl.rollout.speculative import NgramDrafter, SpecPolicy, draw, policy_probs, step_noise, verify_drafts

V = 6
N = 20000
CHI2_CRIT_DF5 = 25.74  # chi-square, 5 degrees of freedom, upper 1e-4 tail: a fixed-seed test at 0.01 % level


def _rows(n, *, temperature=1.0, top_p=1.0, top_k=0, seed=7):
    return SamplingRows(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        keys=torch.tensor([sample_key(seed, i) for i in range(n)], dtype=torch.int64),
        all_greedy=temperature == 0.0,
        any_truncation=top_k > 0 or top_p < 1.0,
    )


def _chi2(tokens, expected_probs):
    counts = torch.bincount(tokens, minlength=V).double()
    n = counts.sum()
    exp = expected_probs.double() * n
    keep = exp > 0
    assert counts[~keep].sum() == 0, f"tokens outside the policy's support: {counts.tolist()}"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


TARGET = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
DRAFT_LOGITS = torch.tensor([-1.0, 0.0, 1.5, 0.5, 1.0, -2.0])  # a draft distribution far from the target


def _spec_step(rows, k, *, deterministic=False):
    """Drafts from q (own uniforms), verified against fixed target logits at every position."""
    n = rows.keys.shape[0]
    q = DRAFT_LOGITS.softmax(-1).double()
    g = torch.Generator().manual_seed(123)
    drafts = torch.multinomial(q.float().expand(n, V), k, replacement=True, generator=g)
    target = TARGET.expand(n, k + 1, V).clone()
    probs = None if deterministic else q.expand(n, k, V).clone()
    noise = step_noise(rows.keys, torch.full((n,), 10, dtype=torch.int64), k)
    return verify_drafts(target, drafts, probs, torch.full((n,), k), rows, noise)


@pytest.mark.parametrize("deterministic", [False, True])
def test_first_token_is_the_policys_distribution_at_temperature_1(deterministic):
    rows = _rows(N)
    out = _spec_step(rows, 2, deterministic=deterministic)
    chi2, df = _chi2(out.tokens[:, 0], TARGET.softmax(-1))
    assert df == 5 and chi2 < CHI2_CRIT_DF5, chi2
    # the second position, among the rows that reached it (their first draft accepted)
    reached = out.num_accepted >= 1
    chi2_2, _ = _chi2(out.tokens[reached, 1], TARGET.softmax(-1))
    assert reached.sum() > 2000 and chi2_2 < CHI2_CRIT_DF5, chi2_2
    # the rule accepts some drafts and rejects others (a non-trivial test)
    assert 0 < int((out.num_accepted == 0).sum()) < N


def test_top_p_distribution_is_the_truncated_policy():
    rows = _rows(N, top_p=0.8, temperature=0.7, seed=11)
    out = _spec_step(rows, 2)
    probs = (TARGET / 0.7).softmax(-1)  # by hand: keep the most likely tokens until 0.8 of the mass
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    kept = torch.zeros(V, dtype=torch.bool)
    kept[order[mass_before < 0.8]] = True
    expected = torch.where(kept, probs, torch.zeros(V))
    expected /= expected.sum()
    assert 1 <= int(kept.sum()) < V
    chi2, df = _chi2(out.tokens[:, 0], expected)
    assert chi2 < {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}.get(df, 20.5), (chi2, df)


def test_logprobs_are_the_policys_untruncated():
    rows = _rows(64, top_p=0.8, temperature=0.7)
    out = _spec_step(rows, 2)
    logp = (TARGET / 0.7).log_softmax(-1)
    emitted = out.num_accepted + 1
    for r in range(64):
        for j in range(int(emitted[r])):
            assert math.isclose(float(out.logprobs[r, j]), float(logp[out.tokens[r, j]]), abs_tol=1e-6)


def test_greedy_keeps_the_argmax_only():
    n = 8
    rows = _rows(n, temperature=0.0)
    target = torch.randn(n, 4, V, generator=torch.Generator().manual_seed(3))
    best = target.argmax(-1)
    drafts = best[:, :3].clone()
    drafts[::2, 1] = (drafts[::2, 1] + 1) % V  # even rows: the second draft is wrong
    noise = step_noise(rows.keys, torch.zeros(n, dtype=torch.int64), 3)
    out = verify_drafts(target, drafts, None, torch.full((n,), 3), rows, noise)
    assert out.num_accepted.tolist() == [1, 3] * (n // 2)
    for r in range(n):
        a = int(out.num_accepted[r])
        assert out.tokens[r, : a + 1].tolist() == best[r, : a + 1].tolist()


def test_no_draft_is_a_plain_decode_step():
    from moerl.rollout.sampler import sample_no_sync

    rows = _rows(32, top_k=3)
    logits = torch.randn(32, 3, V, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(32, dtype=torch.int64) + 4
    no_drafts = torch.zeros(32, 2, dtype=torch.int64)
    out = verify_drafts(
        logits, no_drafts, None, torch.zeros(32, dtype=torch.int64), rows, step_noise(rows.keys, pos, 2)
    )
    tok, lp = sample_no_sync(logits[:, 0], rows, pos)
    assert torch.equal(out.tokens[:, 0], tok) and torch.allclose(out.logprobs[:, 0], lp)
    assert int(out.num_accepted.sum()) == 0


def test_step_noise_is_each_purposes_own_uniforms_from_one_hash_evaluation():
    """One speculative step's uniforms (one hash call over a grid) are, entry by entry, the per-purpose
    counter uniforms at each drafted position: the sampler's own for the bonus draw, and distinct keys for
    the drafter's draw, the accept test and the residual draw (no two purposes share a uniform)."""
    from moerl.rollout.sampler import hash_combine, uniform_no_sync
    from moerl.rollout.speculative import _ACCEPT, _DRAFT, _RESIDUAL, step_noise

    rows = _rows(5, seed=3)
    first = torch.tensor([0, 7, 100, 4095, 2**31], dtype=torch.int64)
    for k in (0, 1, 3):
        noise = step_noise(rows.keys, first, k)
        for j in range(k + 1):
            assert torch.equal(noise.bonus[:, j], uniform_no_sync(rows.keys, first + j))
        for name, purpose in (("draft", _DRAFT), ("accept", _ACCEPT), ("residual", _RESIDUAL)):
            u = getattr(noise, name)
            assert u.shape == (5, k)
            for j in range(k):
                assert torch.equal(u[:, j], uniform_no_sync(hash_combine(rows.keys, purpose), first + j)), (
                    name
                )
        every = torch.cat([noise.bonus, noise.draft, noise.accept, noise.residual], 1)
        assert every.unique().numel() == every.numel() and bool(((every >= 0) & (every < 1)).all())


def test_policy_probs_and_draw():
    rows = _rows(2, top_k=2)
    p = policy_probs(TARGET.expand(2, 1, V), rows)[:, 0]
    assert torch.allclose(p.sum(-1), torch.ones(2, dtype=torch.float64))
    assert int((p[0] > 0).sum()) == 2
    assert draw(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0.5], dtype=torch.float64)).item() == 1


def test_ngram_lookup():
    d = NgramDrafter(max_n=3)
    assert d.lookup([5, 6, 7, 8, 1, 5, 6, 7], 3) == [8, 1, 5]
    assert d.lookup([1, 2, 3], 2) == []
    assert d.lookup([4, 9, 4], 5) == [9, 4]  # a unigram match, k cut by the context's end


def test_policy_turns_speculation_off_and_probes():
    pol = SpecPolicy(max_batch=4, min_acceptance=0.5, probe_every=4, window=4)
    assert not pol.should_speculate(5) and pol.num_off_batch == 1
    assert pol.should_speculate(2)
    pol.record(drafted=8, accepted=1, emitted=3)
    decisions = [pol.should_speculate(2) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]
    assert pol.num_off_acceptance == 6


def test_policy_turns_speculation_off_where_it_is_slower_and_probes():
    now = [0.0]
    pol = SpecPolicy(min_acceptance=0.0, probe_every=4, window=4, clock=lambda: now[0])
    pol.at_sync()
    pol.note_plain(8)
    now[0] += 8.0
    pol.at_sync()  # plain: 8 steps in 8 s, one token per row and second
    assert pol.tokens_per_row_s("plain") == 1.0 and pol.should_speculate(2)  # nothing speculative measured
    pol.note_spec(2.0, 4.0)  # 2 tokens per row in 4 s: slower
    decisions = [pol.should_speculate(2) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]
    assert pol.num_off_cost == 6 and pol.num_off_acceptance == 0
    pol.note_spec(6.0, 1.0)  # (2 + 6) tokens per row in 5 s: faster now
    assert (
        pol.should_speculate(2) and pol.mean_step_ms("spec") == 2500.0 and pol.mean_step_ms("plain") == 1000.0
    )
    pol.note_other()  # a prefill in the run: not measured
    pol.note_plain(3)
    now[0] += 100.0
    pol.at_sync()
    assert pol.tokens_per_row_s("plain") == 1.0
    decisions = [pol.should_speculate(2) for _ in range(6)]  # a plain probe after 4 speculative steps
    assert decisions.count(False) == 1 and pol.num_plain_probes == 1


def test_verify_drafts_never_waits_for_the_device(monkeypatch):
    """No host read inside the acceptance rule (it is replayed from a CUDA graph): every tensor-to-host
    conversion raises while it runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("a host sync inside verify_drafts")

    rows = _rows(16, top_p=0.9, temperature=0.8)
    for name in ("__bool__", "item", "tolist", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = _spec_step(rows, 3)
    monkeypatch.undo()
    assert 0 < int(out.num_accepted.sum()) < 16 * 3
