"""Why a channels-last global sum streams slower in fusec than in Inductor: hand-written variants.

    python benchmarks/diagnostics/column_sum_variants.py [--shape 32,64,128,128]

The first stage of a split column reduction (passes/split_reductions.py, the column note in
codegen/triton_reduction.py) sums, for each image n, chunk s and channel c, the elements of one
chunk of the image's H*W positions. fusec's kernel puts the channels (contiguous in memory) on
axis 0 of a [XBLOCK, RBLOCK] tile and masks every load. This times that kernel's shape against
variants, side by side on one GPU, in GB/s of the activation read:

* chunks S per image (programs = N * S * C / XBLOCK),
* the tile XBLOCK x RBLOCK and num_warps,
* `rows`: channels on axis 0 (fusec today) or `cols`: channels on axis 1, the contiguous axis
  last, as in Triton's tutorials,
* `mask`: masked loads and a `where` in the loop (fusec today) or none (sizes divide evenly).

and prints torch.compile's and eager's time for the whole mean next to them.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def chunk_sums(x_ptr, out_ptr, C: tl.constexpr, HW: tl.constexpr, S: tl.constexpr,
               XBLOCK: tl.constexpr, RBLOCK: tl.constexpr, COLS: tl.constexpr, MASK: tl.constexpr,
               REVERSE: tl.constexpr = False):
    pid = tl.program_id(0)
    if REVERSE:  # the last programs' data first: what a producer wrote last may still be in L2
        pid = tl.num_programs(0) - 1 - pid
    cblocks: tl.constexpr = C // XBLOCK
    cb = pid % cblocks
    chunk = (pid // cblocks) % S
    n = pid // (cblocks * S)
    K: tl.constexpr = HW // S
    base = x_ptr + n * HW * C + chunk * K * C
    if COLS:  # tile [RBLOCK, XBLOCK]: positions down, channels across (contiguous last)
        c = cb * XBLOCK + tl.arange(0, XBLOCK)[None, :]
        acc = tl.zeros([RBLOCK, XBLOCK], tl.float32)
        for k0 in range(0, K, RBLOCK):
            ks = k0 + tl.arange(0, RBLOCK)[:, None]
            if MASK:
                m = (c < C) & (ks < K)
                v = tl.load(base + c + ks * C, mask=m)
                acc = tl.where(m, acc + v, acc)
            else:
                acc += tl.load(base + c + ks * C)
        s = tl.sum(acc, 0)
        cc = cb * XBLOCK + tl.arange(0, XBLOCK)
    else:  # tile [XBLOCK, RBLOCK]: channels down (fusec's kernel)
        c = cb * XBLOCK + tl.arange(0, XBLOCK)[:, None]
        acc = tl.zeros([XBLOCK, RBLOCK], tl.float32)
        for k0 in range(0, K, RBLOCK):
            ks = k0 + tl.arange(0, RBLOCK)[None, :]
            if MASK:
                m = (c < C) & (ks < K)
                v = tl.load(base + c + ks * C, mask=m)
                acc = tl.where(m, acc + v, acc)
            else:
                acc += tl.load(base + c + ks * C)
        s = tl.sum(acc, 1)
        cc = cb * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(out_ptr + (n * S + chunk) * C + cc, s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="32,64,128,128")
    p.add_argument("--producer", action="store_true",
                   help="only time each variant right after a copy wrote its input (warm L2 tail)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("column_sum_variants.py times Triton kernels on a GPU: it needs one")
    n, c, h, w = (int(v) for v in args.shape.split(","))
    x = torch.randn(n, c, h, w, device="cuda").to(memory_format=torch.channels_last)
    want = x.sum(dim=(2, 3))
    gbytes = x.numel() * 4 / 1e9

    def gbs(ms):
        return gbytes / (ms / 1e3)

    def mean(t):
        return t.mean(dim=(2, 3))
    tc = torch.compile(mean)
    tc(x)
    for name, fn in [("eager mean", mean), ("torch.compile mean", tc)]:
        ms = do_bench(lambda: fn(x), return_mode="median")
        print(f"{name:40s} {ms * 1e3:8.1f} us  {gbs(ms):7.0f} GB/s", flush=True)
    if args.producer:
        after_a_producer(x, tc, gbs)
        return
    rows = []
    for chunks, (xb, rb), warps, cols in itertools.product(
            (16, 32, 64, 128), ((64, 64), (64, 32), (64, 16), (64, 8), (32, 32), (32, 64)),
            (4, 8), (False, True)):
        for mask in (True, False) if (xb, rb, warps) == (64, 64, 4) else (True,):
            if (h * w) % chunks or (h * w // chunks) % rb:
                continue
            out = torch.empty(n, chunks, c, device="cuda")
            grid = (n * chunks * (c // xb),)

            def run():
                chunk_sums[grid](x, out, c, h * w, chunks, xb, rb, cols, mask, num_warps=warps)
            run()
            torch.testing.assert_close(out.sum(1), want, rtol=1e-4, atol=1e-2)
            ms = do_bench(run, return_mode="median")
            label = f"S={chunks} {xb}x{rb} w{warps} {'cols' if cols else 'rows'} {'mask' if mask else 'nomask'}"
            rows.append((ms, label))
            print(f"{label:40s} {ms * 1e3:8.1f} us  {gbs(ms):7.0f} GB/s", flush=True)
    print("\nfastest ten:")
    for ms, label in sorted(rows)[:10]:
        print(f"{label:40s} {ms * 1e3:8.1f} us  {gbs(ms):7.0f} GB/s")
    base = [ms for ms, label in rows if label == "S=32 64x64 w4 rows mask"]
    if base:
        print(f"fusec's shape today (S=32 64x64 w4 rows mask): {base[0] * 1e3:.1f} us")


def after_a_producer(x, tc, gbs) -> None:
    """Each variant timed right after a copy kernel writes its input, as a convolution writes the
    activation a global pool then reads: the copy's own time is subtracted. The L2 (50 MB on an
    H100) still holds the end of what the copy wrote; a kernel whose first programs read that
    end finds it there."""
    n, c, h, w = x.shape
    buf = torch.empty_like(x)
    copy_ms = do_bench(lambda: buf.copy_(x), return_mode="median")
    print(f"after a copy of the input ({copy_ms * 1e3:.1f} us, subtracted):")
    print(f"{'torch.compile mean':40s} {(do_bench(lambda: (buf.copy_(x), tc(buf)), return_mode='median') - copy_ms) * 1e3:8.1f} us")
    for chunks, xb, rb, warps, reverse in [(32, 64, 64, 4, False), (32, 64, 64, 4, True),
                                           (16, 64, 64, 4, True), (64, 64, 64, 4, True),
                                           (32, 64, 32, 4, True), (32, 64, 8, 8, True)]:
        out = torch.empty(n, chunks, c, device="cuda")
        grid = (n * chunks * (c // xb),)

        def run():
            buf.copy_(x)
            chunk_sums[grid](buf, out, c, h * w, chunks, xb, rb, False, True, reverse,
                             num_warps=warps)
        run()
        torch.testing.assert_close(out.sum(1), x.sum(dim=(2, 3)), rtol=1e-4, atol=1e-2)
        ms = do_bench(run, return_mode="median") - copy_ms
        label = f"S={chunks} {xb}x{rb} w{warps} {'reversed' if reverse else 'in order'}"
        print(f"{label:40s} {ms * 1e3:8.1f} us  {gbs(ms):7.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
