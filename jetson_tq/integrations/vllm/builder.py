"""The metadata builder vLLM runs on the host once per step and layer group: request -> ring row (``RecentSlots``),
rejected drafts' ring columns put back (``recent.Rewind``), the decode rows' device buffers (persistent, so CUDA
graphs capture them) and the ``TurboQuantMetadata`` every layer of the group reads.

Also what the builder tells vLLM about CUDA graphs (``get_cudagraph_support``) and about speculative decoding's
verification rows (``_spec_as_decode``: they take the decode path when uniform).
"""

from __future__ import annotations

from collections.abc import Container
from typing import cast

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata

from ... import ops
from ...errors import UnsupportedPlatformError
from .metadata import DecodeArrays, TurboQuantMetadata, decode_arrays
from .recent import Rewind
from .runtime import current_runner, is_ours, recent_slots
from .settings import reproducible, spec_query_tokens


class TurboQuantMetadataBuilder(AttentionMetadataBuilder[TurboQuantMetadata]):
    """Builds per-step metadata on the host; assigns each request its recent-buffer row."""

    reorder_batch_threshold: int | None = 1

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        device = torch.device(cast("torch.device | str", vllm_config.device_config.device))  # resolved by vLLM
        if reproducible():  # decode rows run the prefill kernel eagerly (vLLM keeps piecewise graphs around it)
            return AttentionCGSupport.NEVER
        if not ops.graph_safe(device):
            return AttentionCGSupport.NEVER
        if _spec_as_decode(vllm_config, kv_cache_spec):  # uniform verification rows take the decode path
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.recent_tokens = int(getattr(kv_cache_spec, "tq_recent_tokens", 0))
        self.block_window = bool(getattr(kv_cache_spec, "tq_block_window", False)) and self.recent_tokens > 0
        self.undo_tokens = spec_query_tokens(vllm_config) if self.recent_tokens > 0 else 0
        # verification rows of up to 1 + k tokens come first and, when uniform, take the decode path
        self.spec_tokens = spec_query_tokens(vllm_config) if _spec_as_decode(vllm_config, kv_cache_spec) else 0
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=self.spec_tokens > 0)
        sched = vllm_config.scheduler_config
        cap = max(sched.max_num_seqs, sched.max_num_batched_tokens) + 1
        self._tcols = torch.zeros(cap * max(1, self.spec_tokens), dtype=torch.int64, device=device)
        self._rows = torch.zeros(cap, dtype=torch.int64, device=device)
        self._cols = torch.zeros(cap, dtype=torch.int64, device=device)
        self._comp = torch.zeros(cap, dtype=torch.int32, device=device)
        self._rec = torch.zeros(cap, dtype=torch.int32, device=device)
        self._pos = torch.zeros(cap, dtype=torch.int64, device=device)
        self._slots = recent_slots(vllm_config)
        if self.recent_tokens > 0 and current_runner() is None:
            raise UnsupportedPlatformError(
                "jetson-tq's recent buffers need vLLM's GPUModelRunner (or CPUModelRunner); another model "
                "runner is in use (VLLM_USE_V2_MODEL_RUNNER?). Set buffer.recent_tokens: 0 or use the default runner."
            )

    def _request_ids(self, num_reqs: int) -> tuple[list[str | None], Container[str]]:
        runner = current_runner()
        if runner is None:
            return [None] * num_reqs, ()
        ids = list(runner.input_batch.req_ids)[: min(num_reqs, runner.input_batch.num_reqs)]
        return ids + [None] * (num_reqs - len(ids)), runner.requests

    def _rewind(self, rewinds: list[Rewind]) -> None:
        """Put back the ring columns of rejected draft tokens in every compressed layer this builder serves (before
        the step's forward reads or writes any ring; the same again from another builder changes nothing)."""
        rows, ring_cols, undo_cols = [], [], []
        for rw in rewinds:
            ring, undo = rw.columns(self.recent_tokens)
            rows += [rw.row] * len(ring)
            ring_cols += ring
            undo_cols += undo
        ctx = self.vllm_config.compilation_config.static_forward_context
        index = torch.tensor([rows, ring_cols, undo_cols], dtype=torch.int64)
        if self.device.type == "cuda":
            index = index.pin_memory()  # a pageable copy would make the host wait for the GPU's queue
        index = index.to(self.device, non_blocking=True)
        for name in self.layer_names:
            impl = getattr(ctx.get(name), "impl", None)
            if impl is not None and is_ours(impl):
                impl.rewind_ring(index[0], index[1], index[2])

    def _copy_decode_arrays(self, dec: DecodeArrays, tcols: torch.Tensor | None) -> None:
        """The step's decode values into their persistent device buffers: one pinned host block, one non-blocking
        copy, then device-side copies into each buffer (a copy from pageable memory makes the host wait for the
        GPU's whole queue, once per buffer, every step, which stalls the host's preparation of the next step)."""
        parts = [dec.ring_rows, dec.ring_cols, dec.compressed, dec.recent, dec.positions]
        bufs = [self._rows, self._cols, self._comp, self._rec, self._pos]
        if tcols is not None:
            parts.append(dec.token_cols)
            bufs.append(tcols)
        flat = [np.asarray(a, dtype=np.int64).reshape(-1) for a in parts]
        host = torch.from_numpy(np.concatenate(flat))
        if host.numel() == 0:
            return
        if self.device.type == "cuda":
            host = host.pin_memory()  # the caching host allocator keeps the block until the copy has run
        staged = host.to(self.device, non_blocking=True)
        for buf, part in zip(bufs, staged.split([a.size for a in flat])):
            buf.view(-1)[: part.numel()].copy_(part, non_blocking=True)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> TurboQuantMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1].to(torch.int64).numpy()
        q_lens = np.diff(qsl)
        host = getattr(cm, "seq_lens_cpu_upper_bound", None)  # exact without async speculative decoding (0.27)
        if host is None or getattr(current_runner(), "use_async_spec_decode", False):
            host = None  # optimistic there (every draft accepted): the device lengths are the exact ones
        if host is None:
            host = getattr(cm, "_seq_lens_cpu", None)
        if host is None:
            host = cm.seq_lens[:n].cpu()  # a host sync, outside any graph (builders run eagerly)
        seq = host[:n].to(torch.int64).numpy()
        ctx = seq - q_lens
        R = self.recent_tokens
        if R > 0:
            req_ids, live = self._request_ids(n)
            rows = self._slots.assign(req_ids, ctx, q_lens, live, R if self.block_window else 0, self.undo_tokens)
            if self._slots.rewinds:
                self._rewind(self._slots.rewinds)
        else:
            rows = np.full(n, self._slots.scratch, dtype=np.int64)
        dec = decode_arrays(q_lens, seq, rows, R, self.block_window, self.spec_tokens)
        nd, t = dec.rows, dec.tokens
        tcols = self._tcols[: nd * t].view(nd, t) if t > 1 else None
        self._copy_decode_arrays(dec, tcols)
        return TurboQuantMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=n,
            num_decodes=nd,
            recent_tokens=R,
            block_window=self.block_window,
            query_start_loc=qsl,
            seq_lens=seq,
            context_lens=ctx,
            ring_rows=rows,
            block_table=cm.block_table_tensor[:n],
            slot_mapping=cm.slot_mapping,
            dec_ring_rows=self._rows[:nd],
            dec_ring_cols=self._cols[:nd],
            dec_compressed_lens=self._comp[:nd],
            dec_recent_lens=self._rec[:nd],
            dec_positions=self._pos,
            dec_query_tokens=t,
            dec_token_cols=tcols,
        )


def _spec_as_decode(vllm_config: VllmConfig, kv_cache_spec) -> bool:
    """True when speculative decoding is on and this group's verification rows can take the decode path (the
    multi-token decode serves every key mode but klt; the reproducible mode runs every row as a chunk)."""
    fmt = dict(getattr(kv_cache_spec, "tq_format", ()) or ())
    return spec_query_tokens(vllm_config) > 1 and fmt.get("key_mode") != "klt" and not reproducible()
