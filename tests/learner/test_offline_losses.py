"""The offline trainers' pure pieces against hand-computed values, and their flag checks."""

import math

import pytest
import torch

from services.common.config import parse_config
from services.learner.offline import (
    all_reduce_ratios,
    dpo_loss,
    pad_right,
    pairwise_reward_loss,
    response_logprob_sums,
    sft_loss,
)
from services.learner.train_dpo import DPOConfig
from services.learner.train_rm import RMConfig
from services.learner.train_sft import SFTConfig


def test_pad_right_and_response_sums():
    ids, mask = pad_right([[5, 6, 7], [8]], pad_value=1)
    assert ids.tolist() == [[5, 6, 7], [8, 1, 1]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])  # predictions of tokens 1..3
    loss_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]])
    sums, counts = response_logprob_sums(logprobs, loss_mask)
    assert sums.tolist() == [-5.0, -0.5] and counts.tolist() == [2.0, 1.0]
    assert sft_loss(logprobs, loss_mask).item() == pytest.approx(5.5 / 3)


def test_pairwise_reward_loss_values():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    assert pairwise_reward_loss(chosen, rejected).tolist() == pytest.approx([0.313262, math.log(2)], abs=1e-6)
    margin = torch.tensor([0.5, 0.0])
    for kind in ("sigmoid", "logexp"):
        assert pairwise_reward_loss(chosen, rejected, margin, kind)[0].item() == pytest.approx(0.474077, abs=1e-6)
    # Large gaps stay finite either way.
    assert torch.isfinite(pairwise_reward_loss(torch.tensor([-200.0]), torch.tensor([200.0]), kind="logexp")).all()


def test_dpo_loss_values():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))  # h = 2
    loss, chosen_reward, rejected_reward = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.item() == pytest.approx(0.313262, abs=1e-6)  # -log sigmoid(1)
    assert (chosen_reward.item(), rejected_reward.item()) == pytest.approx((0.5, -0.5))
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)[0].item() == pytest.approx(0.413262, abs=1e-6)
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, ipo=True)[0].item() == pytest.approx(1.0)  # (2 - 1)^2
    # Equal policy and reference: the DPO loss is log 2 and the rewards are 0.
    loss, c, r = dpo_loss(pc, pr, pc, pr, beta=0.1)
    assert (loss.item(), c.item(), r.item()) == pytest.approx((math.log(2), 0.0, 0.0))


def test_ratios_without_a_process_group():
    assert all_reduce_ratios({"loss": (3.0, 2.0), "acc": (0.0, 0.0)}) == {"loss": 1.5, "acc": pytest.approx(math.nan,
                                                                                                          nan_ok=True)}


def test_flags(tiny_model_dir, capsys):
    base = ["--pretrain", str(tiny_model_dir), "--dataset", "x.jsonl"]
    with pytest.warns(UserWarning, match="--flash_attn needs a CUDA GPU"):
        config = parse_config(SFTConfig, base + ["--flash_attn", "--local_rank=0"])
    assert (config.attn_implementation, config.flash_attn) == ("sdpa", False)
    assert parse_config(SFTConfig, base + ["--multiturn"]).apply_chat_template
    assert parse_config(DPOConfig, base).ref_pretrain == str(tiny_model_dir)
    for cls, extra, message in [
        (DPOConfig, ["--ipo", "--label_smoothing", "0.1"], "drop it with --ipo"),
        (DPOConfig, ["--beta", "0"], "--beta 0.0 must be > 0"),
        (RMConfig, ["--margin_loss", "--margin_key", ""], "--margin_loss needs --margin_key"),
        (SFTConfig, ["--pretrain", "/no/such/model"], "give a local model folder"),
    ]:
        with pytest.raises(SystemExit):
            parse_config(cls, base + extra)
        assert message in capsys.readouterr().err
