"""Exit codes shared by ``python -m jetson_tq`` and ``run_jetson.sh`` (tests check both agree)."""

OK = 0
FAILED = 1  # a check failed (e.g. a demo verdict FAIL) or an unexpected error
USAGE = 2  # bad arguments, unknown mode, bad config/model name (argparse also uses 2)
UNSUPPORTED_PLATFORM = 3  # e.g. vllm on Orin with JetPack 6, an unknown Jetson, a model layer nothing can serve
NO_CONTAINER_RUNTIME = 4  # --container asked for but no working docker (launcher only)
MISSING_COMPONENT = 5  # an optional part is not in this build (vLLM integration, kernels)
