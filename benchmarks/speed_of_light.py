"""The speed of light of a memory-bound kernel of a given size: a kernel that only reads.

A GEMV at decode sizes reads a few tens of MB in a few tens of microseconds. At that size the
memory's peak is not the ceiling: launching, the first bytes' latency and the write-back of the
dirty lines that do_bench's L2 flush leaves behind cost a few microseconds whatever the kernel
does (on an H200, reading 34 MB takes 0.0146 ms, 67 MB 0.0220 and 134 MB 0.0379: about 6 us
fixed and 4.2 TB/s after it). So benchmarks/quant_linear.py measures each layer against a
kernel that reads the same number of bytes and does nothing else, timed the same way:
`read_floor_ms` (docs/performance.md has the current table).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusec.timing import median_ms


@triton.jit
def read_only(p_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # read the buffer's 32-bit words once, as fast as they come: each program reads STEPS blocks
    # of BLOCK words and keeps their sum, so that the loads are not dropped
    pid = tl.program_id(axis=0)
    wp = p_ptr.to(tl.pointer_type(tl.int32))
    offs = pid * BLOCK * STEPS + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(STEPS):
        acc += tl.load(wp + offs + i * BLOCK, mask=offs + i * BLOCK < n_words, other=0,
                       eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_ms(buffer: torch.Tensor, block: int = 4096, steps: int = 1, warps: int = 8) -> float:
    """do_bench's median for reading `buffer` (its bytes as 32-bit words) once."""
    words = buffer.numel() * buffer.element_size() // 4
    sink = torch.empty(triton.cdiv(words, block * steps), dtype=torch.int32, device=buffer.device)
    return median_ms(lambda: read_only[(sink.numel(),)](buffer, sink, words, block, steps,
                                                         num_warps=warps), device="cuda")


def read_row_ms(buffers: list[torch.Tensor], block: int = 4096, warps: int = 8) -> float:
    """do_bench's median for reading `buffers` one after another, one kernel each (the floor
    under layers run in a row, benchmarks/quant_linear.py --in-a-row). The reads are replayed
    as one CUDA graph, so that no launch waits for the CPU."""
    launches = []
    for b in buffers:
        words = b.numel() * b.element_size() // 4
        sink = torch.empty(triton.cdiv(words, block), dtype=torch.int32, device=b.device)
        launches.append((sink.numel(), b, sink, words))

    def read_all():
        for grid, b, sink, words in launches:
            read_only[(grid,)](b, sink, words, block, 1, num_warps=warps)
    read_all()  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        read_all()
    return median_ms(graph.replay, device="cuda")


def read_floor_ms(nbytes: int, device: str = "cuda") -> float:
    """The time a kernel that only reads `nbytes` takes on `device` (a CUDA device)."""
    return read_ms(torch.empty(max(nbytes // 4, 1), dtype=torch.int32, device=device))
