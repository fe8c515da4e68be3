"""Direct preference optimisation (DPO, IPO, conservative DPO) against a frozen reference model.

    deepspeed --module services.learner.train_dpo --pretrain DIR --dataset prefs.jsonl \\
        --chosen_key chosen --rejected_key rejected --apply_chat_template --beta 0.1 --save_path out/dpo
    rlmesh dpo ...            (the same flags; plain `python -m services.learner.train_dpo` is one rank)

The reference is --ref_pretrain (default --pretrain), loaded once and never trained. The output
folder is a Hugging Face causal LM with its tokenizer: the rollout service's --pretrain.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from services.common.config import ConfigError, opt, parse_config
from services.common.datasets import load_preferences
from services.common.paths import resolve_path_fields
from services.common.user_errors import run_command
from services.learner.deepspeed_setup import load_pretrained
from services.learner.offline import (
    OfflineConfig,
    OfflineTrainer,
    PreferenceKeys,
    Ratios,
    dpo_loss,
    frozen_model,
    logprobs_and_aux_loss,
    next_token_logprobs,
    pad_right,
    response_logprob_sums,
    sequences_batch,
)


@dataclasses.dataclass
class DPOConfig(OfflineConfig, PreferenceKeys):
    """Trains a causal LM on chosen/rejected pairs with the DPO loss and a frozen reference model."""

    ref_pretrain: str = opt("", "local folder of the frozen reference model; empty = --pretrain")
    beta: float = opt(0.1, "strength of the KL constraint to the reference (the implicit reward's scale)")
    ipo: bool = opt(False, "IPO loss (h - 1 / (2 beta))^2 on per-token mean log-ratios instead of DPO")
    label_smoothing: float = opt(0.0, "conservative DPO: assumed probability that a pair's label is flipped, "
                                 "in [0, 0.5)")
    nll_loss_coef: float = opt(0.0, "add this times the NLL of the chosen responses (per token) to the loss")
    learning_rate: float = opt(5e-7, "peak learning rate")

    def validate(self) -> None:
        super().validate()
        resolve_path_fields(self, inputs=("ref_pretrain",))
        if self.beta <= 0:
            raise ConfigError(f"--beta {self.beta} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing {self.label_smoothing} must be in [0, 0.5)")
        if self.ipo and self.label_smoothing:
            raise ConfigError("--label_smoothing applies to the DPO loss; drop it with --ipo")
        if self.nll_loss_coef < 0:
            raise ConfigError(f"--nll_loss_coef {self.nll_loss_coef} must be >= 0")
        if not self.ref_pretrain:
            self.ref_pretrain = self.pretrain


class DPOTrainer(OfflineTrainer):
    name = "dpo"

    def load_rows(self, tokenizer, paths: str, probs: str) -> list:
        c = self.config
        return load_preferences(paths, probs, tokenizer=tokenizer, prompt_key=c.prompt_key, chosen_key=c.chosen_key,
                                rejected_key=c.rejected_key, apply_chat_template=c.apply_chat_template,
                                input_template=c.input_template or None, max_len=c.max_len,
                                max_samples=c.max_samples, seed=c.seed, strict=c.strict)

    def load_model(self, ds_config: dict):
        return load_pretrained(self.config.pretrain, self.config, ds_config, kind="causal_lm",
                               adapter=self.config.lora)

    def prepare(self, ds_config: dict, device: torch.device) -> None:
        self.reference = frozen_model(self.config.ref_pretrain, self.config, ds_config, device)

    def logprob_sums(self, model, mb, loss_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(2B,) response log-prob sums and (2B,) response lengths of a sequences_batch; loss_mask (2B, T)."""
        return response_logprob_sums(next_token_logprobs(model, mb), loss_mask)

    def micro_batch(self, engine, rows: list, train: bool) -> tuple:
        c = self.config
        pad = self.tokenizer.pad_token_id
        # Chosen then rejected sequences, padded or packed into one row.
        mb = sequences_batch([r.chosen_ids for r in rows] + [r.rejected_ids for r in rows], pad,
                             c.packing_samples).to(engine.device)
        loss_mask, _ = pad_right([r.chosen_mask for r in rows] + [r.rejected_mask for r in rows], 0)
        loss_mask = loss_mask.to(engine.device)
        logprobs, aux = logprobs_and_aux_loss(engine, mb, aux=c.aux_loss_coef > 0)
        policy, lengths = response_logprob_sums(logprobs, loss_mask)  # (2B,), (2B,)
        with torch.no_grad():
            reference, _ = self.logprob_sums(self.reference, mb, loss_mask)
        if c.ipo:  # IPO's target 1 / (2 beta) is set for per-token mean log-ratios
            policy_in, reference_in = policy / lengths, reference / lengths
        else:
            policy_in, reference_in = policy, reference
        b = len(rows)
        losses, chosen_reward, rejected_reward = dpo_loss(policy_in[:b], policy_in[b:], reference_in[:b],
                                                          reference_in[b:], c.beta, c.label_smoothing, c.ipo)
        chosen_nll = -policy[:b].sum() / lengths[:b].sum().clamp(min=1)
        loss = losses.mean() + c.nll_loss_coef * chosen_nll if c.nll_loss_coef else losses.mean()
        if aux is not None:  # the router loss of the policy's forward over chosen and rejected together
            loss = loss + c.aux_loss_coef * aux
        n = float(b)
        ratios: Ratios = {
            "loss": (float(losses.detach().sum()), n),
            "acc": (float((chosen_reward > rejected_reward).sum()), n),
            "margin": (float((chosen_reward - rejected_reward).sum()), n),
            "chosen_reward": (float(chosen_reward.sum()), n),
            "rejected_reward": (float(rejected_reward.sum()), n),
            "chosen_nll": (float(-policy[:b].detach().sum()), float(lengths[:b].sum())),
        }
        if aux is not None:
            ratios["aux_loss"] = (float(aux.detach()), 1.0)
        return loss, ratios


def main(argv: list[str] | None = None) -> int:
    config = parse_config(DPOConfig, argv, description=DPOConfig.__doc__)
    DPOTrainer(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
