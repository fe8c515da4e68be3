"""Tiny local models and data sets, built from nothing (no model hub, no downloads).

`make_tiny_model` writes a random-initialised Hugging Face causal LM (Qwen2 or Llama) with a
byte-level BPE tokenizer trained here on a built-in corpus and a ChatML chat template; both
transformers and vLLM load the folder. `make_tiny_reward_model` writes the same with a one-label
sequence-classification head. `make_data` writes the arithmetic prompt sets, SFT pairs and
preference pairs that the tests and the quickstart train on.

Everything is deterministic: the tokenizer depends on nothing but this file, the weights only on
the seed (same seed -> identical bytes on disk), the data only on the seed.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# ----------------------------------------------------------------------------------------------
# Tokenizer

BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"  # chat turns end here, so generation stops at the end of a reply
PAD_TOKEN = "<|pad|>"  # distinct from eos: reward models find the last real token by pad id
IM_START = "<|im_start|>"
SPECIAL_TOKENS = [BOS_TOKEN, PAD_TOKEN, IM_START, EOS_TOKEN]
VOCAB_SIZE = 1024  # upper bound; the built-in corpus yields ~660 tokens, all of them used
# GPT-4 style split with single digits (the regex of transformers' Qwen2Tokenizer).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ENGLISH = """\
The answer is the number in the box. Let us think step by step. First add the two numbers, then
write the result. We subtract the second number from the first one. What is the sum of these
numbers? What is the difference? Please put your final answer in a box. The result is correct.
That answer is wrong, try again. You are a helpful model that solves simple arithmetic problems.
A small model learns to count, to add and to subtract. Reinforcement learning rewards the right
answer and the policy improves over many steps. The reward is one when the answer matches the
label and zero otherwise. Good morning, how are you today? I am fine, thank you. Here is a short
story about a cat and a dog who lived in a house near the river. Every day the cat would sit by
the window and watch the birds, while the dog played in the garden with a red ball. One evening
the rain came, and both of them slept together by the warm fire. The teacher asked the class to
write the numbers from zero to one hundred. Seven plus five equals twelve. Ten minus four equals
six. Twenty and thirty make fifty. The question has one answer and it is a whole number.
"""


def _tokenizer_corpus() -> list[str]:
    """A fixed corpus: English, arithmetic in the prompt/answer formats, chat-formatted turns."""
    rng = random.Random(20261129)  # fixed: the tokenizer must not depend on the model seed
    lines = _ENGLISH.splitlines()
    for _ in range(3000):
        a, b = rng.randrange(100), rng.randrange(100)
        op = rng.choice("+-")
        c = a + b if op == "+" else a - b
        lines.append(f"{a}{op}{b}={c}")
        lines.append(f"{a} {op} {b} = {c}. The answer is \\boxed{{{c}}}")
        lines.append(
            f"{IM_START}user\n{a}{op}{b}={EOS_TOKEN}\n{IM_START}assistant\n"
            f"The answer is \\boxed{{{c}}}{EOS_TOKEN}\n"
        )
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Trains the byte-level BPE tokenizer on the built-in corpus (well under a second).

    Normalizer and pre-tokenizer are exactly those transformers' Qwen2Tokenizer rebuilds on load
    (NFC, its split regex with one digit per piece, byte-level), so every loader (Qwen2Tokenizer,
    the generic fast tokenizer, vLLM) tokenizes identically. One digit per token also makes
    numbers tokenize the same wherever they occur, which helps a small model learn arithmetic.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=1024,
        padding_side="left",  # generation batches are left-padded
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# ----------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 1024


# head_dim is 32 in tiny and small, 64 in qwen2.5-0.5b: sizes every vLLM CPU/GPU attention backend supports.
SHAPES = {
    "tiny": ModelShape(128, 256, 2, 4, 2),  # ~0.56M parameters: unit and service tests
    "small": ModelShape(256, 512, 4, 8, 4),  # ~3.2M parameters: the CPU quickstart
    # Qwen2.5-0.5B's layers with this tokenizer's vocabulary (~359M parameters): GPU benchmarks.
    # 2048 positions leave room for a prompt and a 1,024-token response.
    "qwen2.5-0.5b": ModelShape(896, 4864, 24, 14, 2, max_position_embeddings=2048),
}


def _config_kwargs(tokenizer: PreTrainedTokenizerFast, size: str, tied: bool = False) -> dict:
    if size not in SHAPES:
        raise ValueError(f"size must be one of {sorted(SHAPES)}, got {size!r}")
    shape = SHAPES[size]
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        # tied: the output head is the embedding matrix, as in SmolLM2 and Qwen2.5 up to 3B.
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


ARCHS = ("qwen2", "llama", "qwen3", "mistral", "mixtral")  # make_tiny_model's architectures


def _save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # The weights file is written owner-only (0600); a model folder is read by services running as
    # other users (the images' uid 1000, a mounted volume), so it gets the usual 0644.
    for path in out_dir.iterdir():
        if path.is_file():
            path.chmod(0o644)
    return out_dir


def make_tiny_model(out_dir: str | Path, arch: str = "qwen2", size: str = "tiny", seed: int = 0,
                    tied: bool = False) -> Path:
    """Writes a random-initialised causal LM with its tokenizer into out_dir; returns the path.

    arch: "qwen2" (Qwen2ForCausalLM), "llama" (LlamaForCausalLM) or "mixtral" (MixtralForCausalLM, a
    mixture of experts: 4 experts, 2 per token, the MLP size split among them); size: a key of SHAPES
    ("tiny", "small", "qwen2.5-0.5b").
    arch: also "qwen3" (Qwen3ForCausalLM: q/k norms, no biases) or "mistral" (MistralForCausalLM);
    tied: the output head shares the embedding matrix (tie_word_embeddings; the checkpoint then
    holds no lm_head.weight). Untied by default: the tests and the quickstart were measured so.
    Weights are float32 on disk and depend only on seed.
    """
    tokenizer = build_tokenizer()
    kwargs = _config_kwargs(tokenizer, size, tied)
    head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if arch == "qwen2":
        config, model_cls = Qwen2Config(**kwargs), Qwen2ForCausalLM
    elif arch == "llama":
        config, model_cls = LlamaConfig(**kwargs, attention_bias=False, mlp_bias=False), LlamaForCausalLM
    elif arch == "qwen3":
        config, model_cls = Qwen3Config(**kwargs, head_dim=head_dim), Qwen3ForCausalLM
    elif arch == "mistral":
        config, model_cls = MistralConfig(**kwargs, head_dim=head_dim, sliding_window=None), MistralForCausalLM
    elif arch == "mixtral":
        kwargs["intermediate_size"] //= 2  # 4 experts, 2 active: about the dense model's compute per token
        config, model_cls = MixtralConfig(**kwargs, num_local_experts=4, num_experts_per_tok=2), MixtralForCausalLM
    else:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # Generation stops at the end of a chat turn or at end-of-text, whichever comes first.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.bos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    return _save(model, tokenizer, Path(out_dir))


def make_tiny_reward_model(out_dir: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Writes a random Qwen2ForSequenceClassification (num_labels=1) with the same tokenizer.

    The score of a sequence is the head's output at its last non-pad token (found by pad id).
    """
    tokenizer = build_tokenizer()
    config = Qwen2Config(**_config_kwargs(tokenizer, size), num_labels=1)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config).to(torch.float32).eval()
    return _save(model, tokenizer, Path(out_dir))


