import sys, time, cProfile, pstats, io
import torch, torchvision
import fusec
from fusec.capture.fingerprint import fingerprint
name = sys.argv[1]
torch.manual_seed(0)
model = getattr(torchvision.models, name)().eval().to("cuda", torch.bfloat16)
x = torch.randn(32, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
before = set(sys.modules)
pr = cProfile.Profile(); pr.enable()
t = time.perf_counter(); k1 = fingerprint(model, (x,), {}, "triton"); t1 = time.perf_counter() - t
pr.disable()
new = sorted(m for m in set(sys.modules) - before)
print(f"{name}: first {t1:.3f} s; {len(new)} modules imported:", " ".join(new)[:1500])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue()[:9000])
