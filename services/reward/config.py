"""Configuration of the reward service: which reward source, the reference model, and their limits."""

from __future__ import annotations

import dataclasses
import math
import pathlib

from services.common import flags
from services.common.config import ConfigError, check_fields, opt
from services.common.server import ServerConfig
from services.common.service_plan import DRY_RUN_HELP
from services.common.openrlhf_compat import check_imports
from services.reward.function_worker import split_file_target
from services.reward.grpc_source import SCHEME as GRPC_SCHEME
from services.reward.rules import RULES


@dataclasses.dataclass
class RewardConfig(ServerConfig):
    """Reward and reference service: `python -m services.reward --reward_pretrain DIR | --remote_rm_url URLS |
    --reward_func math [--ref_pretrain DIR]`."""

    # Reward source: exactly one of these three, or none for a reference-only deployment.
    reward_pretrain: str = opt("", "reward model folder (Hugging Face sequence classification with one label, or "
                                   "the value-head layout); serves RewardService")
    remote_rm_url: str = opt("", "remote reward: comma-separated HTTP URLs (http://host:5000/get_reward,...), "
                                 "comma-separated gRPC servers (grpc://host:port,...), or a Python file defining "
                                 "reward_func(queries, prompts, labels, **kwargs) (OpenRLHF) or compute_score("
                                 "data_source, solution_str, ground_truth, extra_info) (veRL); FILE.py:NAME "
                                 "picks another function")
    reward_func: str = opt("", f"built-in rule reward(s), comma-separated, rewards add up: {', '.join(RULES)}")
    # Reference role.
    ref_pretrain: str = opt("", "reference model folder (causal LM); serves ReferenceService (RefLogProbs)")

    # Models.
    device: str = opt("auto", "device of the reward and reference models: auto (cuda if present), cpu, cuda, cuda:N")
    reward_dtype: str = opt("auto", "reward model dtype; auto = bf16 on GPU, fp32 on CPU", choices=["auto", "bf16", "fp32"])
    ref_dtype: str = opt("auto", "reference model dtype; must match the learner's for identical log-probs",
                         choices=["auto", "bf16", "fp32"])
    attn_implementation: str = opt("sdpa", "attention kernel of both models (as the learner's for identical "
                                           "log-probs): sdpa, eager, flash_attention_2")
    reward_micro_batch_size: int = opt(16, "sequences per reward model forward pass (sorted by length)")
    ref_micro_batch_size: int = opt(16, "sequences per reference model forward pass (sorted by length)")
    reward_input: str = opt("text", "what the reward model scores: the sample's query text, tokenized with the "
                                    "reward model's tokenizer as is (no special tokens added), or the "
                                    "prompt + response token ids of the request", choices=["text", "token_ids"])
    value_head_prefix: str = opt("", "name of the reward head's weights; empty: the checkpoint config's "
                                     "value_head_prefix, else 'score'")
    normalize_reward: bool = flags.NORMALIZE_REWARD.field(False)

    # Rewards of every source.
    reward_clip_range: list[float] = opt([-10.0, 10.0], "clip final rewards to [LOW HIGH]; give no values to "
                                                        "turn clipping off")

    # Remote servers and reward function files.
    remote_rm_batch_size: int = flags.REMOTE_RM_BATCH_SIZE.field(64)
    remote_rm_max_in_flight: int = opt(8, "calls to remote reward servers (all URLs together) or reward "
                                          "functions running at once")
    remote_rm_timeout_s: float = opt(60.0, "time limit of one call to a remote reward server, seconds")
    remote_rm_retries: int = opt(3, "extra attempts per call after connection errors, timeouts and 5xx / "
                                    "UNAVAILABLE (never after 4xx or a bad answer)")
    remote_rm_backoff_s: float = opt(0.5, "first back-off before a retry, seconds; doubles per retry, with jitter")
    remote_rm_backoff_max_s: float = opt(8.0, "longest back-off before a retry, seconds")
    remote_rm_tls_ca: str = opt("", "PEM CA bundle for TLS to grpc:// reward servers; empty: plaintext")
    recent_answers: int = opt(1024, "Score answers kept by request id, so that a batch a caller sends again "
                                    "(after a lost reply) is answered without scoring it twice; 0 = keep none")
    reward_func_timeout_s: float = opt(300.0, "time limit of one reward function call (one batch), seconds")
    dry_run: bool = opt(False, DRY_RUN_HELP)

    # Rule rewards.
    math_correct_reward: float = opt(1.0, "math rule: reward of a correct final answer")
    math_wrong_reward: float = opt(0.0, "math rule: reward of a wrong final answer")
    math_no_answer_reward: float = opt(0.0, "math rule: reward when no answer is found (for simpleRL-reason's "
                                            "levels, which give -1 to any response without \\boxed, use "
                                            "--reward_func simplerl_math)")
    math_verify_timeout_s: int = opt(5, "math rule: time limit of each math-verify parse and comparison per "
                                        "sample, whole seconds (it uses SIGALRM); a sample past it counts as wrong")
    math_verify_workers: int = opt(2, "math rule: worker processes running math-verify")
    format_pattern: str = opt(r"<think>.+?</think>\s*<answer>.+?</answer>",
                              "format rule: regular expression the whole response must match (dot matches newlines)")
    format_reward: float = opt(1.0, "format rule: reward when the response matches --format_pattern (else 0)")

    # Derived in validate().
    remote_kind: str = opt("", "derived: http, grpc or function when --remote_rm_url is set", derived=True)
    remote_urls: list[str] = opt([], "derived: the parsed --remote_rm_url entries", derived=True)
    rules: list[str] = opt([], "derived: the parsed --reward_func names", derived=True)

    def validate(self) -> None:
        self.validate_server()
        check_fields(self)
        sources = [name for name in ("reward_pretrain", "remote_rm_url", "reward_func") if getattr(self, name)]
        if len(sources) > 1:
            raise ConfigError(f"give one reward source, not {' and '.join('--' + s for s in sources)}")
        if not sources and not self.ref_pretrain:
            raise ConfigError("nothing to serve: give a reward source (--reward_pretrain, --remote_rm_url or "
                              "--reward_func) and/or --ref_pretrain")
        for name in ("reward_pretrain", "ref_pretrain"):
            path = getattr(self, name)
            if path and not (pathlib.Path(path) / "config.json").is_file():
                raise ConfigError(f"--{name} {path}: not a model folder (no config.json)")
        if self.remote_rm_url:
            self._parse_remote()
        if self.reward_func:
            self.rules = [r.strip() for r in self.reward_func.split(",") if r.strip()]
            unknown = [r for r in self.rules if r not in RULES]
            if unknown or not self.rules:
                raise ConfigError(f"--reward_func {self.reward_func}: unknown rule(s) {unknown}; choose from {list(RULES)}")
        if self.reward_clip_range and (len(self.reward_clip_range) != 2
                                       or not self.reward_clip_range[0] < self.reward_clip_range[1]):
            raise ConfigError(f"--reward_clip_range {self.reward_clip_range}: give LOW HIGH with LOW < HIGH, "
                              "or no values to turn clipping off")
        positive = ["reward_micro_batch_size", "ref_micro_batch_size",
                    "remote_rm_max_in_flight", "math_verify_timeout_s", "math_verify_workers"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be >= 1")
        for name in ("remote_rm_timeout_s", "reward_func_timeout_s", "remote_rm_backoff_s", "remote_rm_backoff_max_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"--{name} {value} must be a positive number of seconds")
        if self.remote_rm_retries < 0:
            raise ConfigError(f"--remote_rm_retries {self.remote_rm_retries} must be >= 0")
        if self.recent_answers < 0:
            raise ConfigError(f"--recent_answers {self.recent_answers} must be >= 0 (0 keeps none)")

    def _parse_remote(self) -> None:
        entries = [u.strip() for u in self.remote_rm_url.split(",") if u.strip()]
        file = split_file_target(entries[0])[0] if len(entries) == 1 else ""
        if file.endswith(".py"):
            if not pathlib.Path(file).is_file():
                raise ConfigError(f"--remote_rm_url {entries[0]}: no such reward function file")
            check_imports(file, "--remote_rm_url")  # what it imports of OpenRLHF must be provided
            self.remote_kind, self.remote_urls = "function", entries
            return
        if all(u.startswith(("http://", "https://")) for u in entries):
            self.remote_kind = "http"
        elif all(u.startswith(GRPC_SCHEME) and ":" in u.removeprefix(GRPC_SCHEME) for u in entries):
            self.remote_kind = "grpc"
        else:
            raise ConfigError(f"--remote_rm_url {self.remote_rm_url}: give http(s):// URLs, grpc://host:port "
                              "addresses (not mixed), or one .py file")
        self.remote_urls = entries
