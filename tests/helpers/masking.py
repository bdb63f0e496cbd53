"""Inputs for the sliding-window kernel tests: a paged view whose freed blocks would poison any read."""

from __future__ import annotations

import dataclasses

import torch


def poison_freed(kv, first_read: list[int]):
    """``kv`` with every block wholly before ``first_read[b]`` pointed at one block of 0xFF bytes (fp16 NaN), as
    vLLM's sliding-window manager points freed blocks at its null block: a kernel that read one returns NaN."""
    bs = kv.layout.block_size
    pages = torch.cat([kv.pages, torch.full_like(kv.pages[:1], 0xFF)])
    table = kv.block_table.clone()
    for b, p in enumerate(first_read):
        table[b, : max(p, 0) // bs] = pages.shape[0] - 1
    return dataclasses.replace(kv, pages=pages, block_table=table)
