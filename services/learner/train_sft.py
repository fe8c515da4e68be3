"""Supervised fine-tuning: the loss covers response tokens only (every assistant turn of a
multi-turn conversation).

    deepspeed --module services.learner.train_sft --pretrain DIR --dataset sft.jsonl \\
        --input_key prompt --output_key response --apply_chat_template --save_path out/sft
    rlmesh sft ...            (the same flags; plain `python -m services.learner.train_sft` is one rank)

The output folder is a Hugging Face causal LM with its tokenizer: the rollout service's --pretrain.
"""

from __future__ import annotations

import dataclasses
import sys

from services.common.config import opt, parse_config
from services.common.datasets import load_sft
from services.common.user_errors import run_command
from services.learner.deepspeed_setup import load_pretrained
from services.learner.offline import (
    OfflineConfig,
    OfflineTrainer,
    Ratios,
    logprobs_and_aux_loss,
    pad_right,
    response_logprob_sums,
    sequences_batch,
    sft_loss,
)


# OpenRLHF's train_sft formats plain-text prompts with this unless told otherwise (--input_template).
OPENRLHF_SFT_TEMPLATE = "User: {}\nAssistant: "


@dataclasses.dataclass
class SFTConfig(OfflineConfig):
    """Supervised fine-tuning of a causal LM on prompt/response pairs or conversations."""

    input_template: str = opt(OPENRLHF_SFT_TEMPLATE, "format string with {} for a plain-text prompt (as OpenRLHF's "
                              "default, a real newline in it); '' = the raw prompt; with --apply_chat_template "
                              "the default is not used")
    input_key: str = opt("input", "field of the prompt (a string or a chat message list)")
    output_key: str = opt("output", "field of the response (a string or the assistant's message list)")
    multiturn: bool = opt(False, "rows are whole conversations in --input_key (message lists); the loss covers "
                          "every assistant turn; needs --apply_chat_template")
    learning_rate: float = opt(5e-6, "peak learning rate")

    def validate(self) -> None:
        super().validate()
        if self.multiturn:
            self.apply_chat_template = True  # conversations can only be rendered by the chat template
        if self.apply_chat_template and self.input_template == OPENRLHF_SFT_TEMPLATE:
            self.input_template = ""  # OpenRLHF renders chats without it; a template given otherwise still applies


class SFTTrainer(OfflineTrainer):
    name = "sft"

    def load_rows(self, tokenizer, paths: str, probs: str) -> list:
        c = self.config
        return load_sft(paths, probs, tokenizer=tokenizer, input_key=c.input_key, output_key=c.output_key,
                        multiturn=c.multiturn, apply_chat_template=c.apply_chat_template,
                        input_template=c.input_template or None, max_len=c.max_len, max_samples=c.max_samples,
                        seed=c.seed, strict=c.strict)

    def load_model(self, ds_config: dict):
        return load_pretrained(self.config.pretrain, self.config, ds_config, kind="causal_lm",
                               adapter=self.config.lora)

    def micro_batch(self, engine, rows: list, train: bool) -> tuple:
        mb = sequences_batch([r.input_ids for r in rows], self.tokenizer.pad_token_id,
                             self.config.packing_samples).to(engine.device)
        loss_mask, _ = pad_right([r.loss_mask for r in rows], 0)  # (B, T), padded or packed alike
        loss_mask = loss_mask.to(engine.device)
        coef = self.config.aux_loss_coef
        logprobs, aux = logprobs_and_aux_loss(engine, mb, aux=coef > 0)  # (B, T-1), MoE router loss or None
        loss = sft_loss(logprobs, loss_mask)
        sums, counts = response_logprob_sums(logprobs.detach(), loss_mask)
        ratios: Ratios = {"loss": (-float(sums.sum()), float(counts.sum())),
                          "response_tokens": (float(counts.sum()), float(len(rows)))}
        if aux is not None:  # "loss" stays the NLL, as OpenRLHF logs gpt_loss apart from aux_loss
            loss = loss + coef * aux
            ratios["aux_loss"] = (float(aux.detach()), 1.0)
        return loss, ratios


def main(argv: list[str] | None = None) -> int:
    config = parse_config(SFTConfig, argv, description=SFTConfig.__doc__)
    SFTTrainer(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
