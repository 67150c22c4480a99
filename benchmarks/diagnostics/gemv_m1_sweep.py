"""The M = 1 GEMV's blocks and pipelining depth, int8 and packed int4, K = N = 8192, on a GPU.

    python benchmarks/diagnostics/gemv_m1_sweep.py

Each row forces one (BLOCK_N, BLOCK_K, num_warps, num_stages) on extensions/quant_gemv/triton_gemv.py's lane
version (gemv_blocks, GEMV_STAGES) and prints the median time and weight bytes per second; the
findings are in docs/gpu.md.
"""
import torch, fusec, importlib
import fusec.extensions.quant_gemv.triton_gemv as tr
from fusec.examples.int8_linear import Int8Linear
from fusec.examples.int4_linear import Int4Linear
from fusec.timing import median_ms
torch.manual_seed(0)
k = n = 8192
w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
layers = {"int8": Int8Linear(w).cuda(), "int4": Int4Linear(w, 128).cuda()}
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
for fmt, layer in layers.items():
    nb = sum(b.numel() * b.element_size() for b in layer.buffers())
    for bn, bk, warps, stages in [(8,512,4,1),(8,512,4,2),(8,512,4,3),(8,512,4,4),(8,1024,4,2),(8,1024,4,4),(4,1024,4,4),(8,256,4,3),(8,256,4,5),(16,256,4,3),(8,512,8,3),(4,512,4,3),(4,512,2,3),(8,512,2,3)]:
        if fmt == "int4" and bk > 512: continue
        tr.gemv_blocks = lambda mm, nn, kk, weight_bytes=1, c=(1, bn, bk, warps): c
        tr.GEMV_STAGES = stages
        cf = fusec.compile(layer)
        with torch.no_grad():
            cf(x); ms = median_ms(cf, x, device="cuda")
        print(f"{fmt} BN={bn} BK={bk} w={warps} s={stages}: {ms:.4f} ms {nb/ms/1e9:.3f} TB/s", flush=True)
