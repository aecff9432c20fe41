"""The agent's limits in the config tree: `offload.agent.limits` of a `--config FILE` -> the
`AgentLimits` the server gets; each flag given wins over its key; a bad value is one `error:` line
naming the key (of the file) or the flag (of the command line)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from offload.agent.limits import AgentLimits
from offload.cli import main
from offload.commands import agent
from offload.config import AgentLimitsConfig, ConfigError, load_text

FILE = """\
offload:
  agent:
    address: 192.168.100.2:7400
    limits:
      max_clients: 8
      max_frame: 16MiB
      staging: 8MiB
      max_memory: 2GiB
      io_timeout: 5
      idle_timeout: 600
"""


def _limits(tmp_path: Path, text: str | None, *flags: str) -> AgentLimits:
    p = argparse.ArgumentParser()
    agent.add_arguments(p)
    cfg = []
    if text is not None:
        (tmp_path / "agent.yaml").write_text(text)
        cfg = ["--config", str(tmp_path / "agent.yaml")]
    args = p.parse_args(["--listen", "127.0.0.1:0", "--memory", *cfg, *flags])
    return AgentLimits.from_config(agent.limits_config(args))


def test_every_limit_key_is_one_flag() -> None:
    keys = [f.name for f in dataclasses.fields(AgentLimitsConfig)]
    assert sorted(f[2:].replace("-", "_") for f, _, _ in agent.LIMIT_FLAGS) == sorted(keys)


def test_defaults_of_the_tree_are_the_limits_defaults(tmp_path: Path) -> None:
    assert AgentLimits.from_config(AgentLimitsConfig()) == AgentLimits()
    assert _limits(tmp_path, None) == AgentLimits()
    assert _limits(tmp_path, "offload: {}\n") == AgentLimits()


def test_the_file_sets_the_limits(tmp_path: Path) -> None:
    lim = _limits(tmp_path, FILE)
    assert lim == AgentLimits(max_clients=8, max_body=16 << 20, staging_size=8 << 20,
                              max_memory=2 << 30, io_timeout=5.0, idle_timeout=600.0)
    assert lim.max_block == 4 << 20


def test_a_flag_wins_over_the_file_and_the_rest_of_the_file_stands(tmp_path: Path) -> None:
    lim = _limits(tmp_path, FILE, "--max-clients", "3", "--staging", "2MiB",
                  "--idle-timeout", "60", "--max-pending", "4")
    assert (lim.max_clients, lim.staging_size, lim.idle_timeout, lim.max_pending) == \
        (3, 2 << 20, 60.0, 4)
    assert (lim.max_body, lim.max_memory, lim.io_timeout) == (16 << 20, 2 << 30, 5.0)


@pytest.mark.parametrize("key,value,says", [
    ("max_clients", "0", "0 must be >= 1"),
    ("max_frame", "512KiB", "'512KiB' is out of range; use 1MiB <= x < 4GiB"),
    ("staging", "2TB!", "'2TB!' is not a size"),
    ("io_timeout", "-1", "-1.0 must be > 0 (seconds)"),
    ("idle_timeout", ".inf", "inf must be > 0 (seconds)"),
    ("max_pending", "many", "'many' is not an integer"),
])
def test_a_bad_value_in_the_file_is_one_error_naming_its_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: str,
        says: str) -> None:
    text = f"offload:\n  agent:\n    limits:\n      {key}: {value}\n"
    with pytest.raises(ConfigError) as e:
        load_text(text)
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith(f"offload.agent.limits.{key}: {says}")
    (tmp_path / "agent.yaml").write_text(text)
    # The agent refuses it before opening a store or reading a secret; so does config validate.
    for argv in (["agent", "--listen", "127.0.0.1:0", "--config", str(tmp_path / "agent.yaml")],
                 ["config", "validate", "--offload-only", str(tmp_path / "agent.yaml")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: offload.agent.limits.{key}: {says}"), \
            (argv, err)


def test_an_unknown_limit_names_the_allowed_keys() -> None:
    with pytest.raises(ConfigError, match=r"offload\.agent\.limits\.max_client: unknown key "
                                          r"\(did you mean 'max_clients'\?\)"):
        load_text("offload:\n  agent:\n    limits:\n      max_client: 2\n")


def test_a_bad_flag_is_one_error_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["agent", "--listen", "127.0.0.1:0", "--memory", "--max-clients", "0",
                 "--max-frame", "12KiB"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --max-clients: 0 must be >= 1",
        "error: --max-frame: '12KiB' is out of range; use 1MiB <= x < 4GiB"]
