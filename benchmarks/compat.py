"""Does it compile what nobody here wrote? Many small models, each through `fusec.compile(model)`
unchanged, compared with eager: one line per model and mode, OK / MISMATCH / ERROR.

    python benchmarks/compat.py [--modes eval,batch,train,bf16] [--only swin,bloom] [--no-tf32]
                                [--time] [--batch 2] [--image-size 64] [--json out.json]

The models are transformers models built from tiny configs (random weights, nothing downloaded)
and, where torchvision imports (its registry wheels need CUDA torch), every torchvision
classification model at 64 x 64 inputs. The modes:

* `eval`: inference (`torch.no_grad()`, float32): every output no further from the model's
  float64 outputs than twice eager's error plus 1e-5 (relative, in norm);
* `batch`: the same compiled model called again with batch 1 (a recompile), against eager;
* `train`: one forward and backward with gradients on (dropout, layer drop and stochastic depth
  off): the loss and every parameter's gradient no further from a float64 copy's than 4x
  eager's error plus 1e-5 (relative, in norm; see TRAIN_FACTOR);
* `bf16`: the model and inputs in bfloat16, inference: twice eager's error plus 1e-3;
* `dynamo`: as `eval`, through `torch.compile(model, backend="fusec")` (Dynamo's graphs, with
  its graph breaks, each compiled by fusec).

`--time` also times eager and fusec in the eval and bf16 modes and lists the models fusec makes
slower (with `--batch 32 --image-size 224`, the sizes people run). A case that eager itself
cannot run (in any mode) is a SKIP. This is a sweep, not a test: a failure is printed with its
first line and the run goes on, so one run lists everything that breaks. tests/models/test_hf_models.py keeps a subset as tests.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
import traceback

import torch

import fusec
from fusec.timing import median_ms


def hf_models() -> dict:
    try:
        import transformers as T
    except ImportError:
        return {}
    dec = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)
    enc = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    img = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=64)
    tokens, image = "tokens", "image"
    return {
        "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)), tokens),
        "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**dec)), tokens),
        "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**dec)), tokens),
        "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**dec)), tokens),
        "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(**dec)), tokens),
        "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**dec, head_dim=8)), tokens),
        "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**{k: v for k, v in dec.items() if k != "num_key_value_heads"})), tokens),
        "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=0)), tokens),
        "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4)), tokens),
        "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)), tokens),
        "bert": (lambda: T.BertModel(T.BertConfig(**enc)), tokens),
        "distilbert": (lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=96, dim=32, hidden_dim=64, n_layers=2, n_heads=4, pad_token_id=0)), tokens),
        "roberta": (lambda: T.RobertaModel(T.RobertaConfig(**enc)), tokens),
        "albert": (lambda: T.AlbertModel(T.AlbertConfig(embedding_size=16, **enc)), tokens),
        "electra": (lambda: T.ElectraModel(T.ElectraConfig(embedding_size=16, **enc)), tokens),
        "deberta_v2": (lambda: T.DebertaV2Model(T.DebertaV2Config(**enc)), tokens),
        "t5_encoder": (lambda: T.T5EncoderModel(T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)), tokens),
        "bart": (lambda: T.BartModel(T.BartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0)), tokens),
        "clip_text": (lambda: T.CLIPTextModel(T.CLIPTextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=0)), tokens),
        "vit": (lambda: T.ViTModel(T.ViTConfig(**img)), image),
        "deit": (lambda: T.DeiTModel(T.DeiTConfig(**img)), image),
        "swin": (lambda: T.SwinModel(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)), image),
        "resnet": (lambda: T.ResNetModel(T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])), image),
        "convnext": (lambda: T.ConvNextModel(T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)), image),
        "regnet": (lambda: T.RegNetModel(T.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8)), image),
        "mobilevit": (lambda: T.MobileViTModel(T.MobileViTConfig(image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32])), image),
        "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **dec)), tokens),
        "mamba": (lambda: T.MambaModel(T.MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2)), tokens),
        "gpt_bigcode": (lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)), tokens),
        "xlnet": (lambda: T.XLNetModel(T.XLNetConfig(vocab_size=96, d_model=32, n_layer=2, n_head=4, d_inner=64)), tokens),
        "mpnet": (lambda: T.MPNetModel(T.MPNetConfig(**enc)), tokens),
        "mobilebert": (lambda: T.MobileBertModel(T.MobileBertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16, max_position_embeddings=64)), tokens),
        "funnel": (lambda: T.FunnelModel(T.FunnelConfig(vocab_size=96, d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1], num_decoder_layers=1)), tokens),
        "longformer": (lambda: T.LongformerModel(T.LongformerConfig(attention_window=4, **enc)), tokens),
        "fnet": (lambda: T.FNetModel(T.FNetConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64)), tokens),
        "wav2vec2": (lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0)), "waveform"),
        "whisper_encoder": (lambda: T.WhisperModel(T.WhisperConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16, max_target_positions=16, pad_token_id=1, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)).get_encoder(), "mel"),
        "clip_vision": (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**img)), image),
        "dinov2": (lambda: T.Dinov2Model(T.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2)), image),
        "beit": (lambda: T.BeitModel(T.BeitConfig(use_relative_position_bias=True, **img)), image),
        "levit": (lambda: T.LevitModel(T.LevitConfig(image_size=32, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1], key_dim=[8, 8, 8])), image),
        "pvt": (lambda: T.PvtModel(T.PvtConfig(image_size=32, hidden_sizes=[16, 32, 48, 64], num_attention_heads=[1, 1, 2, 2], depths=[1, 1, 1, 1])), image),
        "mobilenet_v2": (lambda: T.MobileNetV2Model(T.MobileNetV2Config(image_size=32, depth_multiplier=0.25)), image),
        "detr": (lambda: T.DetrModel(T.DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], out_features=["stage4"]), d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8)), image),
        "segformer": (lambda: T.SegformerModel(T.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])), image),
        # added 2026-11-26 (transformers 5.24): more decoders, encoders, vision and speech models
        "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**dec, head_dim=8)), tokens),
        "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**dec, head_dim=8)), tokens),
        "gemma3_text": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**dec, head_dim=8)), tokens),
        "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(**dec)), tokens),
        "stablelm": (lambda: T.StableLmForCausalLM(T.StableLmConfig(**dec)), tokens),
        "cohere": (lambda: T.CohereForCausalLM(T.CohereConfig(**dec)), tokens),
        "olmo": (lambda: T.OlmoForCausalLM(T.OlmoConfig(**dec)), tokens),
        "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**dec)), tokens),
        "granite": (lambda: T.GraniteForCausalLM(T.GraniteConfig(**dec)), tokens),
        "starcoder2": (lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**dec)), tokens),
        "qwen2_moe": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**dec, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)), tokens),
        "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4)), tokens),
        "codegen": (lambda: T.CodeGenForCausalLM(T.CodeGenConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4)), tokens),
        "mpt": (lambda: T.MptForCausalLM(T.MptConfig(vocab_size=96, d_model=32, n_heads=4, n_layers=2, max_seq_len=64)), tokens),
        "rwkv": (lambda: T.RwkvModel(T.RwkvConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64, context_length=64)), tokens),
        "biogpt": (lambda: T.BioGptModel(T.BioGptConfig(**enc)), tokens),
        "xglm": (lambda: T.XGLMModel(T.XGLMConfig(vocab_size=96, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64, max_position_embeddings=64)), tokens),
        "squeezebert": (lambda: T.SqueezeBertModel(T.SqueezeBertConfig(**enc, embedding_size=32, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2, intermediate_groups=2, output_groups=2)), tokens),
        "convbert": (lambda: T.ConvBertModel(T.ConvBertConfig(**enc, embedding_size=32)), tokens),
        "canine": (lambda: T.CanineModel(T.CanineConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, downsampling_rate=2, num_hash_buckets=64, num_hash_functions=2, local_transformer_stride=4)), tokens),
        "big_bird": (lambda: T.BigBirdModel(T.BigBirdConfig(**enc, attention_type="original_full")), tokens),
        "layoutlm": (lambda: T.LayoutLMModel(T.LayoutLMConfig(**enc)), tokens),
        "ernie": (lambda: T.ErnieModel(T.ErnieConfig(**enc)), tokens),
        "yoso": (lambda: T.YosoModel(T.YosoConfig(**enc)), tokens),
        "mbart": (lambda: T.MBartModel(T.MBartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0)), tokens),
        "swinv2": (lambda: T.Swinv2Model(T.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)), image),
        "convnextv2": (lambda: T.ConvNextV2Model(T.ConvNextV2Config(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)), image),
        "mobilenet_v1": (lambda: T.MobileNetV1Model(T.MobileNetV1Config(image_size=32, depth_multiplier=0.25)), image),
        "poolformer": (lambda: T.PoolFormerModel(T.PoolFormerConfig(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1])), image),
        "vit_mae": (lambda: T.ViTMAEModel(T.ViTMAEConfig(**img, mask_ratio=0.0)), image),
        "vit_msn": (lambda: T.ViTMSNModel(T.ViTMSNConfig(**img)), image),
        "data2vec_vision": (lambda: T.Data2VecVisionModel(T.Data2VecVisionConfig(**img)), image),
        "hubert": (lambda: T.HubertModel(T.HubertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0)), "waveform"),
        "sew": (lambda: T.SEWModel(T.SEWConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0, squeeze_factor=2)), "waveform"),
        "glpn": (lambda: T.GLPNModel(T.GLPNConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])), image),
    }


def torchvision_models() -> dict:
    try:
        import torchvision
    except Exception:  # noqa: BLE001 - the registry's wheels do not import next to CPU torch
        return {}
    out = {}
    for name in torchvision.models.list_models(module=torchvision.models):
        if name.startswith(("vit_h", "vit_l", "regnet_y_128", "regnet_y_32", "regnet_y_16")):
            continue  # hundreds of MB of random weights for nothing new
        kind = "big_image" if name.startswith(("vit", "swin", "maxvit", "inception", "googlenet")) \
            else "image64"
        out[f"tv_{name}"] = (lambda n=name: torchvision.models.get_model(n, weights=None), kind)
    return out


SIZES = {"image": 32, "image64": 64, "big_image": 224}  # --image-size sets image64's
BATCH = [2]  # --batch


def example(kind: str, device: str):
    batch = BATCH[0]
    if kind == "tokens":
        return (torch.randint(1, 96, (batch, 12), device=device),)
    if kind == "waveform":  # raw audio samples
        return (torch.randn(batch, 400, device=device),)
    if kind == "mel":  # a (mel bins, frames) spectrogram
        return (torch.randn(batch, 16, 32, device=device),)
    size = SIZES[kind]
    return (torch.randn(batch, 3, size, size, device=device),)


def leaves(o) -> list:
    if isinstance(o, torch.Tensor):
        return [o]
    if hasattr(o, "to_tuple"):
        o = o.to_tuple()
    if isinstance(o, (list, tuple)):
        return [t for x in o for t in leaves(x)]
    if isinstance(o, dict):
        return [t for x in o.values() for t in leaves(x)]
    if hasattr(o, "layers"):  # a transformers cache
        return [t for layer in o.layers for t in leaves(vars(layer))]
    return []


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| over the whole tensor (0 for an empty or all-zero reference)."""
    scale = ref.double().norm().item()
    diff = (got.double() - ref.double()).norm().item()
    return diff / scale if scale else diff


