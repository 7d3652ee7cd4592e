"""Router workers' settings: each worker's share of the limits, the words a worker runs with,
the flags (`serve router --workers`, `up --router-workers`) and their checks
(services/router/workers.py; the processes themselves: tests/integration/test_router_workers.py)."""

import socket

import pytest

from pdserve.cli import build_parser
from pdserve.services.launch_plans import plan_stack
from pdserve.services.router.admission.admission_config import AdmissionConfig
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.limits_config import LimitsConfig
from pdserve.services.router.workers import per_worker, reuseport_socket, worker_argv


def test_one_worker_keeps_the_config_as_is():
    cfg = RouterConfig(admission=AdmissionConfig(rate_limit_rps=3.0))
    assert per_worker(cfg) is cfg


def test_each_of_n_workers_gets_a_share_of_every_limit():
    cfg = RouterConfig(workers=3, worker_index=1, admission=AdmissionConfig(
        max_prefilling=64, max_queued=10, max_queued_tokens=1000, rate_limit_rps=3.0,
        rate_limit_burst=2.0, rate_limit_tokens_per_s=900.0),
        limits=LimitsConfig(http_max_concurrency=100, grpc_max_concurrent_rpcs=7))
    w = per_worker(cfg)
    a, lim = w.admission, w.limits
    assert (a.max_prefilling, a.max_queued, a.max_queued_tokens) == (22, 4, 334)  # rounded up
    assert a.rate_limit_rps == 1.0 and a.rate_limit_tokens_per_s == 300.0
    assert a.rate_limit_burst == 1.0  # 2/3 of a request: a worker can still take one
    assert (lim.http_max_concurrency, lim.grpc_max_concurrent_rpcs) == (34, 3)
    # what is not a limit stays
    assert (w.workers, w.worker_index, a.queue_timeout_s, lim.max_body_bytes) == \
        (3, 1, cfg.admission.queue_timeout_s, cfg.limits.max_body_bytes)


def test_off_limits_stay_off_and_zero_queue_stays_zero():
    w = per_worker(RouterConfig(workers=4, admission=AdmissionConfig(max_queued=0)))
    assert w.admission.rate_limit_rps == 0.0 and w.admission.rate_limit_burst == 0.0
    assert w.admission.rate_limit_tokens_per_s == 0.0 and w.admission.max_queued == 0


@pytest.mark.parametrize("kw", [{"workers": 0}, {"workers": 65},
                                {"workers": 2, "worker_index": 2},
                                {"workers": 2, "worker_index": -2}])
def test_bad_worker_settings_are_refused(kw):
    with pytest.raises(ValueError, match="worker"):
        RouterConfig(**kw)


def test_a_worker_runs_the_supervisors_words_with_ports_and_index_last():
    words = ["serve", "router", "--port", "0", "--workers", "2"]
    assert worker_argv(words, 1, 8123, 9000) == words + [
        "--port", "8123", "--grpc-port", "9000", "--worker-index", "1"]
    args = build_parser().parse_args(worker_argv(words, 1, 8123, 9000))
    assert (args.port, args.grpc_port, args.workers, args.worker_index) == (8123, 9000, 2, 1)


def test_reuseport_sockets_share_a_port():
    a = reuseport_socket("127.0.0.1", 0)
    try:
        b = reuseport_socket("127.0.0.1", a.getsockname()[1])
        b.close()
    finally:
        a.close()
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    try:  # a socket without SO_REUSEPORT on the port: a worker cannot join it
        with pytest.raises(OSError):
            reuseport_socket("127.0.0.1", plain.getsockname()[1])
    finally:
        plain.close()


def _router_words(plan):
    return next(s.child.argv for s in plan.steps if s.child.name == "router")


def test_up_passes_router_workers_and_one_costs_no_flag(tmp_path):
    base = ["up", "--model", "tiny", "--mode", "colocated", "--discovery", "static"]
    one = _router_words(plan_stack(build_parser().parse_args(base), tmp_path, ""))
    assert "--workers" not in one
    plan = plan_stack(build_parser().parse_args(base + ["--router-workers", "3"]), tmp_path, "")
    words = _router_words(plan)
    assert words[words.index("--workers") + 1] == "3"
    assert "3 workers" in plan.layout
