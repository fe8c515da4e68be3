"""Model shapes of the benchmarks: Qwen2.5's configurations with random weights (transformers'
Qwen2Config keyword arguments), the reference models of the GPU measurements."""

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
