"""Reward-model training on preference pairs (Bradley-Terry pairwise loss, optional margin).

    deepspeed --module services.learner.train_rm --pretrain DIR --dataset prefs.jsonl \\
        --chosen_key chosen --rejected_key rejected --apply_chat_template --save_path out/rm
    rlmesh rm ...             (the same flags; plain `python -m services.learner.train_rm` is one rank)

The model is the pretrained backbone with a bias-free linear head `score` with one output; a
sequence's score is the head's output at its last attended token, computed exactly as the reward
service computes it. Responses end with the eos token, as sampled responses do, so generated text is
scored at the same place. The output folder is a Hugging Face AutoModelForSequenceClassification
(num_labels=1) with its tokenizer; its config also carries `mean` and `std` of the scores on the
evaluation data (the training data without one), which --normalize_reward uses. With --lora_rank the
folder is the adapter (with the head `score`, trained in full) and its merged/ folder the reward
model to serve, written whether or not --lora_merge_on_save is given.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch

from services.common.config import ConfigError, opt, parse_config
from services.common.datasets import load_preferences
from services.common.user_errors import run_command
from services.learner.deepspeed_setup import load_pretrained
from services.learner.lora import is_peft_model
from services.learner.offline import (
    OfflineConfig,
    OfflineTrainer,
    PreferenceKeys,
    Ratios,
    last_token_outputs,
    pairwise_reward_loss,
    save_hf_model,
    sequences_batch,
)
from services.learner.token_values import token_values

STATS_ROWS = 1024  # pairs per rank scored for the saved mean/std when there is no evaluation data


@dataclasses.dataclass
class RMConfig(OfflineConfig, PreferenceKeys):
    """Trains a reward model (sequence classification, one output) on chosen/rejected pairs."""

    loss: str = opt("sigmoid", "pairwise loss: sigmoid = -log sigmoid(chosen - rejected - margin); logexp = "
                    "log(1 + exp(rejected - chosen + margin)) (the same function)", choices=["sigmoid", "logexp"])
    margin_loss: bool = opt(False, "subtract each pair's margin (from --margin_key) inside the loss")
    margin_key: str = opt("margin", "field of the pair's margin, used with --margin_loss")
    learning_rate: float = opt(9e-6, "peak learning rate")

    def validate(self) -> None:
        super().validate()
        if self.margin_loss and not self.margin_key:
            raise ConfigError("--margin_loss needs --margin_key (the field holding each pair's margin)")


def sequence_classification_architecture(token_classification: str) -> str:
    """Qwen2ForTokenClassification -> Qwen2ForSequenceClassification: both are the body plus a
    bias-free linear head `score` with one output, so the saved weights are the same."""
    name = token_classification.replace("ForTokenClassification", "ForSequenceClassification")
    import transformers

    if name == token_classification or not hasattr(transformers, name):
        raise ValueError(f"{token_classification} has no sequence-classification counterpart in transformers")
    return name


class RMTrainer(OfflineTrainer):
    name = "rm"

    def load_rows(self, tokenizer, paths: str, probs: str) -> list:
        c = self.config
        return load_preferences(paths, probs, tokenizer=tokenizer, prompt_key=c.prompt_key, chosen_key=c.chosen_key,
                                rejected_key=c.rejected_key, margin_key=c.margin_key if c.margin_loss else "",
                                apply_chat_template=c.apply_chat_template, input_template=c.input_template or None,
                                max_len=c.max_len, max_samples=c.max_samples, seed=c.seed, strict=c.strict)

    def load_model(self, ds_config: dict):
        # A value per token from the head `score` (a new head is initialised from --seed); the
        # score of a sequence is read at its last token, as the reward service reads it.
        return load_pretrained(self.config.pretrain, self.config, ds_config, kind="critic",
                               adapter=self.config.lora)

    def scores(self, engine, rows: list, want_aux: bool = False) -> tuple:
        """(chosen (B,), rejected (B,)) scores in one forward pass over the 2B sequences (padded
        rows, or with --packing_samples all of them in one row), and that forward's MoE router loss
        when want_aux (else None)."""
        mb = sequences_batch([r.chosen_ids for r in rows] + [r.rejected_ids for r in rows],
                             self.tokenizer.pad_token_id, self.config.packing_samples).to(engine.device)
        values, aux = token_values(engine, mb, want_aux)  # (rows, T)
        scores = last_token_outputs(values.float(), mb)  # (2B,)
        return scores[: len(rows)], scores[len(rows):], aux

    def micro_batch(self, engine, rows: list, train: bool) -> tuple:
        coef = self.config.aux_loss_coef
        chosen, rejected, aux = self.scores(engine, rows, want_aux=coef > 0)
        margin = None
        if self.config.margin_loss:
            margin = torch.tensor([r.margin for r in rows], dtype=chosen.dtype, device=chosen.device)
        losses = pairwise_reward_loss(chosen, rejected, margin, self.config.loss)  # (B,)
        n = float(len(rows))
        c, r = chosen.detach(), rejected.detach()
        both = torch.cat([c, r])
        ratios: Ratios = {"loss": (float(losses.detach().sum()), n), "acc": (float((c > r).sum()), n),
                          "chosen_reward": (float(c.sum()), n), "rejected_reward": (float(r.sum()), n),
                          "score_mean": (float(both.sum()), 2 * n),
                          "score_mean_square": (float((both ** 2).sum()), 2 * n)}
        if aux is None:
            return losses.mean(), ratios
        # As OpenRLHF: the pairwise loss plus coef x the router loss of the forward over both sequences;
        # "loss" stays the pairwise one.
        ratios["aux_loss"] = (float(aux.detach()), 1.0)
        return losses.mean() + coef * aux, ratios

    def save(self, engine, tokenizer, path, rank: int) -> None:
        # Mean and std of the scores, for --normalize_reward in RL (sums over ranks, so every
        # rank scores the same number of pairs).
        per_rank = min(STATS_ROWS, len(self.train_rows) // self.world)
        rows = self.eval_rows or self.train_rows[rank * per_rank:(rank + 1) * per_rank]
        stats = self.evaluate(engine, rows)
        std = math.sqrt(max(stats["score_mean_square"] - stats["score_mean"] ** 2, 0.0))
        module = engine.module.get_base_model() if is_peft_model(engine.module) else engine.module
        architecture = sequence_classification_architecture(type(module).__name__)
        # With LoRA the merged model is written too: the reward service loads a whole model.
        save_hf_model(engine, tokenizer, path, rank, config_updates={
            "mean": stats["score_mean"], "std": std, "architectures": [architecture],
            "pad_token_id": tokenizer.pad_token_id}, adapter=self.config.lora, merge=True)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(RMConfig, argv, description=RMConfig.__doc__)
    RMTrainer(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
