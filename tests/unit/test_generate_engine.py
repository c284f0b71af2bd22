"""Issue 47: ``moerl generate`` runs the engine a run's rollout builds (paged KV cache, ``rollout.*`` from
``--config``, flags over it), renders chat rows through the tokenizer's chat template as training does, and
``moerl.api.generate`` returns the same samples as typed records. The model is a tiny random transformers
Qwen3-MoE (float32) with a ChatML character tokenizer; log-probs are checked against transformers' forward
of the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from _hf import save_random_hf_model
from test_user_inputs import save_chat_tokenizer

import moerl.generation as gen_mod
from moerl.api import Generation, generate
from moerl.cli import main

PREAMBLE = "You are a careful calculator. Think step by step, then give the number. Be exact"
"""The 80-token shared preamble of the issue's load (one token a character)."""
QUESTIONS = [f" Question {i}: {10 + i} + {20 + 3 * i} = ?" for i in range(6)]
"""Six 24-token questions: 104-token prompts, the length the slot engine refused."""
LOAD = ["-n", "8", "--max-new-tokens", "256", "--temperature", "1", "--max-slots", "48", "--kv-token-budget", "4096"]  # fmt: skip
"""The issue's load: 8 samples a prompt, up to 256 new tokens, 48 sequences, 4096 cache tokens."""


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny Qwen3-MoE (512 positions, 4 experts top-2) with a ChatML tokenizer; the transformers model."""
    folder = tmp_path_factory.mktemp("gen") / "m"
    vocab = save_chat_tokenizer(folder)
    hf = save_random_hf_model(
        "qwen3_moe", folder, seed=3, vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    return folder, hf


@pytest.fixture
def built(monkeypatch) -> list:
    """The engines generation builds, recorded on their way out of the run's factory (``make_engine``)."""
    engines = []
    real_make_engine = gen_mod.make_engine

    def recording_make_engine(model, cfg, **kw):
        engines.append(real_make_engine(model, cfg, **kw))
        return engines[-1]

    monkeypatch.setattr(gen_mod, "make_engine", recording_make_engine)
    return engines


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _hf_logprobs(hf: torch.nn.Module, rows: list[dict]) -> list[torch.Tensor]:
    """transformers' log softmax(logits)[token] of every generated token (one right-padded batch)."""
    seqs = [r["prompt_ids"] + r["token_ids"] for r in rows]
    t = max(map(len, seqs))
    ids = torch.zeros(len(seqs), t, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids, attention_mask=mask).logits.float(), -1)
    out = []
    for i, r in enumerate(rows):
        p, toks = len(r["prompt_ids"]), torch.tensor(r["token_ids"])
        out.append(logp[i, p - 1 : p - 1 + len(toks)].gather(-1, toks[:, None])[:, 0])
    return out


def test_the_48_sample_load_runs_on_the_paged_engine_with_transformers_logprobs(policy, tmp_path, built):
    folder, hf = policy
    prompts = _write(
        tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": PREAMBLE + q} for i, q in enumerate(QUESTIONS)]
    )
    out = tmp_path / "o.jsonl"
    argv = ["generate", "--model", str(folder), "--prompts", str(prompts), "--out", str(out), *LOAD]
    assert main(argv) == 0
    rows = _read(out)
    assert [(r["id"], r["sample_index"]) for r in rows] == [(f"q{i}", j) for i in range(6) for j in range(8)]
    assert all(len(r["prompt_ids"]) == 104 and r["finish_reason"] in ("stop", "length") for r in rows)
    [engine] = built
    assert engine.cache_kind == "paged" and engine.num_slots == 48
    assert engine.policy.pool.num_blocks * engine.policy.block_size == 4096
    # the load's tokens exceed the budget: the paged cache holds each group's prompt once (its samples and
    # the other groups' preambles hit the indexed blocks) and frees a finished sequence's blocks
    assert sum(len(r["prompt_ids"]) + len(r["token_ids"]) for r in rows) > 4096
    assert engine.stats.prefix_hit_tokens > 0
    expected = _hf_logprobs(hf, rows)
    worst = max(
        (torch.tensor(r["logprobs"]) - e).abs().max().item() for r, e in zip(rows, expected, strict=True)
    )
    assert worst < 1e-4, worst
    # the slot engine (--kv-cache slots) gives each of the 48 slots 4096 // 48 = 85 tokens: all refused
    assert main([*argv[:5], "--out", str(tmp_path / "slots.jsonl"), *LOAD, "--kv-cache", "slots"]) == 1
    refused = _read(tmp_path / "slots.jsonl")
    assert len(refused) == 6 and all(
        "longer than the context: it must be < 85" in r["error"] for r in refused
    )


def test_config_rollout_settings_build_the_engine_and_flags_override_them(policy, tmp_path):
    folder, _ = policy
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": PREAMBLE + QUESTIONS[0]}])
    config = tmp_path / "run.yaml"
    config.write_text(
        "seed: 5\nrollout: {kv_cache: slots, max_slots: 48, kv_token_budget: 4096, group_size: 3,\n"
        "          max_new_tokens: 3, temperature: 1.0}\n"
    )
    base = ["generate", "--model", str(folder), "--prompts", str(prompts), "--config", str(config)]
    assert main([*base, "--out", str(tmp_path / "a.jsonl")]) == 1  # the config's slot engine: refused
    assert "it must be < 85" in _read(tmp_path / "a.jsonl")[0]["error"]
    assert main([*base, "--out", str(tmp_path / "b.jsonl"), "--kv-cache", "paged"]) == 0
    rows = _read(tmp_path / "b.jsonl")
    # rollout.group_size samples of rollout.max_new_tokens, sampled at the config's seed and temperature
    assert [r["sample_index"] for r in rows] == [0, 1, 2] and all(len(r["token_ids"]) <= 3 for r in rows)
    same = generate(folder, [PREAMBLE + QUESTIONS[0]], config=config, kv_cache="paged")
    assert [s.token_ids for s in same] == [r["token_ids"] for r in rows]
    other = generate(folder, [PREAMBLE + QUESTIONS[0]], config=config, kv_cache="paged", seed=6)
    assert [s.token_ids for s in other] != [r["token_ids"] for r in rows]


