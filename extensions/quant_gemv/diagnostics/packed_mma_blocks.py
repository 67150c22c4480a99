"""Which blocks for the packed-words tensor-core kernel (triton_gemv_packed_mma.py)? A sweep.

    python extensions/quant_gemv/diagnostics/packed_mma_blocks.py --fmt gptq|awq [--m 16]
        [--grid all|joined] [--budget 400] [--out file.json]

GPTQ (words along K) or AWQ (along N), K = N = 8192, group 128, bf16, at one M: each variant of
`_Blocks` (columns per program, warps, num_stages, operand order, programs to aim for, chunk,
nibble pairs joined) is rendered by fusec (`_blocks` replaced for the compile), run once against
a float64 product (it must be at least as close as eager), then timed with do_bench (under a
file lock, so a GPTQ and an AWQ sweep can compile side by side and time one at a time). Then the
default and the best three again at M = 2, 4, 8. Needs a CUDA GPU. The results that chose
today's blocks: docs/performance.md, "GPTQ and AWQ words on tensor cores"."""
import argparse, fcntl, importlib, itertools, json, os, time
os.environ.setdefault("FUSEC_SAVED_PROGRAMS", "0")
import torch, triton, triton.testing
import fusec
from fusec.examples.awq_linear import AWQLinear
from fusec.examples.gptq_linear import GPTQLinear

pm = importlib.import_module("fusec.extensions.quant_gemv.triton_gemv_packed_mma")
sm = importlib.import_module("fusec.extensions.quant_gemv.small_matmul")
sm.SPLIT_COLUMNS_MAX_M = 16

p = argparse.ArgumentParser()
p.add_argument("--fmt", default="gptq"); p.add_argument("--m", type=int, default=16)
p.add_argument("--k", type=int, default=8192); p.add_argument("--n", type=int, default=8192)
p.add_argument("--budget", type=float, default=400); p.add_argument("--out", default=None)
p.add_argument("--quick", action="store_true"); p.add_argument("--grid", default="all")
a = p.parse_args()
t0 = time.time()
SMS = torch.cuda.get_device_properties(0).multi_processor_count
torch.manual_seed(0)
w = torch.randn(a.n, a.k, device="cuda", dtype=torch.bfloat16) / a.k ** 0.5
layer = (GPTQLinear if a.fmt == "gptq" else AWQLinear)(w.t().contiguous(), 128).cuda()
x = torch.randn(a.m, a.k, device="cuda", dtype=torch.bfloat16)
nbytes = sum(b.numel() * b.element_size() for b in layer.buffers() if b is not None)
with torch.no_grad():
    eager = layer(x)
    want = x.double() @ layer.dequantized().to(x.device).double()
e_err = (eager.double() - want).abs().max().item()

def blocks(block, warps, stages, right, target, chunk, joined=False):
    if a.fmt == "gptq":
        chunks = a.k // 8 // chunk
        progs = -(-a.n // block)
        split = max(1, min(chunks, -(-target // progs))); per = -(-chunks // split)
        return pm._Blocks(block, warps, -(-chunks // per), per, chunk, 8 * chunk,
                          f"triton.cdiv({a.n}, {block})", stages, right, joined)
    chunks = a.k // chunk
    progs = -(-(a.n // 8) // block)
    split = max(1, min(chunks, -(-target // progs))); per = -(-chunks // split)
    return pm._Blocks(8 * block, warps, -(-chunks // per), per, chunk, chunk,
                      f"triton.cdiv({a.n // 8}, {block})", stages, right, joined)

default = None
orig = pm._blocks
if a.grid == "joined" and a.fmt == "gptq":
    grid = [(128, 8, 1, False, 3 * SMS, 16), (64, 4, 1, False, 6 * SMS, 16)] + list(itertools.product([64, 128, 256], [4, 8], [1, 2], [True], [3 * SMS, 6 * SMS], [16], [True]))
elif a.grid == "joined":
    grid = [(32, 4, 2, True, 3 * SMS, 128), (64, 4, 1, False, 3 * SMS, 128)] + list(itertools.product([16, 32, 64], [4, 8], [1, 2], [True], [3 * SMS], [128], [True]))
elif a.fmt == "gptq":
    grid = itertools.product([64, 128, 256], [4, 8], [1, 2, 3, 4], [False, True], [3 * SMS, 6 * SMS], [16])
else:
    grid = itertools.product([16, 32, 64], [4, 8], [1, 2, 3], [False, True], [3 * SMS, 6 * SMS], [64, 128])
import random
grid = list(grid); random.Random(0).shuffle(grid)
variants = [("default", None)] + [(v, blocks(*v)) for v in grid]
if a.quick:
    variants = variants[:3]
rows = []
lock = open("/tmp/gpu_time.lock", "w")
print(torch.cuda.get_device_name(), "triton", triton.__version__, a.fmt, "M", a.m, "bytes", nbytes, flush=True)
for label, b in variants:
    if time.time() - t0 > a.budget:
        print("budget spent; stopping", flush=True); break
    pm._blocks = orig if b is None else (lambda pw, b=b: b)
    try:
        cf = fusec.compile(layer, backend="triton")
        with torch.no_grad():
            got = cf(x)
        src = [k.source for k in cf.kernels if "gemv" in k.name][0]
        if "packed_mma" not in src:
            print(label, "not the packed kernel", flush=True); continue
        err = (got.double() - want).abs().max().item()
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            ms = triton.testing.do_bench(lambda: cf(x), warmup=50, rep=200)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        ok = err <= e_err + 2 ** -8 * want.abs().max().item()
        rows.append(dict(v=str(label), ms=ms, tbs=nbytes / ms / 1e9, err=err, ok=ok))
        print(f"{str(label):50s} {ms:8.4f} ms {nbytes / ms / 1e9:6.3f} TB/s err {err:.3g} (eager {e_err:.3g}) {'ok' if ok else 'WRONG'}", flush=True)
    except Exception as e:
        print(label, "FAILED", type(e).__name__, str(e)[:300], flush=True)
    finally:
        pm._blocks = orig
rows.sort(key=lambda r: r["ms"])
print("best:", *[f"{r['v']} {r['tbs']:.3f} {r['ok']}" for r in rows[:6]], sep="\n  ", flush=True)
# phase 2: the default and the best three at the other row counts
top = [r["v"] for r in rows if r["ok"]][:3]
other = {}
for m in (2, 4, 8):
    if time.time() - t0 > a.budget + 120:
        break
    x = torch.randn(m, a.k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want_m = x.double() @ layer.dequantized().to(x.device).double()
        e_m = (layer(x).double() - want_m).abs().max().item()
    for v in ["default"] + top:
        b = None if v == "default" else blocks(*eval(v))
        pm._blocks = orig if b is None else (lambda pw, b=b: b)
        try:
            cf = fusec.compile(layer, backend="triton")
            with torch.no_grad():
                err = (cf(x).double() - want_m).abs().max().item()
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                ms = triton.testing.do_bench(lambda: cf(x), warmup=50, rep=200)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
            ok = err <= e_m + 2 ** -8 * want_m.abs().max().item()
            other[f"{m} {v}"] = ms
            print(f"M={m} {v:50s} {ms:8.4f} ms {nbytes / ms / 1e9:6.3f} TB/s {'ok' if ok else 'WRONG'}", flush=True)
        except Exception as e:
            print(f"M={m} {v} FAILED {type(e).__name__} {str(e)[:200]}", flush=True)
        finally:
            pm._blocks = orig
if a.out:
    json.dump(dict(rows=rows, other=other), open(a.out, "w"), indent=1)
