"""--dry_run of the offline trainers (`rlmesh sft|rm|dpo`, `deepspeed --module services.learner.train_*`):
the flags validated, the model folder and the data read as the run would (usable rows, optimizer
steps), and the plan printed: ranks, ZeRO stage, precision and a rough memory estimate of the model
states per GPU. Nothing is started: no process group, no model on a device. Under a launcher each
rank would print the same plan, so only rank 0 does.
"""

from __future__ import annotations

import os
import sys

from services.common.config import ConfigError
from services.common.memory_estimate import gib, learner_state_bytes, parameter_count, weights_bytes


def print_offline_plan(trainer, out=None) -> dict:
    """Checks the trainer's model and data and prints its plan (rank 0); ConfigError on a problem."""
    from transformers import AutoTokenizer

    config = trainer.config
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(config.pretrain)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    trainer.tokenizer = tokenizer
    rows = trainer.load_rows(tokenizer, config.dataset, config.dataset_probs)  # DatasetError names the file
    eval_rows = trainer.load_rows(tokenizer, config.eval_dataset, "") if config.eval_dataset else []
    steps = len(rows) // config.train_batch_size * config.max_epochs
    if steps == 0:
        raise ConfigError(f"{len(rows)} training rows are fewer than --train_batch_size {config.train_batch_size}; "
                          "lower --train_batch_size or add data")
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    params = parameter_count(config.pretrain)
    lora = 0.01 if getattr(config, "lora_rank", 0) else 1.0
    states = None if params is None else learner_state_bytes(params, world, config.zero_stage, config.bf16,
                                                             config.adam_offload, lora)
    if states is not None and trainer.name == "dpo":  # the frozen reference beside the trained model
        states += weights_bytes(params, config.bf16, world if config.zero_stage >= 3 else 1)
    lines = [f"dry run ({trainer.name}): nothing was started",
             f"model    {config.pretrain} ({f'{params:,}' if params else 'unknown number of'} parameters)",
             f"data     {config.dataset}: {len(rows)} usable rows"
             + (f", {len(eval_rows)} evaluation rows" if config.eval_dataset else ""),
             f"steps    {steps} optimizer steps ({config.max_epochs} epoch(s) of {len(rows) // config.train_batch_size}"
             f" x {config.train_batch_size} rows)",
             f"ranks    {world} (WORLD_SIZE), ZeRO-{config.zero_stage}, {'bf16' if config.bf16 else 'fp32'}"
             + (", Adam states in host memory" if config.adam_offload else ""),
             f"memory   per GPU {gib(states)} of model states (activations not counted)"]
    print("\n".join(lines), file=out or sys.stdout, flush=True)
    return {}
