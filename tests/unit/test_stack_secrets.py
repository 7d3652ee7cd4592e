"""Secrets reach services through files, never argv: `--flag @FILE`, the Redis password pair
(redis.conf + the store's URL), `pdserve certs --keep-existing/--redis-url`, and `pdserve up`'s
private secrets folder."""

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from pdserve.services.common.redis_auth import make_redis_auth, url_with_password


def parse(argv):
    from pdserve.cli import build_parser

    return build_parser().parse_args(argv)


def test_flag_values_come_from_files(tmp_path):
    url = tmp_path / "url"
    url.write_text("redis://:s3cret@redis:6379/0")  # as a Secret volume holds it: no newline
    args = parse(["serve", "kvstore-master", "--redis-url", f"@{url}"])
    assert args.redis_url == "redis://:s3cret@redis:6379/0"
    from pdserve.services.cli_serve import main  # the launcher's children parse alike

    with pytest.raises(SystemExit):  # a missing file is a usage error, not an empty value
        main(["serve", "kvstore-master", "--redis-url", f"@{tmp_path / 'missing'}"])


def test_redis_auth_files_are_private_and_kept(tmp_path):
    out = tmp_path / "auth"
    url = make_redis_auth(out, "redis://redis:6380/2")
    conf = (out / "redis.conf").read_text()
    password = conf.split()[1]
    assert conf == f"requirepass {password}\n" and len(password) >= 40
    assert url == f"redis://:{password}@redis:6380/2" == (out / "redis-url").read_text()
    for name in ("redis.conf", "redis-url"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o640
    assert make_redis_auth(out, "redis://redis:6380/2") == url  # a restart keeps it
    assert make_redis_auth(tmp_path / "other", "redis://redis:6380/2") != url
    for bad in ("http://x:1/0", "redis://:pw@x:1/0", "redis:///0"):
        with pytest.raises(ValueError):
            url_with_password(bad, "p")


def test_certs_command_keeps_an_existing_set_and_makes_redis_auth(tmp_path, capsys):
    from pdserve.cli import main

    argv = ["certs", "--out", str(tmp_path / "tls"), "--keep-existing",
            "--redis-url", "redis://redis:6379/0", "--redis-auth-out", str(tmp_path / "ra")]
    assert main(argv) == 0
    ca = (tmp_path / "tls" / "ca.pem").read_bytes()
    url = (tmp_path / "ra" / "redis-url").read_text()
    assert main(argv) == 0  # the second `up` of a compose stack
    assert "kept" in capsys.readouterr().out
    assert (tmp_path / "tls" / "ca.pem").read_bytes() == ca
    assert (tmp_path / "ra" / "redis-url").read_text() == url
    (tmp_path / "tls" / "router-key.pem").unlink()  # incomplete: made anew
    assert main(argv) == 0 and (tmp_path / "tls" / "ca.pem").read_bytes() != ca
    with pytest.raises(SystemExit):
        main(["certs", "--out", str(tmp_path / "x"), "--redis-url", "redis://r:1/0"])


def test_up_secrets_folder(tmp_path):
    from pdserve.services.common.tls import TlsConfig, server_credentials
    from pdserve.services.common.tls_args import RunSecrets

    secrets = RunSecrets(insecure=False)
    folder = Path(secrets.dir)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    server_credentials(TlsConfig.from_dir(secrets.tls_dir, "decode"))  # a usable set
    secrets.close()
    assert not folder.exists()
    plain = RunSecrets(insecure=True)
    assert plain.tls_dir == "" and os.listdir(plain.dir) == ["owner.pid"]
    plain.close()
    given = RunSecrets(insecure=False, given_tls_dir=str(tmp_path))  # `up --tls-dir`
    assert given.tls_dir == str(tmp_path) and not os.listdir(tmp_path)  # used, not made
    given.close()
    assert tmp_path.exists()  # the user's folder stays
    with pytest.raises(ValueError, match="contradict"):
        RunSecrets(insecure=True, given_tls_dir=str(tmp_path))


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_redis_refuses_clients_without_the_password(tmp_path):
    from urllib.parse import urlsplit

    from pdserve.services.launch_plans import redis_ready
    from pdserve.services.ports import free_port

    url = make_redis_auth(tmp_path / "auth", "redis://127.0.0.1:1/0")
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([shutil.which("redis-server"), str(tmp_path / "auth" / "redis.conf"),
                             "--bind", "127.0.0.1", "--port", str(port), "--dir", str(tmp_path),
                             "--save", ""], stdout=subprocess.DEVNULL)
    try:
        password = urlsplit(url).password
        deadline = time.monotonic() + 20
        while not redis_ready("127.0.0.1", port, password):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        assert not redis_ready("127.0.0.1", port)  # no AUTH: NOAUTH, not PONG
        assert not redis_ready("127.0.0.1", port, "wrong")
        assert password not in " ".join(proc.args)  # not in its command line
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_killed_runs_secrets_are_removed_by_the_next_run(tmp_path):
    """A SIGKILLed `pdserve up` cannot remove its folder of keys; the next run does, and leaves
    a live run's folder and a folder without an owner file alone."""
    import sys

    from pdserve.services.common.private_dir import OWNER_FILE, PrivateRunDir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "s-dead").mkdir()
    (tmp_path / "s-dead" / OWNER_FILE).write_text(dead)
    (tmp_path / "s-dead" / "ca-key.pem").write_text("secret")
    (tmp_path / "s-unowned").mkdir()
    live = PrivateRunDir("s-", root=str(tmp_path))
    second = PrivateRunDir("s-", root=str(tmp_path))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "s-dead" not in left and "s-unowned" in left
    assert Path(live.path).name in left and Path(second.path).name in left
    assert (Path(live.path) / OWNER_FILE).read_text() == str(os.getpid())
    live.close()
    second.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-unowned"]
