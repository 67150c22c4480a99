"""Which attention kernel does transformers' BERT reach, eagerly, under
torch.compiler.is_compiling(), and in fusec's captured graph (with and without an attention
mask)? Prints the SDPA-related nodes and the CUDA kernels each run launches (docs/gpu.md,
2026-11-24). Needs a CUDA device:

    python benchmarks/diagnostics/bert_attention_choice.py
"""
import torch, transformers
import torch.nn.functional as F
from fusec.frontend import capture, compiling
torch.manual_seed(0)
m = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1)).cuda().to(torch.bfloat16).eval()
ids = torch.randint(0, 30522, (16, 512), device="cuda")
for mask in (None, torch.ones(16, 512, dtype=torch.long, device="cuda")):
    cap = capture(m, (ids,) if mask is None else (ids, mask))
    print("== mask given:", mask is not None)
    for n in cap.gm.graph.nodes:
        t = str(n.target)
        if "attention" in t or "bmm" in t or "where" in t:
            print(" ", t, [(tuple(a.meta["val"].shape), a.meta["val"].dtype, a.meta["val"].stride())
                          for a in n.args if hasattr(a, "meta") and "val" in a.meta])
# what the dispatcher picks for the same arguments, eager
q = torch.randn(16, 12, 512, 64, device="cuda", dtype=torch.bfloat16)
for name, am in [("none", None), ("bool 16x1x512x512", torch.ones(16, 1, 512, 512, dtype=torch.bool, device="cuda")),
                 ("bool expanded", torch.ones(16, 1, 1, 512, dtype=torch.bool, device="cuda").expand(16, 1, 512, 512)),
                 ("float 16x1x512x512", torch.zeros(16, 1, 512, 512, dtype=torch.bfloat16, device="cuda"))]:
    choice = torch._fused_sdp_choice(q, q, q, am)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        F.scaled_dot_product_attention(q, q, q, attn_mask=am); torch.cuda.synchronize()
    ks = sorted({e.name[:60] for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    print(name, "choice", choice, ks[:4])
with compiling():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        m(ids); torch.cuda.synchronize()
    print("eager under is_compiling:", sorted({e.name[:50] for e in p.events() if "fmha" in e.name or "flash" in e.name or "attention" in e.name.lower() or "gemm" in e.name.lower()})[:6])
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    m(ids); torch.cuda.synchronize()
print("eager:", sorted({e.name[:50] for e in p.events() if "fmha" in e.name or "flash" in e.name or "attention" in e.name.lower()})[:6])
