"""--packing_samples in the offline trainers: a packed micro-batch gives the padded one's numbers.

Each trainer's own micro_batch runs on the same rows twice, right-padded and packed into one row,
with the tiny model in float32 on CPU: the losses, metrics, rewards (RM) and log-prob sums (DPO)
must agree, and so must the gradients. With sdpa transformers keeps attention within each packed
sequence from the position ids; with varlen (per-sequence sdpa on CPU) the trainers pass the
sequence boundaries. The end-to-end packed run is in test_offline_trainers.py (DPO).
"""

import dataclasses
import json

import pytest
import torch
from transformers import AutoTokenizer

from services.common.config import parse_config
from services.learner.offline import last_token_outputs, next_token_logprobs, sequences_batch
from services.learner.train_dpo import DPOConfig, DPOTrainer
from services.learner.train_rm import RMConfig, RMTrainer
from services.learner.train_sft import SFTConfig, SFTTrainer

ATTENTION = ["sdpa", "varlen"]


@pytest.fixture(scope="module")
def prefs_file(tiny_data_dir, tmp_path_factory):
    """Pairs whose chosen and rejected responses differ in length (so padding is really there)."""
    rows = [json.loads(line) for line in (tiny_data_dir / "arith_train.jsonl").read_text().splitlines()[:3]]
    path = tmp_path_factory.mktemp("packing") / "prefs.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": f"The answer is \\boxed{{{r['label']}}}",
                                        "rejected": f"{int(r['label']) + 1}"}) + "\n" for r in rows))
    return path


def make_trainer(cls, config_cls, model_dir, attention: str, packed: bool, *extra: str):
    argv = ["--pretrain", str(model_dir), "--dataset", "unused.jsonl", "--apply_chat_template",
            "--attn_implementation", attention, *extra]
    trainer = cls(parse_config(config_cls, argv + (["--packing_samples"] if packed else [])))
    trainer.tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return trainer


def loss_and_gradients(trainer, model, rows) -> tuple[torch.Tensor, dict, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, ratios = trainer.micro_batch(model, rows, train=True)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), ratios, grads


def assert_same_step(padded, packed) -> None:
    """Two (loss, ratios, gradients) agree to float32 rounding."""
    (loss_a, ratios_a, grads_a), (loss_b, ratios_b, grads_b) = padded, packed
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=1e-5)
    assert ratios_b.keys() == ratios_a.keys()
    for name in ratios_a:
        assert ratios_b[name] == pytest.approx(ratios_a[name], rel=1e-5, abs=1e-5), name
    assert grads_b.keys() == grads_a.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-5, rtol=1e-4, msg=name)


def test_sequences_batch_packs_one_row_and_reads_back_the_padded_layout():
    seqs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    padded, packed = sequences_batch(seqs, pad_id=1, packed=False), sequences_batch(seqs, pad_id=1, packed=True)
    assert padded.input_ids.tolist() == [[5, 6, 7, 1], [8, 9, 1, 1], [10, 11, 12, 13]]
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]] and packed.attention_mask is None
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]] and packed.seq_lengths == [3, 2, 4]
    # Next-token outputs of either form, read at out_index: [i, t] predicts sequence i's token t + 1.
    for mb in (padded, packed):
        labels = mb.input_ids[:, 1:].reshape(-1)[mb.out_index]  # (B, T-1)
        for i, seq in enumerate(seqs):
            assert labels[i, :len(seq) - 1].tolist() == seq[1:]
    # A per-token output read at each sequence's last token.
    values = torch.arange(9.0)
    assert last_token_outputs(values.view(1, 9), packed).tolist() == [2.0, 4.0, 8.0]
    assert last_token_outputs(torch.arange(12.0).view(3, 4), padded).tolist() == [2.0, 5.0, 11.0]


