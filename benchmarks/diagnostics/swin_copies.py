"""Where torchvision swin_t's device-to-device copies come from under fusec (bf16, batch 32)."""
import os
import sys

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile

import fusec
from fusec.timing import median_ms

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
torch.manual_seed(0)
model = torchvision.models.swin_t().cuda().to(torch.bfloat16).eval()
x = torch.randn(32, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
for graphs in ("auto", False):
    cm = fusec.compile(model, cuda_graphs=graphs)
    with torch.no_grad():
        cm(x)
        print(f"cuda_graphs={graphs}: {median_ms(cm, x, device='cuda'):.3f} ms", flush=True)
with torch.no_grad():
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        cm(x)
        torch.cuda.synchronize()
print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=25,
                                                         max_name_column_width=60, max_shapes_column_width=80))
with open(os.path.join(out, "swin_schedule.txt"), "w") as f:
    f.write(cm.schedule)
print("breaks:", cm.breaks is not None if hasattr(cm, "breaks") else "?")
