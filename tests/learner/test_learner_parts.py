"""The learner's pieces without a service: micro-batch collation (padded and packed), the training
plan, the LR schedule, checkpoint folders, and how a rank finds its place."""

import os
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.logprobs import token_logprobs
from services.common import ownership
from services.learner import checkpoint
from services.learner.batches import Sample, collate, forward_micro_batches, plan_training, token_forward_micro_batches
from services.learner.deepspeed_setup import lr_multiplier
from services.learner.logprob_head import forward_micro_batch
from services.learner.spmd import RankFailure, read_store_message, resolve_rank_spec, store_message


def _samples(n: int, seed: int = 0, vocab: int = 600) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 12, (1,), generator=g))
        start = 1 + i % 3
        out.append(Sample(torch.randint(4, vocab, (length,), generator=g), start,
                          {"advantages": torch.full((length - start,), float(i))}))
    return out


def _response_logprobs(model, mb) -> torch.Tensor:
    logits = forward_micro_batch(model, mb).logits
    return token_logprobs(logits[:, :-1], mb.input_ids[:, 1:]).reshape(-1)[mb.out_index]


def test_packed_and_padded_micro_batches_give_the_same_logprobs(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    samples = _samples(5)
    padded, packed = collate(samples), collate(samples, packed=True)
    assert packed.input_ids.shape == (1, sum(s.input_ids.numel() for s in samples))
    assert torch.equal(padded.response_mask, packed.response_mask)
    assert torch.equal(padded.fields["advantages"], packed.fields["advantages"])
    with torch.no_grad():
        a, b = _response_logprobs(model, padded), _response_logprobs(model, packed)
        alone = [_response_logprobs(model, collate([s]))[0] for s in samples]
    mask = padded.response_mask
    torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=0)
    for i, s in enumerate(samples):  # each sample's own tokens, nothing of its neighbours
        torch.testing.assert_close(b[i, :s.response_len], alone[i], atol=1e-5, rtol=0)


def test_plan_gives_every_rank_an_equal_share_of_each_step():
    samples = _samples(16)
    plans = plan_training(samples, train_batch_size=8, micro_batch_size=2, world_size=2, epochs=2, seed=5)
    assert [len(p) for p in plans] == [4, 4]  # 16 samples / 8 per step x 2 epochs
    for k in range(4):
        step_samples = [s for rank in plans for mb in rank[k].micro_batches for s in mb]
        assert len(step_samples) == 8 and all(len(mb) == 2 for rank in plans for mb in rank[k].micro_batches)
        assert plans[0][k].tokens == plans[1][k].tokens == sum(s.action_tokens for s in step_samples)
        assert plans[0][k].sequences == 8
    for epoch in range(2):
        seen = [id(s) for rank in plans for step in rank[2 * epoch:2 * epoch + 2] for mb in step.micro_batches
                for s in mb]
        assert sorted(seen) == sorted(id(s) for s in samples)  # each sample once per epoch
    again = plan_training(samples, 8, 2, 2, 2, seed=5)
    other = plan_training(samples, 8, 2, 2, 2, seed=6)
    order = lambda p: [id(s) for rank in p for step in rank for mb in step.micro_batches for s in mb]  # noqa: E731
    assert order(again) == order(plans) and order(other) != order(plans)


def test_lr_schedule():
    assert [lr_multiplier(s, 4, 100, "constant_with_warmup", 0.1) for s in (0, 1, 3, 4, 99)] == [0.25, 0.5, 1, 1, 1]
    cosine = [lr_multiplier(s, 0, 100, "cosine_with_min_lr", 0.1) for s in (0, 50, 100, 200)]
    assert cosine == pytest.approx([1.0, 0.55, 0.1, 0.1])
    assert lr_multiplier(2, 4, 100, "cosine_with_min_lr", 0.1) == 0.75


def test_checkpoint_folders(tmp_path):
    def make(step: int, complete: bool):
        folder = checkpoint.step_dir(tmp_path, step)
        ownership.make_owned_dir(folder, "checkpoint")  # as the learner's save does
        (folder / "actor").mkdir()
        if complete:
            checkpoint.write_atomic(folder / checkpoint.MARKER, checkpoint.marker_contents(2, 3, ["actor"], step))
        return folder

    for step, complete in ((1, True), (2, True), (3, False), (4, True)):
        make(step, complete)
    assert checkpoint.resolve_checkpoint(tmp_path, 0).name == "global_step_4"
    with pytest.raises(ValueError, match="incomplete"):
        checkpoint.resolve_checkpoint(tmp_path, 3)
    (tmp_path / "latest").write_text("global_step_2")
    assert checkpoint.resolve_checkpoint(tmp_path, 0).name == "global_step_2"  # the coordinator's choice
    # A folder of the same name that the learner did not write (no marker): never deleted.
    (tmp_path / "global_step_0" / "data").mkdir(parents=True)
    removed = checkpoint.prune(tmp_path, keep=1, newest=tmp_path / "global_step_4")
    # Step 1 is beyond max_ckpt_num, step 3 is a crashed save; step 2 stays: `latest` names it.
    assert sorted(removed) == [str(tmp_path / "global_step_1"), str(tmp_path / "global_step_3")]
    assert (tmp_path / "global_step_0" / "data").is_dir()
    with pytest.raises(ValueError, match="--zero_stage"):
        checkpoint.check_compatible(tmp_path / "global_step_4", world_size=2, zero_stage=2, models=["actor"])
    with pytest.raises(ValueError, match="critic"):
        checkpoint.check_compatible(tmp_path / "global_step_4", world_size=2, zero_stage=3, models=["actor", "critic"])


