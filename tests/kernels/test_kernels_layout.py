"""Documents the paged layout the kernels read, as vLLM 0.26 builds it, at the reference level.

Tokens written through a shuffled block table and a -1-padded slot mapping (``kernel_cases``) are
exactly the tokens a ``CompressedKVCache`` holds when fed the same K/V in order: same fields, same
attention. If this breaks, the kernels' addressing contract changed.
"""

from __future__ import annotations

import torch

from jetson_tq import attention_decode
from jetson_tq.attention.reference import paged_attention_decode
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.format import KVFormat
from jetson_tq.paged import PagedKV, write_slots
from tests.helpers.kernel_cases import vllm_block_table, vllm_slot_mapping


def test_vllm_style_pages_equal_the_contiguous_cache():
    gen = torch.Generator().manual_seed(7)
    fmt = KVFormat(recent_tokens=0)
    lens, bs, h, d = [48, 16], 16, 2, 64
    cache = CompressedKVCache(fmt, h, d, len(lens), block_size=bs, dtype=torch.float32)
    table = vllm_block_table(lens, bs, pad_blocks=2, gen=gen)
    assert (table[0, 3:] == 0).all() and len(set(table[table > 0].tolist())) == 4  # shuffled ids, zero tail
    slots, who = vllm_slot_mapping(table, lens, bs)
    assert (slots[who[:, 0] < 0] == -1).all() and (slots == -1).any()
    k, v = torch.randn(slots.shape[0], h, d, generator=gen), torch.randn(slots.shape[0], h, d, generator=gen)
    pages = torch.zeros(int(table.max()) + 1, h, cache.layout.page_bytes, dtype=torch.uint8)
    write_slots(pages, cache.layout, slots, cache.codec.encode(k, v))
    for b in range(len(lens)):  # the same tokens, in order, into the contiguous cache
        rows = (who[:, 0] == b).nonzero().flatten()
        cache.append(k[rows].transpose(0, 1), v[rows].transpose(0, 1), seq=b)
    assert cache.compressed_lens.tolist() == lens
    kv = PagedKV(
        pages,
        table,
        torch.tensor(lens, dtype=torch.int32),
        cache.ring_k,
        cache.ring_v,
        torch.zeros(2, dtype=torch.int32),
        torch.arange(2, dtype=torch.int32),
        cache.layout,
        cache.codec,
    )
    paged, contiguous = kv.gather_compressed(48), cache.compressed_fields(48)
    for name in paged:
        for b, n in enumerate(lens):
            assert torch.equal(paged[name][b, :, :n], contiguous[name][b, :, :n]), name
    q = torch.randn(2, 4, d, generator=gen)
    assert torch.allclose(paged_attention_decode(q, kv), attention_decode(q, cache, backend="reference"), atol=1e-6)
