"""Bad input of ``moerl train``: one line naming the field and the value, exit 2, before the warm start
(no SFT, no run folder left), never a traceback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _runs import DAMAGED_FOLDER_MESSAGES, damage_model_folder, save_fresh_policy

from moerl.cli import main
from moerl.config import ConfigError, TrainerConfig, load_config
from moerl.run.preflight import check_policy_folders
from moerl.tasks import load_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def train_fails(monkeypatch, tmp_path, capsys):
    """``train_fails(*args)``: run ``moerl train ARGS`` (sync mode, runs under tmp_path/runs) and return
    its one line of stderr; fails the test if the SFT warm start began or a run folder is left."""
    import moerl.tasks.sft as sft

    def must_not_run(*args, **kwargs):
        raise AssertionError("the SFT warm start began although the input is bad")

    monkeypatch.setattr(sft, "run_sft", must_not_run)
    monkeypatch.chdir(tmp_path)  # no configs/default.yaml here: built-in defaults
    runs = tmp_path / "runs"

    def run(*args: str) -> str:
        sets = ["--set", f"output_dir={runs}", "--set", "runtime.mode=sync"]
        assert main(["train", *sets, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert not runs.exists() or list(runs.iterdir()) == []  # nothing left behind
        return err.strip()

    return run


# 1. YAML in --set: the same path as a config file's YAML errors


def test_unclosed_yaml_list_in_set_names_the_item(train_fails):
    err = train_fails("--set", "trainer.lr=[1,")
    assert err.startswith("moerl: config error: --set 'trainer.lr=[1,': the value '[1,' is not valid YAML (")


def test_python_tag_in_set_is_refused_by_safe_load(train_fails):
    err = train_fails("--set", "trainer.steps=!!python/object:os.system ls")
    assert "--set 'trainer.steps=!!python/object:os.system ls': the value" in err
    assert "could not determine a constructor for the tag" in err


# 2. import paths: imported before the warm start


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("nope.mod:fn", "task.reward_fn='nope.mod:fn': cannot import module 'nope.mod'"),
        ("os:nonexistent", "task.reward_fn='os:nonexistent': 'os' has no attribute 'nonexistent'"),
    ],
)
def test_bad_reward_fn_fails_before_the_warm_start(train_fails, spec, expected):
    assert train_fails("--set", f"task.reward_fn={spec}").startswith(f"moerl: config error: {expected}")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("nope.mod:Cls", "env.name='nope.mod:Cls': cannot import module 'nope.mod'"),
        ("os:path", "env.name='os:path' is a module, not a callable"),
    ],
)
def test_bad_env_name_fails_before_the_warm_start(train_fails, spec, expected):
    err = train_fails("-c", str(CONFIGS / "env_calculator.yaml"), "--set", f"env.name={spec}")
    assert err.startswith(f"moerl: config error: {expected}")


# 3. dataset contents: read before the warm start


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"question": "q", "answer": "a #### 3"}\n{bad\n', ":2: not valid JSON ("),
        (
            '{"question": "q\tx", "answer": "a #### 3"}\n',
            ":1: not valid JSON (Invalid control character at column 16)",
        ),
        ('{"question": "q"}\n', ":1: missing field 'answer'"),
        ('{"question": "q", "answer": "3"}\n', ":1: field 'answer' has no '#### <number>' final answer"),
        ("", ":1: no records (the file is empty or blank)"),
    ],
)
def test_malformed_dataset_fails_before_the_warm_start(train_fails, tmp_path, text, expected):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    err = train_fails("--set", "task.name=jsonl", "--set", f"task.path={path}")
    assert err.startswith(f"moerl: config error: task.path: {path}{expected}")


# 4. device


def test_device_that_is_not_a_device(train_fails):
    err = train_fails("--set", "model.device=banana")
    assert err == "moerl: config error: model.device='banana' is not a device; use cpu, cuda or cuda:N"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_cuda_at_one_rank_without_a_gpu(train_fails):
    err = train_fails("--set", "model.device=cuda")
    assert err == (
        "moerl: config error: model.device=cuda needs a GPU (trainer.num_ranks=1) but this machine has 0; "
        "use model.device=cpu"
    )


# 5. engine sizes


def test_kv_budget_that_leaves_no_cache_slot(train_fails):
    err = train_fails("--set", "rollout.kv_token_budget=1")
    assert err.startswith(
        "moerl: config error: the engine's longest sequence is 0 tokens (the whole cache: "
        "rollout.kv_token_budget=1 in blocks of rollout.kv_block_size=16, capped by the model context 512"
    )
    err = train_fails("--set", "rollout.kv_token_budget=1", "--set", "rollout.kv_cache=slots")
    assert err.startswith(
        "moerl: config error: the engine's cache slot is 0 tokens (rollout.kv_token_budget=1 // "
        "rollout.max_slots=64, capped by the model context 512"
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.max_new_tokens=1000", "rollout.max_new_tokens=1000 plus a prompt of at least 1 token "
         "cannot fit the engine's longest sequence of 512 tokens (the whole cache: "
         "rollout.kv_token_budget=16384 in blocks of rollout.kv_block_size=16, capped by the model context 512"),
        ("model.max_position_embeddings=4", "rollout.max_new_tokens=16 plus a prompt of at least 1 token "
         "cannot fit the engine's longest sequence of 4 tokens (the whole cache: rollout.kv_token_budget=16384 "
         "in blocks of rollout.kv_block_size=16, capped by the model context 4"),
        ("rollout.kv_cache=slots", "rollout.max_new_tokens=1000 plus a prompt of at least 1 token "
         "cannot fit the engine's cache slot of 256 tokens"),
    ],
)  # fmt: skip
def test_max_new_tokens_beyond_the_cache_slot(train_fails, override, expected):
    extra = ("--set", "rollout.max_new_tokens=1000") if override == "rollout.kv_cache=slots" else ()
    assert train_fails("--set", override, *extra).startswith(f"moerl: config error: {expected}")


def test_longest_prompt_beyond_the_cache_slot(train_fails):
    # a slot of 640 // 64 = 10 tokens holds 1 + 8, but not the task's prompts of up to 6 tokens ("99+99=") + 8
    err = train_fails(
        "--set", "rollout.kv_token_budget=640", "--set", "rollout.max_new_tokens=8", "--set", "rollout.kv_cache=slots"
    )  # fmt: skip
    assert err.startswith(
        "moerl: config error: rollout.max_new_tokens=8 plus the task's longest prompt (6 tokens: "
    )
    assert "cannot fit the engine's cache slot of 10 tokens" in err
    # paged: the whole cache, 5 blocks of 2 tokens, is the longest sequence
    err = train_fails(
        "--set", "rollout.kv_token_budget=10", "--set", "rollout.kv_block_size=2", "--set", "rollout.max_new_tokens=8"
    )  # fmt: skip
    assert (
        "cannot fit the engine's longest sequence of 10 tokens (the whole cache: rollout.kv_token_budget=10"
        in err
    )


def test_empty_operations(train_fails):
    err = train_fails("--set", "task.operations=[]")
    assert err == "moerl: config error: task.operations=[] is empty; arithmetic needs at least one of + - *"


# 6. NaN / inf


@pytest.mark.parametrize(
    "override",
    [
        "trainer.lr=.nan",
        "trainer.lr=nan",
        "trainer.grad_clip=.nan",
        "algorithm.kl_coef=.nan",
        "rollout.temperature=.inf",
        "runtime.lease_ttl_s=.inf",
        "fleet.heartbeat_timeout_s=-.inf",
    ],
)
def test_non_finite_float_is_refused_at_load(override):
    field, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{field}=-?(nan|inf) is not a finite number$"):
        load_config(None, [override])


def test_check_range_refuses_nan_built_in_code():
    with pytest.raises(ConfigError, match=r"^trainer.lr=nan is not a finite number$"):
        TrainerConfig(lr=math.nan)


def test_nan_lr_fails_before_the_warm_start(train_fails):
    assert (
        train_fails("--set", "trainer.lr=.nan")
        == "moerl: config error: trainer.lr=nan is not a finite number"
    )


# 7. store URLs: the field the user set


def test_unreachable_store_url_is_one_line(train_fails):
    err = train_fails("--set", "runtime.store_url=ftp://nowhere.invalid/x")
    assert err.startswith(
        "moerl: config error: runtime.store_url: weight store 'ftp://nowhere.invalid/x' cannot be opened: "
    )


def test_unsupported_store_protocol_is_one_line(train_fails):
    err = train_fails("--set", "runtime.store_url=nosuchproto://x/y")
    assert err.startswith(
        "moerl: config error: runtime.store_url: weight store 'nosuchproto://x/y' cannot be"
    )


def test_bad_storage_url_names_storage_url(train_fails):
    err = train_fails("--set", "storage.url=http://bad.invalid")
    assert err.startswith("moerl: config error: storage.url: weight store 'http://bad.invalid/")


def test_sft_command_checks_the_dataset_before_training(tmp_path, monkeypatch, capsys):
    import moerl.tasks.sft as sft

    monkeypatch.setattr(sft, "run_sft", lambda *a, **k: pytest.fail("SFT began although the dataset is bad"))
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "q"}\n')
    args = ["sft", "--out", str(tmp_path / "out"), "--set", "task.name=jsonl", "--set", f"task.path={path}"]
    assert main(args) == 2
    assert (
        capsys.readouterr().err == f"moerl: config error: task.path: {path}:1: missing field 'answer' "
        "(fields present: ['question'])\n"
    )


def test_storage_url_of_an_unknown_protocol_names_storage_url(train_fails):
    err = train_fails("--set", "storage.url=nosuchproto://x/y")
    assert err == (
        "moerl: config error: storage.url='nosuchproto://x/y' cannot be opened: ValueError: Protocol not known: "
        "nosuchproto"
    )


# second fresh-user pass


def test_a_dataset_too_small_to_hold_out_any_prompt_fails_before_the_warm_start(train_fails, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text('{"question": "1+1=", "answer": "#### 2"}\n')  # one row: none held out
    err = train_fails("--set", "task.name=jsonl", "--set", f"task.path={data}")
    assert err.startswith("moerl: config error: task: no held-out prompts (task.name='jsonl'"), err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.device=meta", "model.device=meta holds shapes only"),
        ("model.path=/nonexistent", "model.path='/nonexistent' is not a Hugging Face model folder"),
        ("model.rope_theta=0", "model.rope_theta"),
    ],
)
def test_model_fields_a_run_cannot_use_fail_before_the_warm_start(train_fails, override, expected):
    err = train_fails("--set", override)
    assert err.startswith("moerl: config error: ") and expected in err, err


# third fresh-user pass


def test_engine_sizes_beyond_the_host_memory_fail_before_the_warm_start(train_fails):
    # sync mode: the worker's engine and the eval engine, each (paged) 10**6 sequences of 4096 tokens (and
    # the null block) x 512 bytes a token (2 layers x 2 kv heads x (16 + 16) dims x 4 bytes): about 3.8 TiB
    err = train_fails(
        "--set", "rollout.max_slots=1000000",
        "--set", "rollout.kv_token_budget=100000000000",
        "--set", "model.max_position_embeddings=4096",
    )  # fmt: skip
    assert err.startswith(
        "moerl: config error: rollout.max_slots=1000000, rollout.kv_token_budget=100000000000: the run "
        "needs about 3906.3 GiB of host memory (2 rollout engine KV cache(s) of 1953.13 GiB each, "
        "4096000016 tokens in blocks of 16, plus 2 copies of the policy weights of "
    ), err
    assert "GiB is available (" in err and err.endswith("lower rollout.max_slots or rollout.kv_token_budget")


def test_reward_fn_with_the_wrong_signature_fails_before_the_warm_start(train_fails):
    err = train_fails("--set", "task.reward_fn=json:loads")  # loads(s, *, ...): one positional argument
    assert err.startswith(
        "moerl: config error: task.reward_fn='json:loads' cannot be called as fn(prompt_text, "
        "response_text, answer), the way moerl calls a reward function: its signature (s, *, "
    ), err
    assert err.endswith("gives 'too many positional arguments'")


@pytest.mark.parametrize("section", ["model", "rollout", "cluster.train"])
def test_a_section_set_to_null_is_refused(train_fails, section):
    err = train_fails("--set", f"{section}=null")
    expected = f"{section}: a section cannot be null; set its fields instead ({section}.<field>=...)"
    assert err == f"moerl: config error: {expected}"


def test_a_null_section_in_a_yaml_file_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer: {steps: 5}\nmodel:\n")  # `model:` with nothing under it is YAML null
    with pytest.raises(ConfigError, match=r"^model: a section cannot be null; set its fields instead"):
        load_config(path)
    assert load_config(None, ["model.hidden_size=32"]).model.hidden_size == 32  # a field is still fine


def test_dataset_that_is_not_utf8_names_the_line(train_fails, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n\xff\n')
    err = train_fails("--set", "task.name=jsonl", "--set", f"task.path={path}")
    assert err == f"moerl: config error: task.path: {path}:2: not UTF-8 text (invalid start byte at byte 1)"


# fourth fresh-user pass: damaged model folders, checked before the warm start


@pytest.mark.parametrize("field", ["init_from", "model.path"])
@pytest.mark.parametrize(
    ("kind", "message"),
    DAMAGED_FOLDER_MESSAGES,
)
def test_a_damaged_model_folder_fails_before_the_warm_start(train_fails, tmp_path, field, kind, message):
    folder = save_fresh_policy(tmp_path / "m")
    damage_model_folder(folder, kind)
    err = train_fails("--set", f"{field}={folder}")
    assert err.startswith(f"moerl: config error: {field}={str(folder)!r}: {folder}/{message}"), err


def test_a_folder_without_tokenizer_of_another_vocab_is_refused(train_fails, tmp_path):
    folder = save_fresh_policy(tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    hf = json.loads((folder / "config.json").read_text())
    builtin, hf["vocab_size"] = hf["vocab_size"], 151936  # a real model's vocabulary, its tokenizer left out
    (folder / "config.json").write_text(json.dumps(hf))
    err = train_fails("--set", f"init_from={folder}")
    assert err == (
        f"moerl: config error: init_from={str(folder)!r} has no tokenizer.json, and the built-in character "
        f"tokenizer the run would use instead has {builtin} tokens, not the model's vocab_size=151936: put "
        "the model's tokenizer.json in the folder or set task.tokenizer=PATH"
    )


def test_a_folder_without_tokenizer_says_the_run_uses_the_builtin_one(tmp_path, capsys):
    folder = save_fresh_policy(tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    check_policy_folders(load_config(None, [f"init_from={folder}"]))
    assert capsys.readouterr().err == (
        f"moerl: init_from={str(folder)!r} has no tokenizer.json: the run uses the built-in character "
        f"tokenizer ({load_tokenizer(None).vocab_size} tokens, the model's vocab_size); set "
        "task.tokenizer=PATH for another\n"
    )
    load_tokenizer(None).save(tmp_path / "tok")
    check_policy_folders(load_config(None, [f"init_from={folder}", f"task.tokenizer={tmp_path / 'tok'}"]))
    assert capsys.readouterr().err == ""  # a tokenizer given: nothing to say


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("garbage", "runtime.ray_address='garbage': expected host:port, ray://host:port, auto or local"),
        ("::1:6379", "runtime.ray_address='::1:6379': expected host:port, ray://host:port, auto or local"),
        ("head:99999", "runtime.ray_address='head:99999': expected host:port"),
        ("http://head:8265", "runtime.ray_address='http://head:8265' is an HTTP address (the dashboard's?)"),
        ("nosuchmodule://head", "runtime.ray_address='nosuchmodule://head': no Ray client for nosuchmodule://"),
    ],
)  # fmt: skip
def test_a_ray_address_ray_init_refuses_fails_before_the_warm_start(train_fails, address, expected):
    err = train_fails("--set", "runtime.mode=async", "--ray-address", address)
    assert err.startswith(f"moerl: config error: {expected}"), err
