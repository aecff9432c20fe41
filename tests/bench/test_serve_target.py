"""`bench serve`'s L3 target (offload.bench.serve_target): the verdict's arithmetic, fresh triple
prompts, a raw read timed on a real file, and the wheel's patch record."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from offload.bench.serve import _prompt
from offload.bench.serve_target import has_patch, raw_read_s, triple_prompts, verdict


def test_the_limit_is_l1l2_plus_twice_the_raw_read_plus_30_ms() -> None:
    v = verdict(l1l2_s=0.5, l3_s=0.6, raw_s=0.02)
    assert v["limit_s"] == pytest.approx(0.57) and v["met"] is False
    assert v["l3_extra_s"] == pytest.approx(0.1)
    assert verdict(0.5, 0.569, 0.02)["met"] is True


def test_triple_prompts_are_fresh_and_repeatable() -> None:
    first = triple_prompts(256, 7, 3)
    assert first == triple_prompts(256, 7, 3)
    assert len(first) == 3 and all(len(p) == 256 for p in first)
    before = [_prompt(256, 7 + 7919 * k) for k in range(3)]     # what bench serve sent first
    assert not any(p in before for p in first) and len({tuple(p) for p in first}) == 3


def test_a_raw_read_is_timed_on_the_directory(tmp_path: Path) -> None:
    assert raw_read_s(str(tmp_path), 5 << 20) > 0
    assert list(tmp_path.iterdir()) == []     # its scratch file is gone


def test_the_installed_wheel_records_patch_0008() -> None:
    assert has_patch("0008-") is True
    assert has_patch("9999-") is False


def test_a_deployment_without_local_weights_says_why(tmp_path: Path) -> None:
    from offload.bench.serve_target import missing_for_serve

    repo_id = tmp_path / "deploy.yaml"
    repo_id.write_text("sglang: {model-path: example-org/not-cached-anywhere}\n")
    assert "neither a local directory nor in the Hugging Face cache" in missing_for_serve(
        str(repo_id))
    local = tmp_path / "local.yaml"
    local.write_text(f"sglang: {{model-path: {tmp_path}}}\n")
    assert missing_for_serve(str(local)) is None
    assert "no sglang.model-path" in missing_for_serve(str(tmp_path / "absent.yaml"))


def test_a_private_server_is_started_from_a_loopback_copy_of_the_deployment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`private_server` (scripts/l3_profile.py, scripts/prefetch_policy.py) once imported a
    helper of `bench serve` that had been renamed; only the server start is stubbed here."""
    from offload.bench import serve_target
    from offload.launch.server import LaunchedServer

    started: list[tuple[Path, Path, str]] = []
    monkeypatch.setattr(LaunchedServer, "start", classmethod(
        lambda cls, config, log, url: started.append((Path(config), Path(log), url))))
    src = tmp_path / "deploy.yaml"
    src.write_text("sglang: {model-path: /models/x, port: 30000}\n")
    serve_target.private_server(str(src), tmp_path)
    ((config, log, url),) = started
    doc = yaml.safe_load(config.read_text())
    assert doc["sglang"]["host"] == "127.0.0.1" and url == f"http://127.0.0.1:{doc['sglang']['port']}"
    assert doc["offload"]["store"]["path"] == str(tmp_path / "store")
    assert log == tmp_path / "server.log"


def test_the_benchs_copy_of_a_deployment_loads_under_launchs_strict_rules(tmp_path: Path) -> None:
    """The copy a bench starts its servers from keeps the file's secrets, so it is private, and
    names one store directory (a file listing `paths` would become path + paths, refused)."""
    from offload.bench.serve import deployment
    from offload.config import load_file

    src = tmp_path / "deploy.yaml"
    src.write_text("sglang: {model-path: /models/x, admin-api-key: 0123456789abcdef}\n"
                   "offload: {store: {paths: [/d1/a, /d2/a], salt: tenant-salt-0123}}\n")
    src.chmod(0o600)
    out = deployment(str(src), tmp_path / "store", 4321, {"api-key": "fedcba9876543210"})
    assert out.stat().st_mode & 0o077 == 0
    cfg = load_file(out)
    assert cfg.offload.store.directories() == [str(tmp_path / "store")]
    assert cfg.offload.store.salt == "tenant-salt-0123"
