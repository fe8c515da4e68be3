"""The tiny-model and data kit: determinism, loadability by transformers, chat template, data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from services.common.tiny import (
    make_data,
    make_tiny_model,
    main_make_data,
    main_make_tiny_model,
)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Models


def test_same_seed_gives_identical_bytes(tiny_model_dir, tiny_model_dir_b, tmp_path):
    again = make_tiny_model(tmp_path / "again", seed=0)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    # Another seed: other weights, but the same tokenizer and config so weights can be swapped.
    assert (tiny_model_dir_b / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()
    for name in ["tokenizer.json", "config.json"]:
        assert (tiny_model_dir_b / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_transformers_loads_tiny_model(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert 300_000 <= n_params(model) <= 1_000_000
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3

    batch = tokenizer(["12+7=", "The answer is \\boxed{19}"], return_tensors="pt", padding=True)
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch,size,low,high", [("llama", "tiny", 300_000, 1_000_000), ("qwen2", "small", 1_000_000, 5_000_000)])
def test_other_arch_and_size_load(tmp_path, arch, size, low, high):
    path = make_tiny_model(tmp_path / f"{arch}_{size}", arch=arch, size=size, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    assert low <= n_params(model) <= high
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("3+4=", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (1, ids.shape[1] + 4)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_tied_models_share_the_embedding_as_their_head(tmp_path, arch):
    """--tied: the head is the embedding matrix (as in SmolLM2, Qwen2.5 up to 3B); the file holds no head."""
    from safetensors import safe_open

    assert main_make_tiny_model([str(tmp_path / arch), "--arch", arch, "--tied"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / arch)
    assert model.config.model_type == arch and model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(str(tmp_path / arch / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    with pytest.raises(SystemExit):
        main_make_tiny_model([str(tmp_path / "rm"), "--reward", "--tied"])


def test_qwen25_05b_shape_has_its_layers_and_room_for_long_responses():
    """The GPU benchmarks' size: Qwen2.5-0.5B's layers with this tokenizer (built on the meta device: no weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.common.tiny import _config_kwargs, build_tokenizer

    config = Qwen2Config(**_config_kwargs(build_tokenizer(), "qwen2.5-0.5b"))
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (896, 4864, 24)
    assert (config.num_attention_heads, config.num_key_value_heads, config.max_position_embeddings) == (14, 2, 2048)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert 355_000_000 <= n_params(model) <= 362_000_000


def test_tokenizer_round_trips_and_splits_digits(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "What is 123+45? The answer is \\boxed{168}. Café, naïve  spaces\nnew line"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.tokenize("2024") == ["2", "0", "2", "4"]
    # No special token is added implicitly: the chat template alone decides the framing.
    assert tokenizer("12+7=")["input_ids"] == tokenizer.encode("12+7=", add_special_tokens=False)


def test_chat_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7="}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    ids = tokenizer(text)["input_ids"]
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3 and ids.count(tokenizer.eos_token_id) == 2
    assert tokenizer.eos_token == "<|im_end|>"


def test_reward_model_scores_last_real_token(tiny_reward_model_dir, tiny_model_dir):
    assert (tiny_reward_model_dir / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    texts = ["12+7=The answer is \\boxed{19}", "1+1=2"]
    with torch.no_grad():
        alone = torch.cat([model(**tokenizer([t], return_tensors="pt")).logits for t in texts])
        tokenizer.padding_side = "right"
        batched = model(**tokenizer(texts, return_tensors="pt", padding=True)).logits
    assert batched.shape == (2, 1)
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(batched[0], batched[1])


# ---------------------------------------------------------------------------------------------
# Data

ARITH = re.compile(r"^(\d+)([+-])(\d+)=$")


def solve(prompt: str) -> int:
    match = ARITH.match(prompt)
    assert match, prompt
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return a + b if op == "+" else a - b


def test_arith_sets_are_disjoint_and_correct(tiny_data_dir):
    train = read_jsonl(tiny_data_dir / "arith_train.jsonl")
    test = read_jsonl(tiny_data_dir / "arith_test.jsonl")
    assert len(train) >= 1000 and len(test) >= 100
    train_prompts = {row["prompt"] for row in train}
    test_prompts = {row["prompt"] for row in test}
    assert len(train_prompts) == len(train) and len(test_prompts) == len(test)
    assert not train_prompts & test_prompts
    for row in train + test:
        assert set(row) == {"prompt", "label"}
        assert isinstance(row["label"], str) and int(row["label"]) == solve(row["prompt"])
    assert {"+", "-"} <= {ARITH.match(row["prompt"]).group(2) for row in train}


def test_sft_and_preference_pairs(tiny_data_dir):
    train_prompts = {row["prompt"] for row in read_jsonl(tiny_data_dir / "arith_train.jsonl")}
    boxed = re.compile(r"\\boxed\{(-?\d+)\}$")
    sft = read_jsonl(tiny_data_dir / "sft.jsonl")
    assert len(sft) >= 500
    for row in sft:
        assert set(row) == {"prompt", "response"} and row["prompt"] in train_prompts
        assert int(boxed.search(row["response"]).group(1)) == solve(row["prompt"])
    prefs = read_jsonl(tiny_data_dir / "prefs.jsonl")
    assert len(prefs) >= 200
    for row in prefs:
        assert set(row) == {"prompt", "chosen", "rejected"} and row["prompt"] in train_prompts
        assert int(boxed.search(row["chosen"]).group(1)) == solve(row["prompt"])
        assert int(boxed.search(row["rejected"]).group(1)) != solve(row["prompt"])


def test_data_is_deterministic_from_seed(tiny_data_dir, tmp_path):
    same = make_data(tmp_path / "same", seed=0)
    other = make_data(tmp_path / "other", seed=1)
    for name in ["arith_train.jsonl", "arith_test.jsonl", "sft.jsonl", "prefs.jsonl"]:
        assert (same / name).read_bytes() == (tiny_data_dir / name).read_bytes(), name
        assert (other / name).read_bytes() != (tiny_data_dir / name).read_bytes(), name


# ---------------------------------------------------------------------------------------------
# Command line


def test_command_line_entry_points(tmp_path, capsys):
    assert main_make_data([str(tmp_path / "data"), "--seed", "2"]) == 0
    assert (tmp_path / "data" / "prefs.jsonl").exists()
    assert main_make_tiny_model([str(tmp_path / "rm"), "--reward", "--seed", "1"]) == 0
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert main_make_tiny_model([str(tmp_path / "lm"), "--arch", "llama"]) == 0
    assert json.loads((tmp_path / "lm" / "config.json").read_text())["model_type"] == "llama"
    assert str(tmp_path / "lm") in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main_make_tiny_model([str(tmp_path / "bad"), "--arch", "gpt2"])