def close(want, got, ref, tol) -> tuple[bool, str]:
    """fusec's outputs against eager's: the same count, shapes, dtypes; integers equal; floats
    no further from the float64 reference than twice eager's own error plus `tol` (eager's
    convolutions and matmuls on a GPU use TF32 by default, so two correct programs that pick
    different algorithms differ by far more than float32 rounding). Where the float64 copy gives
    nan or inf and eager does not, eager's output is the reference."""
    if len(want) != len(got):
        return False, f"{len(got)} outputs, eager {len(want)}"
    for i, (w, g) in enumerate(zip(want, got)):
        if w.shape != g.shape or w.dtype != g.dtype:
            return False, f"output {i}: {tuple(g.shape)} {g.dtype} vs eager {tuple(w.shape)} {w.dtype}"
        if not w.is_floating_point():
            if not torch.equal(w, g):
                return False, f"output {i}: integer values differ"
            continue
        r = ref[i] if ref is not None else w
        err_f, err_e = relative_error(g, r), relative_error(w, r)
        if not math.isfinite(err_e) and math.isfinite(relative_error(w, w)):
            # the float64 copy overflowed where eager did not (CANINE's hash embeddings): no
            # reference there, so fusec is held to eager's own output, within `tol`
            r, err_f, err_e = w, relative_error(g, w), 0.0
        if not err_f <= 2 * err_e + tol:
            where = "float64 reference" if r is not w else "eager's output: float64 gave nan/inf"
            return False, f"output {i}: error {err_f:.3g} vs eager's {err_e:.3g} ({where})"
    return True, ""


