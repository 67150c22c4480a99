"""Does it compile what nobody here wrote? Many small models, each through `fusec.compile(model)`
unchanged, compared with eager: one line per model and mode, OK / MISMATCH / ERROR.

    python benchmarks/compat.py [--modes eval,batch,train,bf16] [--only swin,bloom] [--json out.json]

The models are transformers models built from tiny configs (random weights, nothing downloaded)
and, where torchvision imports (its registry wheels need CUDA torch), every torchvision
classification model at 64 x 64 inputs. The modes:

* `eval`: inference (`torch.no_grad()`, float32) against eager, at atol = rtol = 1e-4;
* `batch`: the same compiled model called again with batch 1 (a recompile), against eager;
* `train`: one forward and backward with gradients on (dropout off), the loss and every
  parameter's gradient against eager's, at 1e-3;
* `bf16`: the model and inputs in bfloat16, inference, at 3e-2 (two roundings apart).

This is a sweep, not a test: a failure is printed with its first line and the run goes on, so one
run lists everything that breaks. tests/models/test_hf_models.py keeps a subset as tests.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

import fusec


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
        "segformer": (lambda: T.SegformerModel(T.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])), image),
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


def example(kind: str, device: str, batch: int = 2):
    if kind == "tokens":
        return (torch.randint(1, 96, (batch, 12), device=device),)
    size = {"image": 32, "image64": 64, "big_image": 224}[kind]
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


def close(a, b, tol) -> tuple[bool, str]:
    if len(a) != len(b):
        return False, f"{len(b)} outputs, eager {len(a)}"
    worst = ""
    ok = True
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, f"shape/dtype {tuple(y.shape)} {y.dtype} vs eager {tuple(x.shape)} {x.dtype}"
        if x.is_floating_point() and not torch.allclose(x.float(), y.float(), atol=tol, rtol=tol,
                                                          equal_nan=True):
            ok, worst = False, f"max |diff| {(x.float() - y.float()).abs().max().item():.3g}"
        elif not x.is_floating_point() and not torch.equal(x, y):
            ok, worst = False, "integer output differs"
    return ok, worst


def run_one(build, kind, mode, device) -> tuple[str, str]:
    torch.manual_seed(0)
    model = build().to(device)
    inputs = example(kind, device)
    if mode == "train":
        model.train()
        for m in model.modules():  # no randomness: nn.Dropout, and F.dropout(p=self.dropout)
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
            for attr, value in list(vars(m).items()):
                if "drop" in attr.lower() and isinstance(value, float):
                    setattr(m, attr, 0.0)
        compiled = fusec.compile(model)
        loss = sum(o.float().sum() for o in leaves(compiled(*inputs)) if o.is_floating_point())
        loss.backward()
        got = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        model.zero_grad()
        want_loss = sum(o.float().sum() for o in leaves(model(*inputs)) if o.is_floating_point())
        want_loss.backward()
        want = [p.grad for p in model.parameters()]
        bad = sum(1 for g, w in zip(got, want) if (g is None) != (w is None) or (
            g is not None and not torch.allclose(g, w, atol=1e-3, rtol=1e-3)))
        if bad or not torch.allclose(loss, want_loss, atol=1e-3, rtol=1e-3):
            return "MISMATCH", f"loss {loss.item():.5g} vs {want_loss.item():.5g}, {bad} gradients differ"
        return "OK", ""
    model.eval()
    tol = 1e-4
    if mode == "bf16":
        model = model.to(torch.bfloat16)
        inputs = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)
        tol = 3e-2
    compiled = fusec.compile(model)
    calls = [inputs] + ([tuple(t[:1] for t in inputs)] if mode == "batch" else [])
    with torch.no_grad():
        for call in calls:
            ok, why = close(leaves(model(*call)), leaves(compiled(*call)), tol)
            if not ok:
                return "MISMATCH", f"batch {call[0].shape[0]}: {why}"
    return "OK", ""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="eval,batch,train")
    p.add_argument("--only", default="", help="comma-separated name prefixes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args()
    models = {**hf_models(), **torchvision_models()}
    if args.only:
        models = {k: v for k, v in models.items() if k.startswith(tuple(args.only.split(",")))}
    rows = []
    for name, (build, kind) in models.items():
        for mode in args.modes.split(","):
            start = time.perf_counter()
            try:
                status, why = run_one(build, kind, mode, args.device)
            except Exception as e:  # noqa: BLE001 - a sweep: report and go on
                status, why = "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                tb = traceback.format_exc().splitlines()
                why += " | " + " / ".join(line.strip() for line in tb[-4:-1])[:300]
            seconds = time.perf_counter() - start
            rows.append(dict(model=name, mode=mode, status=status, detail=why, seconds=seconds))
            print(f"{name:28s} {mode:6s} {status:9s} {seconds:6.1f}s {why}", flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("OK", "MISMATCH", "ERROR")}
    print(f"\n{len(rows)} runs on {args.device}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
