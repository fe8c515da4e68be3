"""LoRA in the learner (services/learner/lora.py): the adapter's names, what trains, what stays frozen."""

from __future__ import annotations

import torch
import transformers

from services.learner.lora import LoraOptions, adapter_state, apply_lora, engine_name, scaling


def test_engine_names_drop_the_peft_prefix_and_the_adapter_name():
    assert engine_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert engine_name("base_model.model.model.layers.3.mlp.down_proj.lora_B.default.weight") == \
        "model.layers.3.mlp.down_proj.lora_B.weight"
    assert engine_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") is None
    assert engine_name("base_model.model.score.modules_to_save.default.weight") is None
    assert scaling(LoraOptions(rank=8, alpha=16)) == 2.0


def test_adapter_state_is_exactly_the_trainable_adapter(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n_layers = model.config.num_hidden_layers
    peft_model = apply_lora(model, LoraOptions(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
    state = adapter_state(peft_model)
    expected = [f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
                for i in range(n_layers) for m in ("q_proj", "v_proj") for ab in "AB"]
    assert [name for name, _ in state] == expected
    trainable = {id(p) for p in peft_model.parameters() if p.requires_grad}
    assert trainable == {id(p) for _, p in state}
    hidden = model.config.hidden_size
    shapes = dict((n, tuple(p.shape)) for n, p in state)
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, hidden)
    # B starts at zero: the adapted model's first forward is the base model's.
    ids = torch.tensor([[1, 5, 9, 12]])
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.testing.assert_close(peft_model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_merged_state_dict_equals_peft_merge_and_unload(tiny_reward_model_dir):
    """The merge the saved merged/ folder is written with, on a critic (its head trained beside the adapter)."""
    from services.learner.lora import merged_state_dict

    config = transformers.AutoConfig.from_pretrained(tiny_reward_model_dir, num_labels=1)
    model = transformers.AutoModelForTokenClassification.from_pretrained(tiny_reward_model_dir, config=config)
    options = LoraOptions(rank=4, alpha=12, target_modules=("q_proj", "up_proj"))
    peft_model = apply_lora(model, options, kind="critic")
    with torch.no_grad():
        for _, p in peft_model.named_parameters():
            if p.requires_grad:  # the adapter and the head's trained copy
                p.add_(torch.randn_like(p) * 0.05)
    merged = merged_state_dict(peft_model.state_dict(), scaling(options))
    expected = peft_model.merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(merged[name], expected[name], rtol=1e-6, atol=1e-6, msg=name)
