"""The five models of benchmarks/train.py, each with its batches and its loss, built from configs.

    workload("gpt2", device="cpu", small=True) -> Workload(name, model, batches, about)

Every model is built from a config with random weights (nothing is downloaded) and with every
dropout probability 0, so that two systems that start from the same weights and see the same
batches should print the same losses step by step. `model(**batch)` returns the loss: the model's
own forward and its loss are one module, so a compiler sees (and may fuse) the loss too.

| name | full size (a GPU) | small (the default on a CPU: runs in seconds) |
|---|---|---|
| gpt2 | HF GPT-2, 12 layers, batch 8 x 512 | 2 layers of width 64, batch 2 x 32 |
| llama | HF Llama at Llama-2-7B's width (4096, MLP 11008, 32 heads), 2 layers, batch 4 x 512 | 2 layers of width 64, 4 heads sharing 2 key/value heads |
| bert | HF BERT-base masked LM (15% of tokens masked), batch 8 x 512 | 2 layers of width 64 |
| vit | ViT-B/16 on 224 x 224 images, batch 32 (torchvision's when it imports, else HF's) | 2 layers of width 64, 32 x 32 images in 8 x 8 patches |
| resnet50 | resnet50 on 224 x 224 images, batch 64, channels-last (torchvision's when it imports, else HF's ResNet config, which is resnet50) | a bottleneck ResNet of one block per stage, widths 32-256, 64 x 64 images |
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MODELS = ("gpt2", "llama", "bert", "vit", "resnet50")
CLASSES = 10  # labels of the image models' small configs (1000 at full size)
# what transformers' image classifiers write into their config at the first call with labels
# when it is None: set here, so that the second call reads the same Python state as the first
# (a compiler that guards on it would otherwise compile the step again at the second call)
SINGLE_LABEL = "single_label_classification"


@dataclass
class Workload:
    name: str
    model: torch.nn.Module  # model(**batch) -> the loss, a 0-d tensor
    batches: list  # one dict of keyword arguments per step
    about: str  # one line: what the model and the batch are


class WithLoss(torch.nn.Module):
    """A model whose output is logits, followed by cross-entropy against `labels`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        return torch.nn.functional.cross_entropy(self.model(pixel_values), labels)


