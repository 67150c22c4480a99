"""GPT-2 small (124M parameters) with its language-model head, whose weight is tied to the token
embedding: batch 8 x 512 tokens."""
import torch
import transformers

batch_size = 8
seq_len = 512


def Model():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config())


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randint(0, 50257, (batch_size, seq_len))]
