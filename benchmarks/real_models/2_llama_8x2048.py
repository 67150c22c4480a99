"""A Llama of 8 layers of width 2048 (grouped-query attention, 16 query heads sharing 4 key/value
heads, SwiGLU MLP), called as transformers calls it by default: it returns its DynamicCache."""
import torch
import transformers

batch_size = 4
seq_len = 512


def Model():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048))


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randint(0, 32000, (batch_size, seq_len))]
