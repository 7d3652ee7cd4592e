"""Redis with a password: redis-server gets it from a file, the master its URL from a file
(never argv), and the master's log shows the URL with the password redacted."""

import threading

import pytest
import redis

from pdserve.services.kvstore.config import redact_url
from pdserve.services.kvstore.redis_proc import RedisProcess
from pdserve.services.launcher import Child, free_port, wait_until
from pdserve.tests.integration.kvstore_cluster import KV, _master_up

PASSWORD = "pw-7f3a9c1e5b2d"


def test_master_reads_a_password_url_from_a_file_and_never_logs_it(tmp_path):
    pw_file = tmp_path / "redis.pw"
    pw_file.write_text(PASSWORD + "\n")
    with RedisProcess(password_file=str(pw_file)) as r:
        with pytest.raises(redis.AuthenticationError):  # requirepass is on
            redis.Redis(host=r.host, port=r.port).ping()
        url_file = tmp_path / "redis.url"
        url_file.write_text(r.url)
        port = free_port("127.0.0.1")
        master = Child("master", KV + ["kvstore-master", "--port", str(port),
                                       "--redis-url-file", str(url_file)], tmp_path)
        master.start()
        try:
            wait_until(lambda: _master_up(f"127.0.0.1:{port}"), master, 60,
                       threading.Event())
            assert PASSWORD not in " ".join(master.proc.args)
        finally:
            master.stop(5.0)
        log = master.log_path.read_text()
        assert "redis redis://:***@127.0.0.1" in log and PASSWORD not in log


def test_redact_url():
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://:secret@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
