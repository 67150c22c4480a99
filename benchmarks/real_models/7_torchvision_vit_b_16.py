"""torchvision's vit_b_16: batch 32 images of 224 x 224. torchvision starts its classifier head
at zero (every logit 0, whatever the body computes), so the head gets random weights here: a
comparison of all-zero outputs would check nothing."""
import torch
import torchvision

batch_size = 32


def Model():
    model = torchvision.models.vit_b_16()
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(batch_size, 3, 224, 224)]
