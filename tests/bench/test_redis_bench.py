"""`bench redis --url`: what it writes on the user's server is gone after it, and --min-ratio says
which ratio missed (a real redis-server, started privately)."""

from __future__ import annotations

import json
import shutil

import pytest

from offload.bench.redis import benchmark_keys, private_redis
from offload.cli import main

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed")


def test_a_given_server_is_left_as_it_was(capsys: pytest.CaptureFixture[str],
                                          caplog: pytest.LogCaptureFixture) -> None:
    import redis

    with private_redis() as url:
        client = redis.Redis.from_url(url)
        client.set(b"user:data", b"x")
        argv = ["bench", "redis", "--url", url, "--sizes", "64KiB", "--total", "256KiB",
                "--batch", "2", "--rounds", "1", "--json"]
        assert main(argv) == 0
        row = json.loads(capsys.readouterr().out)["rows"][0]
        assert client.keys("*") == [b"user:data"]                # ours, raw and redis-benchmark's
        if shutil.which("redis-benchmark"):
            assert row["redis_benchmark"]                        # it ran, and its keys are gone
        # a key of redis-benchmark's names is the user's: the tool is skipped, the key kept
        client.set(benchmark_keys(4)[1], b"mine")
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert json.loads(out)["rows"][0]["redis_benchmark"] is None
        assert client.get(b"key:000000000001") == b"mine"
        assert sorted(client.keys("*")) == [b"key:000000000001", b"user:data"]
        if shutil.which("redis-benchmark"):
            assert "redis-benchmark skipped" in caplog.text and "would overwrite" in caplog.text
        # --min-ratio names each ratio that missed, at 4 MiB
        assert main([*argv[:4], "--sizes", "4MiB", "--total", "8MiB", "--rounds", "1",
                     "--min-ratio", "1000"]) == 1
        err = capsys.readouterr().err
        assert "error: --min-ratio: set ratio " in err and "< 1000 at 4MiB" in err
        assert "error: --min-ratio: get ratio " in err
        assert main([*argv[:-1], "--min-ratio", "0.5"]) == 1     # no 4 MiB row to check
        assert "add 4MiB to --sizes" in capsys.readouterr().err
        client.close()
