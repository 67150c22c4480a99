"""BERT-base (12 layers, width 768): batch 16 x 512 tokens."""
import torch
import transformers

batch_size = 16
seq_len = 512


def Model():
    return transformers.BertModel(transformers.BertConfig())


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randint(0, 30522, (batch_size, seq_len))]