class HFLoss(torch.nn.Module):
    """A transformers model called with its labels: its own loss (shifted for causal LMs,
    positions labelled -100 ignored for the masked LM)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch).loss


def _torchvision():
    try:
        import torchvision
        return torchvision
    except Exception:  # noqa: BLE001 (its wheels are built for CUDA torch: absent on this CPU)
        return None


def _tokens(vocab: int, batch: int, seq: int, steps: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), generator=gen).to(device) for _ in range(steps)]


def _images(size: int, classes: int, batch: int, steps: int, device: str,
            channels_last: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 3, size, size, generator=gen).to(device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append(dict(pixel_values=x,
                        labels=torch.randint(0, classes, (batch,), generator=gen).to(device)))
    return out


def gpt2(device, small, steps, layers=None, batch=None, seq=None) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel
    dims = dict(n_embd=64, n_head=4, n_positions=64, vocab_size=256, n_layer=2) if small else {}
    if layers:
        dims["n_layer"] = layers
    config = GPT2Config(attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, **dims)
    batch, seq = batch or (2 if small else 8), seq or (32 if small else 512)
    model = HFLoss(GPT2LMHeadModel(config))
    ids = _tokens(config.vocab_size, batch, seq, steps, device)
    return Workload("gpt2", model, [dict(input_ids=t, labels=t) for t in ids],
                    f"HF GPT-2, {config.n_layer} layers of width {config.n_embd}, "
                    f"batch {batch} x {seq}")


def llama(device, small, steps, layers=None, batch=None, seq=None) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM
    if small:
        dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    else:  # Llama-2-7B's width, fewer layers
        dims = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048)
    config = LlamaConfig(num_hidden_layers=layers or 2, attention_dropout=0.0,
                         attn_implementation="sdpa", **dims)
    batch, seq = batch or (2 if small else 4), seq or (32 if small else 512)
    model = HFLoss(LlamaForCausalLM(config))
    ids = _tokens(config.vocab_size, batch, seq, steps, device)
    return Workload("llama", model, [dict(input_ids=t, labels=t) for t in ids],
                    f"HF Llama, {config.num_hidden_layers} layers of width {config.hidden_size}, "
                    f"batch {batch} x {seq}")


def bert(device, small, steps, layers=None, batch=None, seq=None) -> Workload:
    from transformers import BertConfig, BertForMaskedLM
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, vocab_size=256, max_position_embeddings=64) if small else {}
    if layers:
        dims["num_hidden_layers"] = layers
    config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation="sdpa", **dims)
    batch, seq = batch or (2 if small else 8), seq or (32 if small else 512)
    model = HFLoss(BertForMaskedLM(config))
    gen = torch.Generator().manual_seed(2)
    mask_id = 3  # any id: the weights are random
    batches = []
    for ids in _tokens(config.vocab_size, batch, seq, steps, device):
        masked = (torch.rand(ids.shape, generator=gen) < 0.15).to(device)
        masked[:, 0] = True  # at least one label per row
        batches.append(dict(input_ids=torch.where(masked, mask_id, ids),
                            labels=torch.where(masked, ids, -100)))
    return Workload("bert", model, batches,
                    f"HF BERT masked LM, {config.num_hidden_layers} layers of width "
                    f"{config.hidden_size}, batch {batch} x {seq}, 15% masked")


def vit(device, small, steps, layers=None, batch=None, seq=None) -> Workload:
    tv = _torchvision()
    batch = batch or (4 if small else 32)
    if tv is not None and not small:
        model = WithLoss(tv.models.vit_b_16(num_classes=1000, dropout=0.0,
                                            attention_dropout=0.0))
        return Workload("vit", model, _images(224, 1000, batch, steps, device),
                        f"torchvision vit_b_16, batch {batch} x 224 x 224")
    from transformers import ViTConfig, ViTForImageClassification
    dims = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=128, num_labels=CLASSES) if small \
        else dict(num_labels=1000)
    if layers:
        dims["num_hidden_layers"] = layers
    config = ViTConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="sdpa", problem_type=SINGLE_LABEL, **dims)
    model = HFLoss(ViTForImageClassification(config))
    return Workload("vit", model, _images(config.image_size, config.num_labels, batch, steps,
                                          device),
                    f"HF ViT, {config.num_hidden_layers} layers of width {config.hidden_size}, "
                    f"patches {config.patch_size}, batch {batch} x {config.image_size}^2")


def resnet50(device, small, steps, layers=None, batch=None, seq=None) -> Workload:
    tv = _torchvision()
    batch = batch or (4 if small else 64)
    if tv is not None and not small:
        model = WithLoss(tv.models.resnet50()).to(memory_format=torch.channels_last)
        return Workload("resnet50", model, _images(224, 1000, batch, steps, device, True),
                        f"torchvision resnet50, batch {batch} x 224 x 224, channels-last")
    from transformers import ResNetConfig, ResNetForImageClassification
    dims = dict(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                num_labels=CLASSES) if small else dict(num_labels=1000)  # the default: resnet50
    config = ResNetConfig(problem_type=SINGLE_LABEL, **dims)
    size = 64 if small else 224  # 64: the last stage's batch norms see 2 x 2 pixels, not one
    model = HFLoss(ResNetForImageClassification(config))
    if not small:  # as the torchvision one: convolutions in the layout a GPU wants
        model = model.to(memory_format=torch.channels_last)
    return Workload("resnet50", model, _images(size, config.num_labels, batch, steps, device,
                                               channels_last=not small),
                    f"HF ResNet ({'resnet50' if not small else 'one bottleneck a stage'}), "
                    f"widths {config.hidden_sizes[0]}-{config.hidden_sizes[-1]}, "
                    f"batch {batch} x {size}^2{', channels-last' if not small else ''}")


def workload(name: str, device: str, small: bool, steps: int, **sizes) -> Workload:
    """Model `name` (one of MODELS) on `device` in training mode, from seed 0, with `steps`
    batches from seed 1. `sizes`: layers, batch, seq (None: the table's default)."""
    builders = dict(gpt2=gpt2, llama=llama, bert=bert, vit=vit, resnet50=resnet50)
    if name not in builders:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    torch.manual_seed(0)
    w = builders[name](device, small, steps, **sizes)
    w.model = w.model.to(device).train()
    return w