def test_store_messages_are_data_not_code(tmp_path):
    failure = RankFailure(1, "ValueError", "bad", "Traceback ...", "INVALID_ARGUMENT")
    assert read_store_message(store_message("error", failure)) == ("error", failure)
    assert read_store_message(store_message("ok", 12)) == ("ok", 12)

    class Payload:  # what a forged store key could carry
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "ran"),))

    with pytest.raises(ValueError):
        read_store_message(pickle.dumps(("ok", Payload())))
    assert not (tmp_path / "ran").exists()


def test_rank_spec_from_flags_and_launcher_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    spec = resolve_rank_spec(-1, 0, -1, "", 0, num_gpus=4)
    assert (spec.rank, spec.world_size, spec.spawn_local, spec.master_addr) == (0, 4, True, "127.0.0.1")
    assert spec.master_port > 0
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    spec = resolve_rank_spec(-1, 0, -1, "", 0, num_gpus=1)
    assert (spec.rank, spec.world_size, spec.local_rank, spec.master_addr, spec.master_port, spec.spawn_local) == \
        (3, 8, 1, "10.0.0.2", 29500, False)
    assert resolve_rank_spec(5, 0, -1, "", 0, num_gpus=1).rank == 5  # a flag wins
    assert os.environ["RANK"] == "3"


@pytest.mark.parametrize("head, lora", [("chunked", False), ("fused", False), ("fused", True)])
def test_hidden_state_logprob_heads_match_the_plain_path_with_gradients(tiny_model_dir, head, lora):
    """--logprobs_head chunked / fused give the full-logits path's log-probs, entropies and
    gradients (of the output projection and, through it, of the backbone); also for a LoRA actor
    (a PEFT model: the adapters' gradients)."""
    from services.learner.logprob_head import response_outputs
    from services.common.rl_math import entropy_from_logits

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if lora:
        from services.learner.lora import LoraOptions, adapter_state, apply_lora

        model = apply_lora(model, LoraOptions(rank=4, alpha=8))
        for name, p in adapter_state(model):
            if "lora_B" in name:  # PEFT starts B at zero: a nonzero adapter shows in the outputs
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(2))
    for packed in (False, True):
        mb = collate(_samples(4, seed=3), packed=packed)
        weights = torch.randn(mb.response_mask.shape, generator=torch.Generator().manual_seed(1))
        params = ([p for name, p in adapter_state(model) if ".layers.0." in name] if lora
                  else [model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight])
        logits = forward_micro_batch(model, mb).logits
        response_logits = logits[:, :-1].reshape(-1, logits.shape[-1])[mb.out_index]
        plain = token_logprobs(response_logits, mb.input_ids[:, 1:].reshape(-1)[mb.out_index], 0.8)
        plain_entropy = entropy_from_logits(response_logits, 0.8)
        grads_plain = torch.autograd.grad((plain * weights * mb.response_mask).sum(), params)
        got, entropy, _ = response_outputs(model, mb, 0.8, head, chunk_tokens=5, want_entropy=head == "chunked")
        grads = torch.autograd.grad((got * weights * mb.response_mask).sum(), params)
        mask = mb.response_mask
        torch.testing.assert_close(got[mask], plain[mask], atol=2e-5, rtol=0)
        assert (got[~mask] == 0).all()
        if head == "chunked":
            torch.testing.assert_close(entropy[mask], plain_entropy[mask], atol=2e-5, rtol=0)
        for g, ref in zip(grads, grads_plain):
            torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-4)


def test_fused_logprob_pass_gives_the_log_softmax_gradient():
    from services.learner.logprob_head import _logprobs_and_grad_torch_

    g = torch.Generator().manual_seed(0)
    z = torch.randn(37, 53, generator=g, dtype=torch.float64) * 4
    y = torch.randint(0, 53, (37,), generator=g)
    zr = z.clone().requires_grad_(True)
    ref = torch.log_softmax(zr / 0.7, -1).gather(-1, y[:, None])[:, 0]
    (grad,) = torch.autograd.grad(ref.sum(), zr)
    out = _logprobs_and_grad_torch_(z, y, 1 / 0.7, rows=8)
    torch.testing.assert_close(out, ref.detach().float(), atol=1e-5, rtol=1e-6)  # float32 maths
    torch.testing.assert_close(z, grad, atol=1e-6, rtol=1e-5)  # row-wise d logp_i / d z_i