@pytest.mark.parametrize("attention", ATTENTION)
def test_sft_packed_loss_and_gradients_equal_padded(tiny_model_dir, tiny_data_dir, attention):
    trainers = [make_trainer(SFTTrainer, SFTConfig, tiny_model_dir, attention, packed, "--input_key", "prompt",
                             "--output_key", "response") for packed in (False, True)]
    rows = trainers[0].load_rows(trainers[0].tokenizer, str(tiny_data_dir / "sft.jsonl"), "")[:4]
    # A loss mask of several spans (as multi-turn conversations have): two prompt tokens as well.
    mask = list(rows[1].loss_mask)
    mask[1] = mask[2] = 1
    rows[1] = dataclasses.replace(rows[1], loss_mask=tuple(mask))
    assert len({len(r.input_ids) for r in rows}) > 1
    model, _ = trainers[0].load_model({})
    padded = loss_and_gradients(trainers[0], model, rows)
    packed = loss_and_gradients(trainers[1], model, rows)
    assert_same_step(padded, packed)
    # The same loss as each example alone, tokens of all examples weighted equally.
    with torch.no_grad():
        alone = [trainers[0].micro_batch(model, [r], train=False)[1]["loss"] for r in rows]
    assert padded[0].item() == pytest.approx(sum(n for n, _ in alone) / sum(d for _, d in alone), rel=1e-5)


@pytest.mark.parametrize("attention", ATTENTION)
def test_rm_packed_scores_and_loss_equal_padded(tiny_model_dir, prefs_file, attention):
    trainers = [make_trainer(RMTrainer, RMConfig, tiny_model_dir, attention, packed) for packed in (False, True)]
    rows = trainers[0].load_rows(trainers[0].tokenizer, str(prefs_file), "")
    model, _ = trainers[0].load_model({})
    with torch.no_grad():
        chosen, rejected, _ = trainers[0].scores(model, rows)
        chosen_packed, rejected_packed, _ = trainers[1].scores(model, rows)
        # Reference: each sequence scored alone, without padding.
        alone = [float(model(torch.tensor([ids])).logits[0, -1, 0])
                 for ids in [r.chosen_ids for r in rows] + [r.rejected_ids for r in rows]]
    torch.testing.assert_close(chosen_packed, chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rejected_packed, rejected, atol=1e-5, rtol=1e-5)
    assert torch.cat([chosen, rejected]).tolist() == pytest.approx(alone, abs=1e-5)
    assert_same_step(loss_and_gradients(trainers[0], model, rows), loss_and_gradients(trainers[1], model, rows))


@pytest.mark.parametrize("attention", ATTENTION)
def test_dpo_packed_logprob_sums_and_loss_equal_padded(tiny_model_dir, tiny_model_dir_b, prefs_file, attention):
    trainers = [make_trainer(DPOTrainer, DPOConfig, tiny_model_dir, attention, packed, "--ref_pretrain",
                             str(tiny_model_dir_b), "--nll_loss_coef", "0.1") for packed in (False, True)]
    rows = trainers[0].load_rows(trainers[0].tokenizer, str(prefs_file), "")
    model, _ = trainers[0].load_model({})
    trainers[0].prepare({}, torch.device("cpu"))
    trainers[1].reference = trainers[0].reference
    pad = trainers[0].tokenizer.pad_token_id
    sequences = [r.chosen_ids for r in rows] + [r.rejected_ids for r in rows]
    masks = [r.chosen_mask for r in rows] + [r.rejected_mask for r in rows]
    loss_mask = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    for i, m in enumerate(masks):
        loss_mask[i, :len(m)] = torch.tensor(m)
    with torch.no_grad():
        for net in (model, trainers[0].reference):
            sums = [trainers[0].logprob_sums(net, sequences_batch(sequences, pad, packed), loss_mask)
                    for packed in (False, True)]
            torch.testing.assert_close(sums[1], sums[0], atol=1e-5, rtol=1e-5)
            # Reference: each response's log-prob sum from its sequence alone.
            alone = []
            for seq, m in zip(sequences, masks):
                logp = next_token_logprobs(net, sequences_batch([seq], pad, packed=False))[0]
                alone.append(float((logp * torch.tensor(m[1:])).sum()))
            assert sums[1][0].tolist() == pytest.approx(alone, abs=1e-4)
    assert_same_step(loss_and_gradients(trainers[0], model, rows), loss_and_gradients(trainers[1], model, rows))
