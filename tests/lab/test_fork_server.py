"""The engine fork server's choice of server per environment (its forks run in every engine test)."""

from __future__ import annotations

from lab import fork_server


def test_variables_read_at_import_pick_the_server_per_engine_ones_do_not():
    base = {"PATH": "/bin", "VLLM_PLUGINS": "jetson_tq", "OMP_NUM_THREADS": "2"}
    key = fork_server.import_key(base)
    # read when an engine starts: one server serves them all
    assert fork_server.import_key(dict(base, VLLM_PORT="20100", JETSON_TQ_CONFIG="k4v4", PATH="/usr/bin")) == key
    assert fork_server.import_key(dict(base, JETSON_TQ_CALIBRATION_DIR="/tmp/c")) == key
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "0|1")):
        assert fork_server.import_key(dict(base, **{name: value})) == key
    # read while libraries load (OpenMP, vLLM's logger, jetson_tq's config folder): a server of their own
    for name, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("VLLM_LOGGING_LEVEL", "DEBUG")):
        assert fork_server.import_key(dict(base, **{name: value})) != key
    assert fork_server.import_key(dict(base, JETSON_TQ_CONFIG_DIR="/x")) != key


def test_the_switch_overrides_the_default(monkeypatch):
    monkeypatch.setattr(fork_server, "fork_by_default", True)
    monkeypatch.delenv(fork_server.FORK_ENV, raising=False)
    assert fork_server.enabled()
    monkeypatch.setenv(fork_server.FORK_ENV, "0")
    assert not fork_server.enabled()
    monkeypatch.setattr(fork_server, "fork_by_default", False)
    monkeypatch.setenv(fork_server.FORK_ENV, "1")
    assert fork_server.enabled()
