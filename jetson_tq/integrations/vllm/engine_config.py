"""What the plugin changes in vLLM's engine config, each change logged: prefix caching off unless every ring is a
block window that vLLM's prefix-cache hits can only start at (``prefix_caching_blocker``), and async scheduling off
with speculative decoding (it hands the attention metadata optimistic host lengths: every draft accepted).

The attention backend vLLM (or the user) chose stays: it serves the layers kept on stock attention; compressed
layers get ours from the ``Attention.__init__`` hook.
"""

from __future__ import annotations

from .settings import active_config, compresses, logger, preferred_block_size, sliding_windows, window_block


def adjust_engine_config(config) -> None:
    """Switch off (in place, logged) what the compressed layers' fp16 rings cannot serve under the active config."""
    log = logger()
    from vllm.platforms import current_platform

    why = prefix_caching_blocker(active_config(), config.cache_config, current_platform.is_cpu())
    if config.cache_config.enable_prefix_caching and why:
        log.info("jetson-tq: prefix caching switched off: %s", why)
        config.cache_config.enable_prefix_caching = False
    if (
        config.speculative_config is not None
        and config.scheduler_config.async_scheduling
        and compresses(active_config())
    ):
        log.info(
            "jetson-tq: async scheduling switched off: with speculative decoding it gives the attention "
            "metadata optimistic host lengths (every draft accepted), and the recent buffers need the exact ones"
        )
        config.scheduler_config.async_scheduling = False


def prefix_caching_blocker(cfg, cache_config, is_cpu: bool) -> str | None:
    """Why prefix caching must be off under ``cfg`` (None when hits are safe): a hit starts a request at a block
    boundary with nothing in its fp16 ring, which only a block window restarting at that boundary expects."""
    if sliding_windows(cfg):
        return (
            "a sliding window (buffer.window: sliding) reads the last recent_tokens exactly, and a prefix-cache "
            "hit would start attention without the cached tokens' exact copies (buffer.window: block allows hits)"
        )
    from vllm.config.cache import CacheConfig

    w = window_block(cfg)
    # the block size is final here on CPU or when the user set it; else the backend will ask for a multiple of w
    final = is_cpu or cache_config.user_specified_block_size
    size = cache_config.block_size if final else preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE, cfg)
    if size and size % w:
        return (
            f"block windows restart every {w} tokens but vLLM's block size is {size} (a hit may start inside a "
            f"window); set --block-size to a multiple of {w}"
        )
    unit = getattr(cache_config, "prefix_match_unit", None)  # vLLM 0.27: hits at finer boundaries than a block
    if unit and unit % w:
        return f"block windows restart every {w} tokens but prefix_match_unit is {unit}; set it to a multiple of {w}"
    return None