# ----------------------------------------------------------------------------------------------
# Data

MAX_OPERAND = 50  # operands are 0..49; subtraction results are never negative
TEST_SIZE = 200
TRAIN_SIZE = 2000
SFT_SIZE = 1000
PREFS_SIZE = 500


def arith_prompt(a: int, op: str, b: int) -> str:
    """The prompt format shared by every data file: "12+7=" style."""
    return f"{a}{op}{b}="


def boxed_response(answer: int) -> str:
    """The response format the SFT data teaches and the math rule reward reads."""
    return f"The answer is \\boxed{{{answer}}}"


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def make_data(out_dir: str | Path, seed: int = 0) -> Path:
    """Writes the JSONL data sets into out_dir; returns the path.

    arith_train.jsonl / arith_test.jsonl: {"prompt": "12+7=", "label": "19"}, disjoint prompts.
    sft.jsonl: {"prompt", "response"}, response ends with the answer in \\boxed{}.
    prefs.jsonl: {"prompt", "chosen", "rejected"}, chosen correct, rejected a wrong answer.
    SFT and preference prompts come from the training split only.
    """
    rng = random.Random(seed)
    problems = [(a, "+", b, a + b) for a in range(MAX_OPERAND) for b in range(MAX_OPERAND)]
    problems += [(a, "-", b, a - b) for a in range(MAX_OPERAND) for b in range(a + 1)]
    rng.shuffle(problems)
    test, train = problems[:TEST_SIZE], problems[TEST_SIZE : TEST_SIZE + TRAIN_SIZE]

    def arith_rows(items):
        return [{"prompt": arith_prompt(a, op, b), "label": str(c)} for a, op, b, c in items]

    sft_rows = [
        {"prompt": arith_prompt(a, op, b), "response": boxed_response(c)} for a, op, b, c in train[:SFT_SIZE]
    ]
    pref_rows = []
    for a, op, b, c in rng.sample(train, PREFS_SIZE):
        wrong = c + rng.choice([-1, 1]) * rng.randint(1, 10)
        pref_rows.append(
            {"prompt": arith_prompt(a, op, b), "chosen": boxed_response(c), "rejected": boxed_response(wrong)}
        )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "arith_train.jsonl", arith_rows(train))
    _write_jsonl(out / "arith_test.jsonl", arith_rows(test))
    _write_jsonl(out / "sft.jsonl", sft_rows)
    _write_jsonl(out / "prefs.jsonl", pref_rows)
    return out