def float64_reference(model, inputs):
    """The model's outputs in float64 (a copy of it), or None where it cannot run so."""
    try:
        wide = copy.deepcopy(model).double()
        with torch.no_grad():
            return leaves(wide(*[t.double() if t.is_floating_point() else t for t in inputs]))
    except Exception:  # noqa: BLE001 - then eager's own outputs are the reference
        return None


def no_randomness(model) -> None:
    """Dropout, F.dropout(p=self.dropout), layer drop and stochastic depth off: train mode with
    the same result on every call."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) or "stochastic" in type(m).__name__.lower():
            m.p = 0.0
        for attr, value in list(vars(m).items()):
            if "drop" in attr.lower() and isinstance(value, float):
                setattr(m, attr, 0.0)
        config = getattr(m, "config", None)  # read at call time (wav2vec2's config.layerdrop)
        for attr in list(vars(config)) if hasattr(config, "__dict__") else []:
            if "drop" in attr.lower() and isinstance(getattr(config, attr), float):
                setattr(config, attr, 0.0)


def train_step(model, fn, inputs):
    """One forward and backward of sum(mean(out ** 2)) over the float outputs: (loss, grads)."""
    model.zero_grad(set_to_none=True)
    outs = [o for o in leaves(fn(*inputs)) if o.is_floating_point() and o.requires_grad]
    loss = sum(o.to(torch.float64).square().mean() for o in outs)
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


# A backward made of decomposed ops adds up in other orders than eager's fused backward
# kernels: on DINOv2's gradients (float32, CPU) torch.compile's median error against float64 was
# 1.9x eager's and fusec's 2.3x, so gradients get more room than outputs.
TRAIN_FACTOR = 4


def train_check(model, inputs, device) -> tuple[str, str]:
    """Gradients of fusec's compiled model against eager's, both measured against a float64
    copy: fusec's error at most TRAIN_FACTOR times eager's plus 1e-5 (relative, in norm). Where
    the model cannot run in float64, eager is the reference and torch.compile's error the bound."""
    model.train()
    no_randomness(model)
    try:
        want = train_step(model, model, inputs)
    except Exception as e:  # noqa: BLE001 - the case itself is invalid (an input too small ...)
        return "SKIP", f"eager fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        wide = copy.deepcopy(model).double()
        ref = train_step(wide, wide, [t.double() if t.is_floating_point() else t for t in inputs])
        yardstick = want
    except Exception:  # noqa: BLE001 - no float64 run (XGLM's mask overflows float32 there):
        # eager is the reference, and torch.compile's distance from it is the yardstick (a
        # gradient of norm 1e-8 is cancellation, and any other order of sums moves it by 1e-3)
        ref = want
        torch._dynamo.reset()
        yardstick = train_step(model, torch.compile(model), inputs)
    got = train_step(model, fusec.compile(model), inputs)
    bad = []
    for i, (g, w, r) in enumerate(zip([got[0], *got[1]], [yardstick[0], *yardstick[1]],
                                      [ref[0], *ref[1]])):
        if (g is None) != (w is None):
            bad.append(i)
        elif g is not None and relative_error(g, r) > TRAIN_FACTOR * relative_error(w, r) + 1e-5:
            bad.append(i)
    if bad:
        i = bad[0]
        g, w, r = [x[0] if i == 0 else x[1][i - 1] for x in (got, yardstick, ref)]
        what = "the loss" if i == 0 else f"gradient {i - 1}"
        whose = "eager's" if yardstick is want else "torch.compile's (no float64 run)"
        why = "missing" if g is None or w is None else \
            f"error {relative_error(g, r):.3g} vs {whose} {relative_error(w, r):.3g}"
        return "MISMATCH", f"{len(bad)} of {len(got[1]) + 1} differ; {what}: {why}"
    return "OK", ""


