"""`launch` names the worth-it threshold the backend will apply on its device, and why."""

from __future__ import annotations

from pathlib import Path

from tests.launch.helpers import HOSTS, dry_run, write

CPU = "sglang:\n  model-path: m\n  device: cpu\n  page-size: 64\noffload:\n  store: {path: /tmp/x}\n"


def test_cpu_measures_the_prefill_speed(capsys, tmp_path: Path) -> None:
    out = dry_run(capsys, write(tmp_path, CPU), root=str(HOSTS / "cpu-box"))
    text = out["worth_it"]
    assert "on device cpu no preset applies" in text and "measured from the first requests" in text
    assert "break-even" in text


def test_a_configured_prefill_speed_or_the_rule_off_is_named(capsys, tmp_path: Path) -> None:
    set_tps = CPU + "  worth_it: {prefill_tokens_per_s: 1500}\n"
    assert "1,500 tokens/s (configured)" in dry_run(
        capsys, write(tmp_path, set_tps), root=str(HOSTS / "cpu-box"))["worth_it"]
    off = CPU + "  worth_it: {enabled: false}\n"
    assert "rule off" in dry_run(capsys, write(tmp_path, off),
                                 root=str(HOSTS / "cpu-box"))["worth_it"]


def test_the_stores_drives_and_their_combined_bandwidth_are_named(capsys, tmp_path: Path) -> None:
    dirs = "[/data1/kv, /data2/kv, /data4/kv, /data5/kv]"
    cfg = write(tmp_path, CPU.replace("store: {path: /tmp/x}", f"store: {{paths: {dirs}}}"))
    out = dry_run(capsys, cfg, root=str(HOSTS / "dgx-8nvme"))
    combined = "4 drives (nvme1n1, nvme2n1, nvme4n1, nvme5n1), ~31.5 GB/s combined"
    assert f"the store's reads span {combined}" in out["worth_it"]
    assert any(r.startswith(f"store: 4 directories on {combined}")
               for r in out["decision"]["reasons"])


def test_the_summary_names_every_directory(tmp_path: Path) -> None:
    from offload.launch.compose import prepare, summary

    cfg = write(tmp_path, CPU.replace("store: {path: /tmp/x}",
                                      "store: {paths: [/data1/kv, /data2/kv]}"))
    text = summary(prepare(str(cfg), root=str(HOSTS / "dgx-8nvme")), str(cfg))
    assert "store: /data1/kv, /data2/kv (capacity 100GiB for all" in text
    assert "L3 store /data1/kv, /data2/kv" in text


def test_the_summary_names_the_page_cache_share_and_the_write_budget(tmp_path: Path) -> None:
    from offload.launch.compose import prepare, summary

    plain = write(tmp_path, CPU)
    text = summary(prepare(str(plain), root=str(HOSTS / "cpu-box")), str(plain))
    assert "page cache share" not in text and "write-backs at most" not in text
    cfg = write(tmp_path, CPU.replace("store: {path: /tmp/x}",
                                      "store: {path: /tmp/x, page_cache: 1GiB}\n"
                                      "  transfer: {path: cpu, write_budget: 2GiB}"),
                name="limits.yaml")
    text = summary(prepare(str(cfg), root=str(HOSTS / "cpu-box")), str(cfg))
    assert "page cache share 1GiB, write-backs at most 2GiB/s)" in text
