"""Weights on 2 MiB pages (Linux transparent huge pages), for decoding on a CPU.

A decode step reads every active weight once, and on 4 KiB pages the `small` model's 37 MB a token span
~9,000 pages: far more than the CPU's second-level TLB holds (~2,000 entries, 8 MiB), so each page of a weight
costs a page-table walk, and the hardware prefetchers stop at every page's edge. On 2 MiB pages the same bytes
are ~20 pages. On the serving benchmark's `small` model (bf16, 1 thread, an AVX512 EPYC) batch-1 decode was
faster in every A/B run (git log -p BENCHMARKS.md has them).

`collapse` asks the kernel to move memory that already holds tensors onto huge pages where it lies
(`madvise(MADV_COLLAPSE)`, Linux 6.1+): the same addresses and values, so tensors shared with others (GRPO's
co-located engine holds the trainer's own parameters) stay what they were. Only 2 MiB ranges the tensors fill
at least half of are moved: a range also holds other memory, which then becomes resident too. Elsewhere (other
systems, older kernels, huge pages disabled) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # linux/mman.h


def _madvise():
    """libc's madvise, or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def huge_page_ranges(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The 2 MiB-aligned ranges (as start addresses) that the CPU tensors' storages fill at least half of."""
    filled: dict[int, int] = {}
    seen = set()
    for t in tensors:
        if type(t.data) is not torch.Tensor or t.device.type != "cpu":
            continue  # DTensors and other subclasses own their memory elsewhere (a Parameter's data is a Tensor)
        storage = t.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or start in seen:
            continue
        seen.add(start)
        end = start + size
        for page in range(start // HUGE_PAGE * HUGE_PAGE, end, HUGE_PAGE):
            filled[page] = filled.get(page, 0) + min(end, page + HUGE_PAGE) - max(start, page)
    return sorted(page for page, size in filled.items() if 2 * size >= HUGE_PAGE)


def collapse(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """Move the memory under `tensors` onto 2 MiB pages in place where the system can (see the module doc)
    → (bytes now on huge pages, bytes tried)."""
    pages = huge_page_ranges(tensors)
    madvise = _madvise()
    if madvise is None:
        return 0, len(pages) * HUGE_PAGE
    # a range that fails (an older kernel, huge pages off, a file's pages, no free 2 MiB block) stays as it was
    done = sum(HUGE_PAGE for page in pages if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0)
    return done, len(pages) * HUGE_PAGE
