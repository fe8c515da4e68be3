"""What the offline trainers (SFT, reward model, DPO) share: flags, batching, losses, the loop.

Each trainer (`train_sft.py`, `train_rm.py`, `train_dpo.py`) is an `OfflineTrainer` that says how
to read its rows, which model to load, and the loss of one micro-batch; `run` does the rest the same
way for all three: distributed start-up, data, the DeepSpeed engine from
`services.learner.deepspeed_setup`, epochs of optimizer steps, logging, evaluation, saving a
Hugging Face folder that the rollout and reward services load directly.

Batches: a global batch of train_batch_size rows per optimizer step; each rank takes its equal
slice and walks it in micro-batches of micro_train_batch_size (DeepSpeed accumulates the
gradients). Rows left over at the end of an epoch (fewer than a global batch) wait for the next
epoch's shuffle. A micro-batch's sequences go to the model right-padded, or with --packing_samples
end to end in one row without padding (the RL learner's packed form, `services.learner.batches`);
either way the outputs are read back in the padded layout, so the losses are the same functions.

Metrics are ratios (numerator, denominator) summed over micro-batches and ranks, so a logged loss
is the same number whatever the split into ranks and micro-batches. They go to the log and to
`{save_path}/metrics.jsonl` (one JSON object per line; `rlmesh plot` reads it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import time
import warnings
from pathlib import Path
from typing import ClassVar, Sequence

import torch
import torch.nn.functional as F

from services.common.config import ConfigError, opt
from services.common.log import get_logger, log_event
from services.common.flags import no_gpu_attention
from services.common.moe_check import check_aux_loss_coef
from services.common.logprobs import token_logprobs
from services.common.paths import resolve_path_fields
from services.common.rl_math import last_token_values
from services.learner import moe_aux, offline_checkpoint
from services.learner.batches import MicroBatch, Sample, collate
from services.learner.deepspeed_setup import (
    DeepSpeedOptions,
    build_engine,
    current_lr,
    deepspeed_config,
    init_distributed_from_env,
    load_pretrained,
)
from services.learner.logprob_head import forward_micro_batch
from services.learner.lora import LoraOptions, save_adapter

_log = get_logger("offline")

Ratios = dict[str, tuple[float, float]]  # metric name -> (numerator, denominator)


# ----------------------------------------------------------------------------------------------
# Flags shared by the three trainers (names and meanings of the seed documents' commands)


@dataclasses.dataclass
class PreferenceKeys:
    """Where preference rows keep their fields (the reward-model and DPO trainers)."""

    prompt_key: str = opt("prompt", "field of the prompt; rows without it hold whole conversations in the "
                          "chosen/rejected fields (message lists)")
    chosen_key: str = opt("chosen", "field of the preferred response (a string or a message list)")
    rejected_key: str = opt("rejected", "field of the dispreferred response (a string or a message list)")


@dataclasses.dataclass
class OfflineConfig(DeepSpeedOptions):
    """Flags of every offline trainer; DeepSpeed and optimizer flags come from DeepSpeedOptions."""

    # OpenRLHF 0.11's namespaced options are taken too (services/common/openrlhf_names.py).
    OPENRLHF_NAMESPACED: ClassVar[bool] = True

    pretrain: str = opt("", "local folder of the model to start from (Hugging Face format)")
    dataset: str = opt("", "training data: JSONL / JSON / Parquet / Arrow / CSV files or datasets.save_to_disk "
                       "folders, comma separated")
    dataset_probs: str = opt("", "blending probabilities of --dataset, comma separated; empty = every row once")
    eval_dataset: str = opt("", "evaluation data (same formats); empty = no evaluation")
    max_samples: int = opt(100_000_000, "use at most this many training rows (and evaluation rows)")
    max_len: int = opt(2048, "rows longer than this many tokens (prompt + response) are skipped")
    apply_chat_template: bool = opt(False, "render rows with the tokenizer's chat template")
    input_template: str = opt("", "format string with {} for the prompt, e.g. 'Question: {}\\nAnswer: '")
    strict: bool = opt(False, "stop at the first bad row instead of skipping bad rows")
    learning_rate: float = opt(5e-6, "peak learning rate")
    max_epochs: int = opt(1, "passes over the training data")
    save_path: str = opt("./ckpt/model", "output folder: the trained model in Hugging Face format, with its "
                         "tokenizer and metrics.jsonl")
    save_steps: int = opt(-1, "every N optimizer steps save a resumable DeepSpeed checkpoint to --ckpt_path and the "
                          "model to {save_path}/global_step_N; -1 = only the final model at the end")
    ckpt_path: str = opt("", "folder of the resumable checkpoints (global_step_N/, latest); empty = "
                         "{save_path}/checkpoints")
    load_checkpoint: bool = opt(False, "resume from the newest complete checkpoint under --ckpt_path (its step, data "
                                "position, optimizer and schedule); none there: start anew")
    max_ckpt_num: int = opt(3, "checkpoints kept under --ckpt_path (the oldest are removed)")
    use_ds_universal_ckpt: bool = opt(False, "--load_checkpoint of a checkpoint saved under another --zero_stage "
                                      "(1-3) or number of ranks: convert it to DeepSpeed's universal checkpoint "
                                      "(once, into its global_step_N/universal/) and load that; without it such a "
                                      "checkpoint is refused")
    eval_steps: int = opt(-1, "evaluate every N optimizer steps (also before training and at the end); "
                          "-1 = only before and after training")
    logging_steps: int = opt(1, "log training metrics every N optimizer steps")
    aux_loss_coef: float = opt(0.0, "MoE models: weight of the router's load-balancing loss added to each "
                               "micro-batch's loss (transformers' aux_loss with output_router_logits); 0 = none")
    flash_attn: bool = opt(False, "FlashAttention 2 (GPU only; on CPU a warning and sdpa)")
    local_rank: int = opt(-1, "set by the deepspeed launcher (LOCAL_RANK is read from the environment)")
    lr_scheduler: str = opt("cosine_with_min_lr", "learning-rate schedule after the linear warm-up",
                            choices=["constant_with_warmup", "cosine_with_min_lr"])
    micro_train_batch_size: int = opt(8, "rows per forward/backward pass on one rank (a row: one example or one pair)")
    seed: int = opt(42, "seed of the data order (and of new weights, e.g. a reward model's head)")
    packing_samples: bool = opt(False, "concatenate each micro-batch's sequences (SFT examples; the chosen and "
                                "rejected sequences of RM / DPO pairs) into one row without padding; attention "
                                "stays within each sequence (sdpa finds the boundaries from the position ids, "
                                "--attn_implementation varlen and --flash_attn are given them)")
    dry_run: bool = opt(False, "check the flags, the model folder and the data, print the plan (ranks, steps, a "
                        "memory estimate) and exit; nothing is started")
    max_steps: int = opt(0, "optimizer steps of the run: data rows // train_batch_size x max_epochs", derived=True)

    def validate(self) -> None:
        if not self.ckpt_path and self.save_path:
            self.ckpt_path = str(Path(self.save_path) / "checkpoints")
        resolve_path_fields(self, inputs=("pretrain", "dataset", "eval_dataset", "deepspeed"),
                            outputs=("save_path", "ckpt_path"))
        self.apply_deepspeed_file()
        if not self.pretrain or not Path(self.pretrain).is_dir():
            raise ConfigError(f"--pretrain {self.pretrain!r}: give a local model folder (Hugging Face format); "
                              f"`rlmesh make-tiny-model DIR` builds a small one")
        if not self.dataset:
            raise ConfigError("--dataset is required: local JSONL / Parquet / Arrow file(s) or save_to_disk folder(s)")
        for name in ("max_epochs", "logging_steps", "max_len", "max_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be >= 1")
        if self.learning_rate <= 0:
            raise ConfigError(f"--learning_rate {self.learning_rate} must be > 0")
        if self.save_steps == 0 or self.eval_steps == 0:
            raise ConfigError("--save_steps / --eval_steps must be a positive number of steps, or -1 for never")
        if self.max_ckpt_num < 1:
            raise ConfigError(f"--max_ckpt_num {self.max_ckpt_num} must be >= 1")
        if self.load_checkpoint and not self.ckpt_path:
            raise ConfigError("--load_checkpoint needs --ckpt_path (the folder the interrupted run saved to)")
        self.validate_lora(self.pretrain)
        check_aux_loss_coef(self.aux_loss_coef, self.pretrain)
        if "\\n" in self.input_template:
            warnings.warn(f"--input_template {self.input_template!r} holds a backslash and n, not a newline; in bash "
                          "write $'...\\n...' for a newline (kept as given)", stacklevel=2)
        if self.flash_attn:
            if torch.cuda.is_available():
                self.attn_implementation = "flash_attention_2"
            else:
                warnings.warn(no_gpu_attention("--flash_attn"), stacklevel=2)
                self.flash_attn = False
        self.attention_for_this_machine()  # --attn_implementation flash_attention_2 (OpenRLHF's spelling) too


# ----------------------------------------------------------------------------------------------
# Batching


def pad_right(sequences: Sequence[Sequence[int]], pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads sequences into (B, T) int64 values and a (B, T) 0/1 attention mask."""
    length = max(len(s) for s in sequences)
    values = torch.full((len(sequences), length), pad_value, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        values[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1
    return values, mask


def sequences_batch(sequences: Sequence[Sequence[int]], pad_id: int, packed: bool) -> MicroBatch:
    """Token sequences -> model inputs: right-padded (B, T), or packed into one (1, N) row with
    positions restarting at 0 for each sequence and no attention mask.

    Every token after a sequence's first counts as predicted (response_start 1), so in both forms
    out_index is (B, T-1) and maps the model's next-token outputs to the padded layout: [i, t]
    points at sequence i's prediction of its token t + 1.
    """
    samples = [Sample(torch.as_tensor(seq, dtype=torch.long), 1, {}) for seq in sequences]
    return collate(samples, packed=packed, pad_id=pad_id)


def next_token_logprobs(model, mb: MicroBatch) -> torch.Tensor:
    """(B, T-1) float32 log p(token t+1 | tokens <= t) of the sequences of a `sequences_batch`, in
    the padded layout whether mb is padded or packed; entries past a sequence's end are meaningless
    (mask them with the sequence's loss mask)."""
    return logprobs_and_aux_loss(model, mb, aux=False)[0]


def logprobs_and_aux_loss(model, mb: MicroBatch, aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """next_token_logprobs, and with aux the MoE router's load-balancing loss of the same forward
    (services.learner.moe_aux; a scalar with grad), else None."""
    outputs = forward_micro_batch(model, mb, **(moe_aux.ROUTER_KWARGS if aux else {}))
    aux_loss = moe_aux.router_aux_loss(model, outputs, mb.attention_mask) if aux else None
    logits = outputs.logits  # (rows, T, V)
    if mb.seq_lengths is None:
        logprobs = token_logprobs(logits[:, :-1], mb.input_ids[:, 1:])  # (B, T-1), 8 rows at a time
    else:
        # The packed row's tokens as rows of one, as many per chunk as 8 padded rows hold, so that
        # the no-grad passes (evaluation, the DPO reference) never take the float32 log-softmax of
        # the whole row at once.
        chunk = 8 * max(mb.seq_lengths)
        logprobs = token_logprobs(logits[0, :-1, None], mb.input_ids[0, 1:, None], chunk_rows=chunk)  # (N-1, 1)
    return logprobs.reshape(-1)[mb.out_index], aux_loss


def last_token_outputs(outputs: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """(rows, T) per-token outputs of a `sequences_batch` -> (B,) each sequence's output at its own
    last token (where a reward model's score is read)."""
    if mb.seq_lengths is None:
        return last_token_values(outputs, mb.attention_mask)
    ends = torch.tensor(mb.seq_lengths).cumsum(0) - 1  # (B,) positions in the packed row
    return outputs.reshape(-1)[ends.to(outputs.device)]


def response_logprob_sums(token_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of response-token log-probs and the response length.

    token_logprobs: (B, T-1) log p(token_t | <t) for t = 1..T-1; loss_mask: (B, T) 1 on response
    tokens. Returns ((B,) sums, (B,) token counts).
    """
    mask = loss_mask[:, 1:].to(token_logprobs.dtype)  # (B, T-1), aligned with the predicted tokens
    return (token_logprobs * mask).sum(-1), mask.sum(-1)


# ----------------------------------------------------------------------------------------------
# Losses (pure functions)


def sft_loss(token_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the response tokens of the batch.

    token_logprobs: (B, T-1); loss_mask: (B, T) 1 on tokens the loss covers. Returns a scalar.
    """
    sums, counts = response_logprob_sums(token_logprobs, loss_mask)
    return -sums.sum() / counts.sum().clamp(min=1)


def pairwise_reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                         kind: str = "sigmoid") -> torch.Tensor:
    """Bradley-Terry loss of a reward model on preference pairs, per pair.

    chosen, rejected: (B,) scores; margin: (B,) or None, how far chosen should lead.
    "sigmoid": -log sigmoid(chosen - rejected - margin); "logexp": log(1 + exp(rejected - chosen
    + margin)). The two are the same function (kept apart because users name either); softplus
    keeps both finite for large score gaps. Returns (B,).
    """
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    if kind == "sigmoid":
        return -F.logsigmoid(diff)
    if kind == "logexp":
        return F.softplus(-diff)
    raise ValueError(f"kind must be 'sigmoid' or 'logexp', got {kind!r}")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0,
             ipo: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO / IPO loss per pair, with the implicit rewards.

    All inputs (B,): sequence log-probs of the responses under the policy and the frozen
    reference. h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected).
    DPO: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)  (eps = label_smoothing, the
    conservative variant for noisy labels). IPO: (h - 1 / (2 beta))^2.
    Returns (loss (B,), chosen_reward (B,), rejected_reward (B,)), rewards = beta x (policy - ref).
    """
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if ipo:
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        loss = -F.logsigmoid(beta * h) * (1.0 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    chosen_reward = beta * (policy_chosen - ref_chosen).detach()
    rejected_reward = beta * (policy_rejected - ref_rejected).detach()
    return loss, chosen_reward, rejected_reward


# ----------------------------------------------------------------------------------------------
# Distributed helpers


def start_distributed() -> tuple[int, int]:
    """Joins the process group; a plain `python -m ...` without launcher variables is rank 0 of 1."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_distributed_from_env()


def all_reduce_ratios(ratios: Ratios) -> dict[str, float]:
    """Sums each (numerator, denominator) over ranks and returns the ratios."""
    names = sorted(ratios)
    if not names:
        return {}
    flat = torch.tensor([v for name in names for v in ratios[name]], dtype=torch.float64)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(flat)
    return {name: float(flat[2 * i] / flat[2 * i + 1]) if flat[2 * i + 1] else float("nan")
            for i, name in enumerate(names)}


def add_ratios(total: Ratios, more: Ratios) -> None:
    for name, (num, den) in more.items():
        n0, d0 = total.get(name, (0.0, 0.0))
        total[name] = (n0 + num, d0 + den)


def save_hf_model(engine, tokenizer, path: Path, rank: int, config_updates: dict | None = None,
                  adapter: LoraOptions | None = None, merge: bool = False) -> None:
    """save_pretrained of the trained model with its tokenizer (rank 0 writes; all ranks must call).

    Under ZeRO-3 the partitions are gathered into one state dict on rank 0 first. config_updates
    are written into config.json afterwards (save_pretrained would reset e.g. `architectures`).
    With `adapter` (LoRA) the folder is the PEFT adapter, and with `merge` path/merged/ the model
    with the adapter merged in (services.learner.lora.save_adapter), config_updates in its config.
    """
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank takes part
    else:
        state = engine.module.state_dict() if rank == 0 else None
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        if adapter is None:
            engine.module.save_pretrained(path, state_dict=state, safe_serialization=True)
            models = [path]
        else:
            save_adapter(engine.module, state, path, adapter, merge)
            models = [path / "merged"] if merge else []
        tokenizer.save_pretrained(path)
        for folder in models:
            tokenizer.save_pretrained(folder)
            config_file = folder / "config.json"
            saved = json.loads(config_file.read_text())
            # Generation in the rollout service wants the KV cache that training turned off.
            saved.update({"use_cache": True, **(config_updates or {})})
            config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def frozen_model(path: str, options: DeepSpeedOptions, ds_config: dict, device: torch.device):
    """A model used for inference only (the DPO reference), loaded like the trained one.

    Under ZeRO-3 it is wrapped in an optimizer-less DeepSpeed engine so that its parameters stay
    partitioned like the policy's; otherwise it is the plain module on `device`.
    """
    import deepspeed

    model, keepalive = load_pretrained(path, dataclasses.replace(options, gradient_checkpointing=False),
                                       ds_config, kind="causal_lm")
    model.requires_grad_(False).eval()
    if options.zero_stage == 3:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        del keepalive
        engine.eval()
        return engine
    return model.to(device)


# ----------------------------------------------------------------------------------------------
# The loop


class OfflineTrainer:
    """One offline trainer: rows, model and micro-batch loss; `run` is shared."""

    name = "offline"

    def __init__(self, config: OfflineConfig):
        self.config = config

    # -- what each trainer defines --------------------------------------------------------------

    def load_rows(self, tokenizer, paths: str, probs: str) -> list:
        raise NotImplementedError

    def load_model(self, ds_config: dict):
        """(model, keepalive) ready for build_engine (see deepspeed_setup.load_pretrained)."""
        raise NotImplementedError

    def prepare(self, ds_config: dict, device: torch.device) -> None:
        """Anything else the loss needs (e.g. a frozen reference model)."""

    def micro_batch(self, engine, rows: list, train: bool) -> tuple[torch.Tensor, Ratios]:
        """Loss of one micro-batch (a scalar with grad when train) and its metrics as ratios."""
        raise NotImplementedError

    def save(self, engine, tokenizer, path: Path, rank: int) -> None:
        save_hf_model(engine, tokenizer, path, rank, adapter=self.config.lora, merge=self.config.lora_merge_on_save)

    # -- shared -----------------------------------------------------------------------------------

    def evaluate(self, engine, rows: list) -> dict[str, float]:
        engine.eval()
        totals: Ratios = {}
        micro = self.config.micro_train_batch_size
        with torch.no_grad():
            for start in range(0, len(rows), micro):
                _, ratios = self.micro_batch(engine, rows[start:start + micro], train=False)
                add_ratios(totals, ratios)
        engine.train()
        return all_reduce_ratios(totals)

    def run(self) -> dict[str, float]:
        """Trains, evaluates and saves; returns the last evaluation (or training) metrics."""
        config = self.config
        if config.dry_run:  # checked and planned, nothing started (services/learner/offline_plan.py)
            from services.learner.offline_plan import print_offline_plan

            return print_offline_plan(self)
        rank, world = start_distributed()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.pretrain)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        # A DatasetError reaches the command's run_command: its message, without a traceback.
        train_rows = self.load_rows(tokenizer, config.dataset, config.dataset_probs)
        # Every rank evaluates an equal share: a ZeRO-3 forward is a collective.
        eval_rows = self.load_rows(tokenizer, config.eval_dataset, "") if config.eval_dataset else []
        eval_rows = eval_rows[rank: len(eval_rows) - len(eval_rows) % world: world]
        self.train_rows, self.eval_rows, self.rank, self.world = train_rows, eval_rows, rank, world
        steps_per_epoch = len(train_rows) // config.train_batch_size
        if steps_per_epoch == 0:
            raise ConfigError(f"{len(train_rows)} training rows are fewer than --train_batch_size "
                              f"{config.train_batch_size}; lower --train_batch_size or add data")
        config.max_steps = steps_per_epoch * config.max_epochs
        ds_config = deepspeed_config(config, world)
        model, keepalive = self.load_model(ds_config)
        engine = build_engine(model, config, ds_config, config.learning_rate)
        del keepalive
        self.prepare(ds_config, engine.device)
        log_event(_log, f"{self.name}_start", rank=rank, world_size=world, zero_stage=config.zero_stage,
                  bf16=config.bf16, train_rows=len(train_rows),
                  eval_rows=len(eval_rows) * world, steps=config.max_steps,
                  grad_accumulation=config.gradient_accumulation_steps(world))

        ckpt_root = Path(config.ckpt_path)
        resumed = offline_checkpoint.load_latest(engine, ckpt_root, world, config.zero_stage,
                                                 universal_ok=config.use_ds_universal_ckpt) \
            if config.load_checkpoint else 0
        out_dir = Path(config.save_path)
        metrics_file = None
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            # A resumed run continues the same file.
            metrics_file = (out_dir / "metrics.jsonl").open("a" if resumed else "w", encoding="utf-8")

        def record(step: int, values: dict[str, float]) -> None:
            """One metrics.jsonl line per step, training and evaluation values together."""
            if metrics_file is None:  # rank 0 only: the values are already summed over ranks
                return
            metrics_file.write(json.dumps({"step": step, **values}) + "\n")
            metrics_file.flush()
            log_event(_log, f"{self.name}_metrics", step=step, **{k: f"{v:.6g}" for k, v in values.items()})

        def evaluation() -> dict[str, float]:
            return {f"eval/{k}": v for k, v in self.evaluate(engine, eval_rows).items()}

        last: dict[str, float] = {}
        if eval_rows and not resumed:
            last = evaluation()
            record(0, last)
        per_rank = config.train_batch_size // world
        micro = config.micro_train_batch_size
        step = resumed
        engine.train()
        for epoch in range(config.max_epochs):
            order = list(range(len(train_rows)))
            random.Random(config.seed + epoch).shuffle(order)
            for batch in range(steps_per_epoch):
                if epoch * steps_per_epoch + batch < resumed:
                    continue  # trained before the checkpoint: the same order, so the same rows
                started = time.perf_counter()
                global_rows = order[batch * config.train_batch_size:(batch + 1) * config.train_batch_size]
                mine = [train_rows[i] for i in global_rows[rank * per_rank:(rank + 1) * per_rank]]
                totals: Ratios = {}
                for start in range(0, per_rank, micro):
                    loss, ratios = self.micro_batch(engine, mine[start:start + micro], train=True)
                    engine.backward(loss)
                    engine.step()
                    add_ratios(totals, ratios)
                step += 1
                values: dict[str, float] = {}
                if step % config.logging_steps == 0 or step == config.max_steps:
                    values = {f"train/{k}": v for k, v in all_reduce_ratios(totals).items()}
                    values.update({"train/lr": current_lr(engine), "train/epoch": epoch + (batch + 1) / steps_per_epoch,
                                   "train/step_seconds": time.perf_counter() - started})
                if eval_rows and (step == config.max_steps or config.eval_steps > 0 and step % config.eval_steps == 0):
                    values.update(evaluation())
                if values:
                    record(step, values)
                    last = values
                if config.save_steps > 0 and step % config.save_steps == 0 and step < config.max_steps:
                    offline_checkpoint.save(engine, ckpt_root, step, rank, world, config.zero_stage,
                                            config.max_ckpt_num)
                    self.save(engine, tokenizer, out_dir / f"global_step_{step}", rank)
        self.save(engine, tokenizer, out_dir, rank)
        if metrics_file is not None:
            metrics_file.close()
        log_event(_log, f"{self.name}_done", steps=step, save_path=str(out_dir))
        return last
