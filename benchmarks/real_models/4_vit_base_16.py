"""transformers' ViT-B/16: batch 32 images of 224 x 224."""
import torch
import transformers

batch_size = 32
image_size = 224


def Model():
    return transformers.ViTModel(transformers.ViTConfig(image_size=image_size))


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(batch_size, 3, image_size, image_size)]
