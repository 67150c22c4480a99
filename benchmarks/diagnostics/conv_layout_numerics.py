"""Does a convolution's memory layout change its numerics on this GPU? NaN propagation and
error against float64 of 2-D and 3-D (transposed) convolutions in NCHW vs channels-last, with
cuDNN's TF32 on and off (docs/gpu.md, 2026-11-24). Needs a CUDA device:

    python benchmarks/diagnostics/conv_layout_numerics.py
"""
import torch, torch.nn.functional as F
torch.manual_seed(0)
d = "cuda"
x = torch.randn(3, 5, 9, 11, device=d); w = torch.randn(7, 5, 3, 3, device=d) * 0.3; b = torch.randn(7, device=d)
x[1, 2, 3, 4] = float("nan")
for tf32 in (True, False):
    torch.backends.cudnn.allow_tf32 = tf32
    a = F.conv2d(x, w, b, padding=1)
    c = F.conv2d(x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last), b, padding=1)
    print("tf32", tf32, "nan nchw", a.isnan().sum().item(), "nhwc", c.isnan().sum().item())
    x3 = torch.randn(2, 3, 3, 4, 5, device=d); w3 = torch.randn(3, 2, 2, 2, 2, device=d)
    ref = F.conv_transpose3d(x3.double(), w3.double(), stride=2)
    e = F.conv_transpose3d(x3, w3, stride=2)
    f = F.conv_transpose3d(x3.to(memory_format=torch.channels_last_3d), w3.to(memory_format=torch.channels_last_3d), stride=2)
    print("  convT3d err nchw", (e - ref).abs().max().item(), "nhwc", (f - ref).abs().max().item())
    x2 = torch.randn(3, 6, 5, 7, device=d); w2 = torch.randn(6, 4, 3, 3, device=d) * 0.3
    ref = F.conv_transpose2d(x2.double(), w2.double(), stride=2, padding=1, output_padding=1)
    e = F.conv_transpose2d(x2, w2, stride=2, padding=1, output_padding=1)
    f = F.conv_transpose2d(x2.to(memory_format=torch.channels_last), w2.to(memory_format=torch.channels_last), stride=2, padding=1, output_padding=1)
    print("  convT2d err nchw", (e - ref).abs().max().item(), "nhwc", (f - ref).abs().max().item())
