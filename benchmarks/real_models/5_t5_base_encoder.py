"""The encoder of T5-base (12 layers, width 768, relative position buckets): batch 16 x 512."""
import torch
import transformers

batch_size = 16
seq_len = 512


def Model():
    return transformers.T5EncoderModel(transformers.T5Config())


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randint(0, 32128, (batch_size, seq_len))]