def run_one(build, kind, mode, device, timed: bool = False) -> tuple[str, str]:
    torch.manual_seed(0)
    model = build().to(device)
    inputs = example(kind, device)
    if mode == "train":
        return train_check(model, inputs, device)
    model.eval()
    tol = 1e-5
    if mode == "bf16":
        model = model.to(torch.bfloat16)
        inputs = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)
        tol = 1e-3
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as e:  # noqa: BLE001 - the case itself is invalid (a config this harness
        # cannot feed): not fusec's to pass or fail
        return "SKIP", f"eager fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if mode == "dynamo":
        torch._dynamo.reset()  # its recompile limit counts shared code (transformers' wrappers)
    compiled = torch.compile(model, backend="fusec") if mode == "dynamo" else fusec.compile(model)
    calls = [inputs] + ([tuple(t[:1] for t in inputs)] if mode == "batch" else [])
    with torch.no_grad():
        for call in calls:  # each run from one RNG state: a model may draw (ViTMAE's masking)
            torch.manual_seed(1)
            want = leaves(model(*call))
            torch.manual_seed(1)
            got = leaves(compiled(*call))
            torch.manual_seed(1)
            ok, why = close(want, got, float64_reference(model, call), tol)
            if not ok:
                return "MISMATCH", f"batch {call[0].shape[0]}: {why}"
        if timed:  # eager against fusec on the first call's inputs (do_bench medians on a GPU)
            eager_ms = median_ms(model, *inputs, device=device)
            fusec_ms = median_ms(compiled, *inputs, device=device)
            return "OK", f"eager {eager_ms:.3f} ms, fusec {fusec_ms:.3f} ms: {eager_ms / fusec_ms:.2f}x"
    return "OK", ""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="eval,batch,train")
    p.add_argument("--only", default="", help="comma-separated name prefixes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-tf32", action="store_true",
                   help="cuDNN and cuBLAS in full float32 (PyTorch's default lets cuDNN use TF32)")
    p.add_argument("--time", action="store_true",
                   help="also time eager and fusec (eval and bf16 modes), list what fusec slows")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64, help="torchvision's CNNs' input size")
    p.add_argument("--json")
    args = p.parse_args()
    BATCH[0], SIZES["image64"] = args.batch, args.image_size
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    models = {**hf_models(), **torchvision_models()}
    if args.only:
        models = {k: v for k, v in models.items() if k.startswith(tuple(args.only.split(",")))}
    rows = []
    for name, (build, kind) in models.items():
        for mode in args.modes.split(","):
            start = time.perf_counter()
            try:
                status, why = run_one(build, kind, mode, args.device, args.time)
            except Exception as e:  # noqa: BLE001 - a sweep: report and go on
                status, why = "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                tb = traceback.format_exc().splitlines()
                why += " | " + " / ".join(line.strip() for line in tb[-4:-1])[:300]
            seconds = time.perf_counter() - start
            rows.append(dict(model=name, mode=mode, status=status, detail=why, seconds=seconds))
            print(f"{name:28s} {mode:6s} {status:9s} {seconds:6.1f}s {why}", flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("OK", "MISMATCH", "ERROR", "SKIP")}
    print(f"\n{len(rows)} runs on {args.device}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    slower = [f"{r['model']} {r['mode']} ({r['detail'].split(': ')[-1]})" for r in rows
              if r["detail"].endswith("x") and float(r["detail"].rsplit(" ", 1)[-1][:-1]) < 1.0]
    if args.time:
        print("slower than eager: " + (", ".join(slower) or "none"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