def test_varlen_attention_keeps_packed_samples_apart(tiny_model_dir):
    """attn_implementation varlen (CPU: per-sequence sdpa) on packed rows and on padded rows gives
    sdpa's logits on the padded batch."""
    from services.learner.deepspeed_setup import resolve_attn_implementation

    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    varlen = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                  attn_implementation=resolve_attn_implementation("varlen"))
    samples = _samples(4, seed=5)
    padded, packed = collate(samples), collate(samples, packed=True)
    ref = forward_micro_batch(sdpa, padded).logits
    got_padded = forward_micro_batch(varlen, padded).logits
    got_packed = forward_micro_batch(varlen, packed).logits[0]
    start = 0
    for i, s in enumerate(samples):
        n = s.input_ids.numel()
        torch.testing.assert_close(got_padded[i, :n], ref[i, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_packed[start:start + n], ref[i, :n], atol=1e-5, rtol=1e-5)
        start += n


def samples_with_a_long_one(seed: int, count: int, long_at: int) -> list[Sample]:
    """count random samples of 5-59 tokens, the one at long_at of 250 (longer than a 200-token budget)."""
    g = torch.Generator().manual_seed(seed)
    samples = [Sample(torch.randint(4, 600, (int(n),), generator=g), 2, {})
               for n in torch.randint(5, 60, (count,), generator=g)]
    samples[long_at] = Sample(torch.randint(4, 600, (250,), generator=g), 2, {})
    return samples


def test_dynamic_plan_fills_micro_batches_by_tokens_with_equal_counts_per_rank():
    samples = samples_with_a_long_one(seed=3, count=32, long_at=7)
    budget = 200
    plans = plan_training(samples, train_batch_size=16, micro_batch_size=2, world_size=2, epochs=1, seed=1,
                          max_tokens=budget)
    fixed = plan_training(samples, 16, 2, 2, 1, seed=1)
    for k in range(2):
        counts = [len(rank[k].micro_batches) for rank in plans]
        assert counts[0] == counts[1]  # every rank's reductions pair up with the others'
        for rank in range(2):
            micro = plans[rank][k].micro_batches
            # The same samples as the fixed plan's share of this rank, each once, in fewer passes.
            assert sorted(id(s) for mb in micro for s in mb) == sorted(
                id(s) for mb in fixed[rank][k].micro_batches for s in mb)
            assert all(len(mb) == 1 or sum(s.input_ids.numel() for s in mb) <= budget for mb in micro)
            assert len(micro) < len(fixed[rank][k].micro_batches)
        assert plans[0][k].tokens == fixed[0][k].tokens and plans[0][k].sequences == 16
    shares = [[s for mb in plans[r][k].micro_batches for s in mb] for r in range(2) for k in range(2)]
    assert any(len(share) > 0 and max(s.input_ids.numel() for s in share) == 250 for share in shares)
    assert plans == plan_training(samples, 16, 2, 2, 1, seed=1, max_tokens=budget)  # deterministic


def test_packed_forward_passes_fill_a_token_budget_and_cover_every_sample_once():
    samples = samples_with_a_long_one(seed=5, count=40, long_at=3)
    budget = 200
    layout = token_forward_micro_batches(samples, budget, world_size=2)
    indices = [i for rank in layout for mb in rank for i in mb]
    assert sorted(indices) == list(range(40))
    for rank in layout:
        assert all(len(mb) == 1 or sum(samples[i].input_ids.numel() for i in mb) <= budget for mb in rank)
    total = sum(s.input_ids.numel() for s in samples)
    passes = sum(len(rank) for rank in layout)
    # Near-full passes: no more than one over the fewest the budget allows (plus the long one's own).
    assert passes <= -(-total // budget) + 2
    assert abs(len(layout[0]) - len(layout[1])) <= 1
    # A budget that holds them all: one pass per rank, whatever a padded layout would take.
    assert [len(rank) for rank in token_forward_micro_batches(samples, 10_000, 2)] == [1, 1]
    assert sum(len(rank) for rank in forward_micro_batches(samples, 8, 2)) == 5
    # Every rank gets a pass while there are samples enough; one sample leaves the other rank none.
    assert [len(rank) for rank in token_forward_micro_batches(samples[:2], 10_000, 2)] == [1, 1]
    assert [len(rank) for rank in token_forward_micro_batches(samples[:1], 10_000, 2)] == [1, 0]
