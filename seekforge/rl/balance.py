"""Balanced assignment of prompt groups to data-parallel ranks (verl's `balance_batch`, greedy form).

A rank's training time grows with its sequence tokens, and every rank waits for the slowest at the
gradient reduction; a random split of a batch with long and short answers leaves ranks idle. Groups
(a prompt's G completions) move as units, so each group's advantages — computed over the whole group
before the split — travel with it. Greedy longest-processing-time: heaviest group first, onto the
lightest rank that still has room; every rank gets the same number of groups (±1), which keeps the
number of sequences, and so of collectives, nearly equal. LPT is within 4/3 of the optimal makespan.
"""

from __future__ import annotations

import heapq


def balance_groups(group_tokens: list[int], num_ranks: int) -> list[list[int]]:
    """group_tokens[g]: the tokens (prompt + completions) of group g → per rank, its group indices
    (ascending). Deterministic: ties go to the lower group index and the lower rank."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks}: need at least one rank")
    if len(group_tokens) < num_ranks:
        raise ValueError(f"{len(group_tokens)} prompt groups cannot cover {num_ranks} data-parallel ranks; use at "
                         f"least {num_ranks} prompts per step")
    base, extra = divmod(len(group_tokens), num_ranks)
    capacity = [base + (r < extra) for r in range(num_ranks)]
    heap = [(0, r) for r in range(num_ranks)]  # (tokens so far, rank); full ranks leave the heap
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for g in sorted(range(len(group_tokens)), key=lambda g: (-group_tokens[g], g)):
        load, r = heapq.heappop(heap)
        assignment[r].append(g)
        if len(assignment[r]) < capacity[r]:
            heapq.heappush(heap, (load + group_tokens[g], r))
    return [sorted(a) for a in assignment]


def imbalance(group_tokens: list[int], assignment: list[list[int]]) -> float:
    """max / mean tokens per rank (1.0 = perfect)."""
    loads = [sum(group_tokens[g] for g in groups) for groups in assignment]
    return max(loads) / (sum(loads) / len(loads))