# ----------------------------------------------------------------------------------------------
# Command line: `rlmesh make-tiny-model OUT` and `rlmesh make-data OUT`


def main_make_tiny_model(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog="rlmesh make-tiny-model",
        description="Write a random-initialised tiny model with a locally trained tokenizer (no downloads).",
    )
    parser.add_argument("out", help="output folder (created if missing)")
    parser.add_argument("--arch", default="qwen2", choices=list(ARCHS),
                        help="model architecture (mixtral: a mixture of experts)")
    parser.add_argument("--tied", action="store_true",
                        help="tie the output head to the embedding matrix (tie_word_embeddings), as SmolLM2 and "
                             "Qwen2.5 up to 3B do")
    parser.add_argument(
        "--size", default="tiny", choices=sorted(SHAPES), help="tiny (~0.6M params, tests), small (~3M, quickstart) or qwen2.5-0.5b (~359M, GPU benchmarks)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (same seed, same bytes)")
    parser.add_argument(
        "--reward", action="store_true", help="write a reward model (Qwen2 sequence classification, one label) instead"
    )
    args = parser.parse_args(argv)
    if args.reward:
        if args.arch != "qwen2":
            parser.error("--reward builds a Qwen2 reward model; drop --arch or use --arch qwen2")
        if args.tied:
            parser.error("--reward builds a reward model, which has no output head to tie; drop --tied")
        path = make_tiny_reward_model(args.out, seed=args.seed, size=args.size)
    else:
        path = make_tiny_model(args.out, arch=args.arch, size=args.size, seed=args.seed, tied=args.tied)
    print(path)
    return 0


def main_make_data(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog="rlmesh make-data",
        description="Write the arithmetic, SFT and preference JSONL data sets (deterministic, local).",
    )
    parser.add_argument("out", help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed for the train/test split and pairs")
    args = parser.parse_args(argv)
    print(make_data(args.out, seed=args.seed))
    return 0
