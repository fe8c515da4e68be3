"""Configuration of the learner service (`python -m services.learner --help`)."""

from __future__ import annotations

import dataclasses
import pathlib

from services.common import flags
from services.common.config import ConfigError, check_fields, opt
from services.common.server import ServerConfig
from services.common.service_plan import DRY_RUN_HELP
from services.learner.deepspeed_setup import DeepSpeedOptions
from services.learner.logprob_head import HEADS


@dataclasses.dataclass
class LearnerConfig(ServerConfig, DeepSpeedOptions):
    """The learner: DeepSpeed actor (policy) and optional critic over N ranks; rank 0 serves gRPC."""

    pretrain: str = opt("", "folder of the Hugging Face causal LM to train as the actor (required)")
    critic_pretrain: str = opt("", "folder of the model the critic starts from (a reward model or a causal LM); "
                               "empty = no critic (GRPO, RLOO, REINFORCE++)")
    actor_learning_rate: float = flags.ACTOR_LEARNING_RATE.field(1e-6)
    critic_learning_rate: float = flags.CRITIC_LEARNING_RATE.field(9e-6)
    use_dynamic_batch: bool = flags.USE_DYNAMIC_BATCH.field(False)
    train_max_tokens_per_gpu: int = flags.TRAIN_MAX_TOKENS_PER_GPU.field(16384)
    rollout_max_tokens_per_gpu: int = opt(0, "with --use_dynamic_batch: most tokens in one micro-batch of a packed "
                                          "LogProbs / Values call on one rank; 0 = --train_max_tokens_per_gpu")
    micro_forward_batch_size: int = opt(8, "samples per forward pass on one rank in LogProbs and Values")
    logprobs_head: str = opt("full", "training: how response log-probs come from the model. full: the model's "
                             "logits, log-softmax over them; chunked: from the hidden states of the response "
                             "tokens, --logprobs_chunk_tokens at a time, logits recomputed in the backward pass "
                             "(least memory); fused: from those hidden states in one pass that keeps d logp / "
                             "d logits (tokens x vocabulary in the model dtype) for a backward without "
                             "recomputation (fastest). chunked and fused: ZeRO stage 0-2",
                             choices=list(HEADS))
    logprobs_chunk_tokens: int = opt(4096, "--logprobs_head chunked: response tokens per chunk")
    weight_bucket_mb: int = opt(1024, "PushWeights: largest bucket of parameters sent in one broadcast, MiB")
    max_ckpt_num: int = flags.MAX_CKPT_NUM.field(3)
    use_ds_universal_ckpt: bool = opt(False, "LoadCheckpoint of a checkpoint saved under another --zero_stage (1-3) "
                                      "or number of ranks converts it to DeepSpeed's universal checkpoint (once, "
                                      "into its global_step_N/universal/) and loads that, keeping weights, "
                                      "optimizer states, LR schedule and step; without it such a checkpoint is "
                                      "refused")
    max_len: int = opt(0, "longest sequence (prompt + response) accepted, tokens; 0 = the model's "
                       "max_position_embeddings")
    num_gpus: int = opt(1, "ranks to run on this machine when no launcher set RANK / WORLD_SIZE (one per GPU; "
                        "on CPU, processes); rank 0 starts the others")
    rank: int = opt(-1, "this process's rank; -1 = from $RANK (0 when unset)")
    world_size: int = opt(0, "number of ranks of the learner (all nodes); 0 = from $WORLD_SIZE, else num_gpus")
    local_rank: int = opt(-1, "GPU index of this rank on its node; -1 = from $LOCAL_RANK, else rank")
    master_addr: str = opt("", "address of rank 0's rendezvous store; empty = $MASTER_ADDR or 127.0.0.1")
    master_port: int = opt(0, "port of rank 0's rendezvous store; 0 = $MASTER_PORT, or a free port when rank 0 "
                           "starts the ranks itself")
    dist_timeout_s: float = opt(600.0, "bound on every collective between ranks, seconds: a rank that stops "
                                "answering fails the call instead of hanging it")
    startup_timeout_s: float = opt(600.0, "how long rank 0 waits for every rank to start and load the models")
    heartbeat_timeout_s: float = opt(60.0, "a rank whose heartbeat stops for this long is declared dead")
    cancel_grace_s: float = opt(30.0, "when a call's caller has gone (deadline, cancel), the ranks stop at the next "
                                      "optimizer step or forward pass; if they have not within this many seconds, "
                                      "health reports NOT_SERVING until they have")
    dry_run: bool = opt(False, DRY_RUN_HELP)

    def validate(self) -> None:
        self.validate_server()
        check_fields(self)
        self.apply_deepspeed_file()  # before the checks that read the ZeRO stage
        if not self.pretrain:
            raise ConfigError("--pretrain is required: the folder of the actor's Hugging Face model")
        for name in ("pretrain", "critic_pretrain"):
            path = getattr(self, name)
            if path and not (pathlib.Path(path) / "config.json").is_file():
                raise ConfigError(f"--{name} {path}: no Hugging Face model there (config.json is missing)")
        self.validate_lora(self.pretrain)  # the actor's adapter; the critic trains in full
        if self.num_gpus < 1:
            raise ConfigError(f"--num_gpus {self.num_gpus} must be >= 1")
        if self.use_dynamic_batch and not self.packing_samples:
            raise ConfigError("--use_dynamic_batch sizes micro-batches by their tokens, which needs --packing_samples "
                              "(samples end to end, no padding): add --packing_samples, or drop --use_dynamic_batch")
        if self.rollout_max_tokens_per_gpu < 0:
            raise ConfigError(f"--rollout_max_tokens_per_gpu {self.rollout_max_tokens_per_gpu} must be >= 0 "
                              "(0 = --train_max_tokens_per_gpu)")
        if self.micro_forward_batch_size < 1:
            raise ConfigError(f"--micro_forward_batch_size {self.micro_forward_batch_size} must be >= 1")
        if self.logprobs_chunk_tokens < 1:
            raise ConfigError(f"--logprobs_chunk_tokens {self.logprobs_chunk_tokens} must be >= 1")
        if self.logprobs_head != "full" and self.zero_stage == 3:
            raise ConfigError(f"--logprobs_head {self.logprobs_head} needs --zero_stage 0, 1 or 2 (under ZeRO-3 the "
                              "output projection is sharded); use --logprobs_head full")
        if self.weight_bucket_mb < 1:
            raise ConfigError(f"--weight_bucket_mb {self.weight_bucket_mb} must be >= 1")
        if self.dist_timeout_s <= 0 or self.heartbeat_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ConfigError("--dist_timeout_s, --startup_timeout_s and --heartbeat_timeout_s must be > 0")
        if self.cancel_grace_s <= 0:
            raise ConfigError(f"--cancel_grace_s {self.cancel_grace_s} must be > 0")
        # The data-parallel degree is only known for sure once the ranks are resolved; check what
        # can be checked now.
        self.validate_deepspeed(self.world_size or None)
