"""torchvision's convnext_tiny: batch 32 images of 224 x 224."""
import torch
import torchvision

batch_size = 32


def Model():
    return torchvision.models.convnext_tiny()


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(batch_size, 3, 224, 224)]
