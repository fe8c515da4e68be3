"""SFT on plain-text pairs (no chat template) trains on OpenRLHF 0.11's text: the prompt formatted
by --input_template (default "User: {}\\nAssistant: "), the response, " " + eos, tokenized as one
piece without special tokens, with the loss on every token after the prompt's own token count.

The reference tokens below are written out by hand from that definition and the tiny tokenizer's
vocabulary (services/common/tiny.py), not produced by the code under test."""

from __future__ import annotations

import json

import pytest

from services.common.config import parse_config
from services.common.datasets import load_sft, openrlhf_sft_pair
from services.common.tiny import build_tokenizer
from services.learner.train_sft import OPENRLHF_SFT_TEMPLATE, SFTConfig, SFTTrainer

ROW = {"question": "2+3=", "response": "The answer is \\boxed{5}"}
# "User: 2+3=\nAssistant: The answer is \boxed{5} <|im_end|>" as one piece:
TOKENS = ["U", "s", "er", ":", "Ġ", "2", "+", "3", "=", "Ċ", "A", "s", "s", "istan", "t", ":", "ĠThe", "Ġanswer",
          "Ġis", "Ġ\\", "boxed", "{", "5", "}", "Ġ", "<|im_end|>"]
# The prompt "User: 2+3=\nAssistant: " alone is 17 tokens (its trailing space a token of its own); in
# the whole text that space joins "The" (token 16), so the loss starts at token 17, " answer": "The" is
# not trained, as in OpenRLHF.
TRAINED = ["Ġanswer", "Ġis", "Ġ\\", "boxed", "{", "5", "}", "Ġ", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_template") / "rows.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    return path


def test_openrlhf_default_template_text_ids_and_loss_mask(tokenizer, data):
    assert OPENRLHF_SFT_TEMPLATE == "User: {}\nAssistant: "
    (ex,) = load_sft(data, tokenizer=tokenizer, input_key="question", output_key="response",
                     input_template=OPENRLHF_SFT_TEMPLATE, shuffle=False)
    assert tokenizer.convert_ids_to_tokens(list(ex.input_ids)) == TOKENS
    assert ex.loss_mask == (0,) * 17 + (1,) * 9
    assert [t for t, m in zip(TOKENS, ex.loss_mask) if m] == TRAINED
    assert tokenizer.decode(ex.input_ids) == "User: 2+3=\nAssistant: The answer is \\boxed{5} <|im_end|>"


def test_template_without_a_trailing_space_trains_the_whole_response(tokenizer):
    ids, mask = openrlhf_sft_pair(tokenizer, "Q: 2+3=\nA:", "The answer is \\boxed{5}")
    assert tokenizer.convert_ids_to_tokens(list(ids)) == ["Q", ":", "Ġ", "2", "+", "3", "=", "Ċ", "A", ":", "The",
                                                          "Ġanswer", "Ġis", "Ġ\\", "boxed", "{", "5", "}", "Ġ",
                                                          "<|im_end|>"]
    assert mask == (0,) * 10 + (1,) * 10
    # Trailing newlines are stripped before " " + eos; a text already ending with eos gets none.
    ids, _ = openrlhf_sft_pair(tokenizer, "Q: 2+3=\nA:", "5\n\n")
    assert tokenizer.decode(ids).endswith("A:5 <|im_end|>")
    ids, _ = openrlhf_sft_pair(tokenizer, "Q: 2+3=\nA:", "5<|im_end|>")
    assert tokenizer.decode(ids).endswith("A:5<|im_end|>")


def test_sft_trainer_uses_openrlhf_default_and_its_flag(tiny_model_dir, data, tokenizer):
    """`train_sft.sh` without --data.apply_chat_template: OpenRLHF's default template, or --data.input_template's
    value ('' = the raw prompt); with the chat template the default is not used."""
    base = ["--pretrain", str(tiny_model_dir), "--data.dataset", str(data), "--data.input_key", "question",
            "--data.output_key", "response"]

    def rows(*extra: str):
        config = parse_config(SFTConfig, base + list(extra))
        return config, SFTTrainer(config).load_rows(tokenizer, config.dataset, "")

    config, (ex,) = rows()
    assert config.input_template == OPENRLHF_SFT_TEMPLATE
    assert tokenizer.convert_ids_to_tokens(list(ex.input_ids)) == TOKENS
    _, (ex,) = rows("--data.input_template", "Q: {}\nA:")
    assert tokenizer.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if not m]) == "Q: 2+3=\nA:"
    _, (ex,) = rows("--input_template", "")
    assert tokenizer.decode(ex.input_ids) == "2+3=The answer is \\boxed{5} <|im_end|>"
    config, (ex,) = rows("--data.apply_chat_template")
    assert config.input_template == ""
    assert tokenizer.decode(ex.input_ids).startswith("<|im_start|>user\n2+3=<|im_end|>")
