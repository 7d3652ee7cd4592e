"""`pdserve up`'s plan, built as data (nothing started) from its parser's defaults the way
`run_up` builds it: every gRPC service gets mutual TLS (`--tls-dir`), the KV store its store
secret and the engines and the router the block secret, and no command line holds a Redis URL
or password (they travel as `@FILE`)."""

from urllib.parse import urlsplit

import pytest

from pdserve.services.common.redis_auth import URL_FILE
from pdserve.services.common.tls_args import RunSecrets
from pdserve.services.launch_plans import plan_stack
from pdserve.tests.integration.secure_stack import flag, up_args


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_every_step_gets_tls_and_secrets_and_no_redis_secret_in_argv(tmp_path, mode):
    args = up_args("--mode", mode, "--model", "tiny", "--num-blocks", "64")
    assert not args.insecure and not args.tls_dir and args.discovery == "registry"
    run = RunSecrets(args.insecure, args.tls_dir)  # as run_up does
    try:
        plan = plan_stack(args, tmp_path, run.tls_dir, run.dir)
        with open(f"{run.dir}/redis/{URL_FILE}") as f:
            password = urlsplit(f.read().strip()).password
        assert run.tls_dir and len(password) >= 16
        names = [s.child.name for s in plan.steps]
        expected = ["redis"] + (["kvstore", "prefill0", "decode0"] if mode == "disagg"
                                else ["unified0"]) + ["router"]
        assert names == expected
        for step in plan.steps:
            argv, name = step.child.argv, step.child.name
            words = " ".join(argv)
            assert "redis://" not in words and password not in words, name
            if name == "redis":
                server = next(i for i, w in enumerate(argv) if w.endswith("redis-server"))
                assert "--requirepass" not in argv and argv[server + 1].endswith("redis.conf")
                continue
            assert flag(step.child, "--tls-dir") == run.tls_dir, name
            for url_flag in ("--redis-url", "--registry"):
                if url_flag in argv:
                    assert flag(step.child, url_flag).startswith("@"), name
            if name == "kvstore":
                assert flag(step.child, "--store-secret-file").startswith(run.dir)
            elif mode == "disagg":
                assert flag(step.child, "--kv-block-secret-file").startswith(run.dir), name
        if mode == "colocated":
            assert all("--registry" in s.child.argv for s in plan.steps[1:])
    finally:
        run.close()


@pytest.mark.parametrize("given,passed", [((), None), (("--kv-per-rank",), "--kv-per-rank"),
                                          (("--no-kv-per-rank",), "--no-kv-per-rank")])
def test_the_per_rank_mode_reaches_every_engine_only_when_given(tmp_path, given, passed):
    """Every engine sharing a store must use one mode: `up` passes the flag to all of them,
    and when not given none gets it (each engine's config default applies)."""
    args = up_args("--mode", "disagg", "--model", "tiny", "--num-blocks", "64", *given)
    run = RunSecrets(args.insecure, args.tls_dir)
    try:
        plan = plan_stack(args, tmp_path, run.tls_dir, run.dir)
        engines = [s.child.argv for s in plan.steps if s.child.name in ("prefill0", "decode0")]
        assert len(engines) == 2
        for argv in engines:
            got = [w for w in argv if w.endswith("kv-per-rank")]
            assert got == ([] if passed is None else [passed])
    finally:
        run.close()
