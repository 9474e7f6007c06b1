"""model/pages.py: weights moved onto 2 MiB pages in place."""

import torch

from seekforge.model import pages
from seekforge.model.pages import HUGE_PAGE


def test_ranges_are_the_huge_pages_a_storage_fills_at_least_half_of():
    big = torch.ones(5 * HUGE_PAGE, dtype=torch.uint8)
    start, end = big.data_ptr(), big.data_ptr() + big.nbytes
    expected = [p for p in range(start // HUGE_PAGE * HUGE_PAGE, end, HUGE_PAGE)
                if 2 * (min(end, p + HUGE_PAGE) - max(start, p)) >= HUGE_PAGE]
    # a view of the same storage counts once; small, meta and empty tensors add nothing of their own
    others = [big[HUGE_PAGE:], torch.ones(1000, dtype=torch.uint8), torch.empty(8, device="meta"), torch.empty(0)]
    assert pages.huge_page_ranges([big, *others]) == expected
    assert len(expected) in (5, 6)
    assert pages.huge_page_ranges([torch.ones(1000)]) == []
    assert pages.huge_page_ranges([torch.nn.Parameter(big, requires_grad=False)]) == expected


def test_collapse_keeps_addresses_and_values():
    weights = torch.randn(3 * HUGE_PAGE // 4)  # 6 MiB
    before, address = weights.clone(), weights.data_ptr()
    done, tried = pages.collapse([weights, weights.t()])
    assert tried == len(pages.huge_page_ranges([weights])) * HUGE_PAGE and 0 <= done <= tried
    assert weights.data_ptr() == address
    assert torch.equal(weights, before)