def _hf_chat_ids(tok, messages: list[dict]) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_rows_are_rendered_through_the_chat_template(policy, tmp_path):
    folder, _ = policy
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    rows = [
        {"id": "chat", "messages": convo},
        {"id": "target", "messages": [*convo[1:], {"role": "assistant", "content": "5"}]},  # target dropped
        {"id": "plain", "prompt": "7+8="},
    ]
    out = tmp_path / "o.jsonl"
    argv = ["generate", "--model", str(folder), "--prompts", str(_write(tmp_path / "p.jsonl", rows))]
    assert main([*argv, "--out", str(out), "--max-new-tokens", "4"]) == 0
    got = first = {r["id"]: r for r in _read(out)}
    assert got["chat"]["prompt_ids"] == _hf_chat_ids(hf_tok, convo)
    assert got["chat"]["prompt"] == hf_tok.apply_chat_template(
        convo, tokenize=False, add_generation_prompt=True
    )
    assert got["target"]["prompt_ids"] == _hf_chat_ids(hf_tok, convo[1:])
    assert got["plain"]["prompt"] == "7+8="  # a plain row stays raw without a chat prompt_format
    # task.prompt_format=chat from a run config: plain rows become a user message, as in training
    config = tmp_path / "chat.yaml"
    config.write_text(f"task: {{name: dataset, path: {tmp_path / 'p.jsonl'}, prompt_format: chat, system_prompt: Be brief.}}\n")  # fmt: skip
    out = tmp_path / "chat.jsonl"
    assert main([*argv, "--out", str(out), "--max-new-tokens", "4", "--config", str(config)]) == 0
    got = {r["id"]: r for r in _read(out)}
    plain = [convo[0], {"role": "user", "content": "7+8="}]
    assert got["plain"]["prompt_ids"] == _hf_chat_ids(hf_tok, plain)
    assert got["target"]["prompt_ids"] == _hf_chat_ids(hf_tok, [convo[0], *convo[1:]])  # system prompt first
    # the Python API: the same samples, typed
    samples = generate(
        folder, [{"id": "chat", "messages": convo}, {"id": "plain", "prompt": "7+8="}], max_new_tokens=4
    )
    assert all(isinstance(s, Generation) for s in samples)
    for s, row in zip(samples, [first["chat"], first["plain"]], strict=True):  # greedy: the same tokens
        got_row = s.to_json()
        assert got_row.pop("logprobs") == pytest.approx(row.pop("logprobs"), abs=1e-5) and got_row == row
    assert samples[0].prompt_ids == _hf_chat_ids(hf_tok, convo)


def test_a_chat_row_without_a_chat_template_is_one_line(default_init, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    argv = ["generate", "--model", str(default_init), "--prompts", str(prompts), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "moerl generate: error: row '0': a 'messages' row needs the tokenizer's chat_template "
        f"({default_init / 'tokenizer.json'} has none)"
    ), err
    assert not (tmp_path / "o").exists()


def test_api_bad_input_is_refused_before_the_model_loads(policy):
    folder, _ = policy
    with pytest.raises(ValueError, match="prompts must be a list"):
        generate(folder, "12+34=")
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected an object with a string 'prompt' field"):
        generate(folder, ["12+34=", {"text": "1+2="}])
    with pytest.raises(ValueError, match=r"prompts\[0\]: message 0 has role 'bot'"):
        generate(folder, [[{"role": "bot", "content": "hi"}]])
    with pytest.raises(TypeError, match=r"unknown rollout settings \['max_slot'\]"):
        generate(folder, ["12+34="], max_slot=4)
    with pytest.raises(ValueError, match="needs a model folder"):
        generate(None, ["12+34="])
    with pytest.raises(FileNotFoundError, match="no such folder"):
        generate(folder / "nope", ["12+34="])


def test_an_mla_model_runs_on_the_latent_cache_by_default_and_expanded_on_request(tmp_path, built):
    from test_rollout_mla import DSV3

    folder = tmp_path / "dsv3"
    hf = save_random_hf_model(
        "deepseek_v3",
        folder,
        seed=5,
        attn_implementation="eager",
        **dict(DSV3, vocab_size=save_chat_tokenizer(folder)),
    )
    prompts = [PREAMBLE[:40], [{"role": "user", "content": "What is 2+3?"}]]
    runs = {
        form: generate(folder, prompts, n=2, temperature=1.0, max_new_tokens=12, mla_cache=form)
        for form in (None, "expanded")
    }
    assert [e.cache.latent for e in built] == [True, False]
    rows = [s.to_json() for s in runs[None]]
    for r, e in zip(rows, _hf_logprobs(hf, rows), strict=True):
        assert torch.allclose(torch.tensor(r["logprobs"]), e, atol=1e-4)
    assert [s.token_ids for s in runs["expanded"]] == [r["token_ids"] for r in rows]
