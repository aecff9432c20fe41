"""Every command's one error path, driven with generated bad values (hypothesis), and closed pipes.

Each case is a command line with one option given a bad value (`--opt=VALUE`, so a value that
starts with '-' stays a value); the rest of the line is valid and small, so a bad value that got
through would run (and exit 0) instead of being refused. Every run must exit non-zero with an
`error:` line naming the option, no traceback and no `internal error` (a value no check caught).
The commands run in-process (`offload.cli.main`); nothing here connects anywhere but loopback.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.cli import EXIT_PIPE, main
from tests.store.stores import open_store

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ROOT / "tests" / "fixtures" / "hosts"

# --- bad values ------------------------------------------------------------------------------------
JUNK = st.text(alphabet="xyzq!@#%^&*()[]{}|;?~", min_size=1, max_size=8)
BAD_COUNT = st.one_of(st.integers(max_value=0).map(str), JUNK, st.sampled_from(["1.5", "", " "]))
BAD_NATURAL = st.one_of(st.integers(max_value=-1).map(str), JUNK, st.sampled_from(["2.5", ""]))
BAD_SIZE = st.one_of(JUNK, st.sampled_from(["0", "0MiB", "-1", "1ZiB", "abc", "", "1MiB,", "1e3",
                                            "--", "NaN"]),
                     st.integers(max_value=0).map(str))
NOT_A_SIZE = st.one_of(JUNK, st.sampled_from(["-1", "1ZiB", "abc", "", "1MiB,", "1e3", "NaN"]))
BAD_SIZES = st.one_of(JUNK, st.sampled_from(["1MiB,abc", "0", ",", "1MiB,0", "-4MiB", "4MiB;8MiB"]),
                      st.lists(JUNK, min_size=1, max_size=3).map(",".join))
BAD_FLOAT = st.one_of(JUNK, st.sampled_from(["0", "-1", "nan", "inf", "-inf", ""]))
BAD_FRACTION = st.one_of(BAD_FLOAT, st.floats(min_value=1.0001, max_value=1e9).map(str))
# "zz..." is no preset, dtype, layout or family name
BAD_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", max_size=12).map("zz".__add__)
BAD_COUNT_TEXT = BAD_SIZE.filter(lambda s: s != "1e3")       # 1e3 is a valid --params


def _missing(tmp: Path) -> st.SearchStrategy[str]:
    return st.sampled_from([str(tmp / "nope"), str(tmp / "nope" / "deeper"), str(tmp / "afile"),
                            "/proc/nonexistent-dir"])


def _bad_plot(tmp: Path) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([str(tmp / "nope" / "x.png"), str(tmp / "x.txt"),
                                      str(tmp / "x"), str(tmp), str(tmp / "x.docx")]),
                     JUNK.map(lambda j: str(tmp / f"out.{j}")))


# --- command lines: (argv before the bad option, the option, its bad values) -----------------------
# The valid rest of each bench line is tiny, so a value that slipped through would finish quickly.
STORE = ["bench", "store", "--sizes", "64KiB", "--total", "256KiB", "--lookup-blocks", "0",
         "--repeat", "1", "--dir", "{tmp}"]
HICACHE = ["bench", "hicache", "--pages", "1", "--dir", "{tmp}"]
REDIS = ["bench", "redis", "--url", "redis://127.0.0.1:1", "--sizes", "64KiB", "--total", "64KiB"]
PATHS = ["bench", "paths", "--paths", "cpu", "--sizes", "64KiB", "--total", "64KiB",
         "--repeat", "1", "--dir", "{tmp}"]


# a refused connection, were a bad value let through
SERVE = ["bench", "serve", "--url", "http://127.0.0.1:1", "--phases", "cold", "--lengths", "128"]
AGENT = ["agent", "--listen", "127.0.0.1:0", "--transport", "tcp"]
EVENTS = ["events", "http://127.0.0.1:1"]   # a refused connection, were a bad value let through
# a file with no sglang: section, were a bad value let through (exit 2 before any server starts)
WORKLOAD = ["bench", "workload", "--config", "{tmp}/afile", "--dir", "{tmp}"]


def cases(tmp: Path) -> list[tuple[list[str], str, st.SearchStrategy[str]]]:
    """(command line, the option given a bad value ("" a positional), the bad values)."""
    missing, bad_plot = _missing(tmp), _bad_plot(tmp)
    files = [str(tmp / "nope.yaml"), str(tmp), str(tmp / "latin1.yaml"), str(tmp / "bad.yaml")]
    return [
        (STORE, "--sizes", BAD_SIZES), (STORE, "--total", BAD_SIZE), (STORE, "--batch", BAD_COUNT),
        (STORE, "--threads", BAD_COUNT), (STORE, "--repeat", BAD_COUNT),
        (STORE, "--lookup-blocks", BAD_NATURAL), (STORE, "--dir", missing),
        (STORE, "--plot", bad_plot),
        (HICACHE, "--pages", BAD_COUNT), (HICACHE, "--threads", BAD_COUNT),
        (HICACHE, "--dir", missing), (HICACHE, "--layout", BAD_NAME),
        (HICACHE, "--family", BAD_NAME), (HICACHE, "--plot", bad_plot),
        (REDIS, "--sizes", BAD_SIZES), (REDIS, "--total", BAD_SIZE), (REDIS, "--batch", BAD_COUNT),
        (REDIS, "--rounds", BAD_COUNT), (REDIS, "--min-ratio", BAD_FLOAT),
        (REDIS, "--plot", bad_plot),
        (PATHS, "--paths", st.sampled_from(["cpu,foo", "foo", ",", "gpu"])),
        (PATHS, "--sizes", BAD_SIZES), (PATHS, "--total", BAD_SIZE),
        (PATHS, "--batch", BAD_COUNT), (PATHS, "--repeat", BAD_COUNT), (PATHS, "--dir", missing),
        (SERVE, "--lengths", st.one_of(BAD_SIZES, st.sampled_from(["64", "128,12"]))),
        (SERVE, "--max-new-tokens", BAD_COUNT), (SERVE, "--dir", missing),
        (SERVE, "--start-timeout", BAD_FLOAT), (SERVE, "--phases", BAD_NAME),
        (SERVE, "--plot", bad_plot),
        (WORKLOAD, "--tiers", BAD_NAME), (WORKLOAD, "--groups", BAD_COUNT),
        (WORKLOAD, "--turns", BAD_COUNT), (WORKLOAD, "--prefix-tokens", BAD_COUNT),
        (WORKLOAD, "--concurrency", BAD_COUNT), (WORKLOAD, "--l1-tokens", BAD_COUNT),
        (WORKLOAD, "--l2-ratio", st.one_of(BAD_FLOAT, st.sampled_from(["1", "0.5"]))),
        (WORKLOAD, "--sweep-users", st.one_of(BAD_SIZES, st.sampled_from(["4,2", "2,2", "0"]))),
        (WORKLOAD, "--ttft-target-ms", BAD_FLOAT), (WORKLOAD, "--tie-margin", BAD_FLOAT),
        (WORKLOAD, "--dir", missing), (WORKLOAD, "--plot", bad_plot),
        (["bench", "plot", "{tmp}/result.json"], "--plot", bad_plot),
        (["plan"], "--gpu-mem", BAD_SIZE), (["plan"], "--tier-capacity", BAD_SIZE),
        (["plan"], "--tp", BAD_COUNT), (["plan"], "--gpus", BAD_COUNT),
        (["plan"], "--users", BAD_NATURAL), (["plan"], "--context", BAD_SIZE),
        (["plan"], "--prefix-tokens", st.one_of(BAD_SIZE, st.integers(1 << 24, 1 << 60).map(str))),
        (["plan"], "--mem-fraction", BAD_FRACTION), (["plan"], "--ttft", BAD_FLOAT),
        (["plan"], "--hit-rate", BAD_FRACTION), (["plan"], "--read-gbps", BAD_FLOAT),
        (["plan"], "--drives", BAD_COUNT), (["plan"], "--think-s", BAD_FLOAT.filter(lambda t: t != "0")),
        (["plan"], "--turn-s", BAD_FLOAT), (["plan"], "--l2-gbps", BAD_FLOAT),
        (["plan"], "--hicache-size", BAD_FLOAT), (["plan"], "--host-mem", BAD_SIZE),
        (["plan"], "--prefill-tps", BAD_FLOAT), (["plan"], "--kv-dtype", BAD_NAME),
        (["plan"], "--weight-dtype", BAD_NAME), (["plan"], "--gpu", BAD_NAME),
        (["plan"], "--model", BAD_NAME), (["plan"], "--params", BAD_COUNT_TEXT),
        (["cache", "evict", "{tmp}/cache"], "--to", NOT_A_SIZE),   # 0 is valid: evict all
        (["cache", "clear", "{tmp}/cache"], "--namespace", st.one_of(JUNK, BAD_NAME)),
        (["cache", "stats", "{tmp}/cache"], "--metrics-url", st.one_of(JUNK, BAD_NAME)),
        (["detect", "--root", str(HOSTS / "cpu-box")], "--cache-dir", st.one_of(JUNK, BAD_NAME)),
        (["detect"], "--root", missing),
        (["detect"], "--config", st.sampled_from(files)),
        (["config", "validate"], "", st.sampled_from(files)),
        (["launch", "--dry-run"], "--config", st.sampled_from(files)),
        (["cache", "verify"], "", missing), (["cache", "stats"], "", missing),
        # the agent would serve if a value got through: only unparseable values, and no secret or
        # store given, so a run that got past its parser stops at once (naming another option)
        (AGENT, "--listen", st.one_of(JUNK, st.sampled_from(["nonsense", "host:", ":1", "h:99999"]))),
        (AGENT, "--capacity", NOT_A_SIZE), (AGENT, "--max-frame", NOT_A_SIZE),
        (AGENT, "--staging", NOT_A_SIZE), (AGENT, "--max-clients", JUNK),
        (AGENT, "--io-timeout", JUNK), (AGENT, "--transport", BAD_NAME),
    ]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def assert_refused(argv: list[str], option: str, value: str) -> None:
    rc, out, err = run_cli(argv)
    shown = " ".join(argv)
    assert rc == 2, (shown, rc, out, err)              # bad input, refused before any work
    assert "Traceback" not in err + out and "internal error" not in err, (shown, err)
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert lines, (shown, err)
    # the option or the bad value is named (argparse: "argument --opt: ..."; ours: "--opt ...")
    named = [option] if option else []
    named += [value] if value.strip() else []
    named += ["offload."] if value.endswith(".yaml") else []     # a config file: its bad keys
    assert any(n in err for n in named) or not named, (shown, err)


@pytest.fixture
def no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_OFFLOAD_SECRET", raising=False)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("badinput")
    (d / "afile").write_text("a file, not a directory\n")
    (d / "latin1.yaml").write_bytes("offload:\n  store:\n    path: /tmp/caf\xe9\n".encode("latin-1"))
    (d / "bad.yaml").write_text("offload:\n  store:\n    capacity: lots\n    io_threads: -1\n")
    (d / "result.json").write_text(           # a result a good --plot would draw (exit 0)
        '{"page_bytes": 8388608, "raw": {"write_gbps": 2.0, "read_gbps": 3.0}, '
        '"stock_file": {"write_gbps": 0.5, "read_gbps": 1.0}, '
        '"offload": {"write_gbps": 1.8, "read_gbps": 2.7}}')
    open_store(d / "cache", 64 << 20).close()
    return d


def test_every_case_names_a_real_option(tmp: Path) -> None:
    """The table tracks the parsers: each option it feeds exists (else the test proves nothing)."""
    for prefix, option, _ in cases(tmp):
        if not option:
            continue
        argv = [a.format(tmp=tmp) for a in prefix]
        rc, out, _ = run_cli([*argv[:2], "--help"] if argv[0] in ("bench", "cache") else
                             [argv[0], "--help"])
        assert rc == 0 and option in out, (argv, option)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_bad_values_are_one_error_line_never_a_traceback(tmp: Path, data: st.DataObject,
                                                         no_secret: None) -> None:
    table = cases(tmp)
    prefix, option, values = data.draw(st.sampled_from(table), label="case")
    value = data.draw(values, label="value")
    argv = [a.format(tmp=tmp) for a in prefix] + [f"{option}={value}" if option else value]
    assert_refused(argv, option, value)


def events_cases(tmp: Path) -> list[tuple[list[str], str, st.SearchStrategy[str]]]:
    """`sglang-offload events`: its own table (the draws of the table above stay as they were)."""
    files = [str(tmp / "nope.json"), str(tmp), str(tmp / "latin1.yaml"), str(tmp / "afile")]
    return [(EVENTS + ["--prompt", "x"], "--listen", BAD_FLOAT),
            (EVENTS, "--input-ids", st.sampled_from(files)),
            (["events", "--prompt", "x"], "", st.one_of(JUNK, BAD_NAME,
                                                        st.sampled_from(["tcp://127.0.0.1:1"])))]


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_events_bad_values_are_one_error_line(tmp: Path, data: st.DataObject) -> None:
    prefix, option, values = data.draw(st.sampled_from(events_cases(tmp)), label="case")
    value = data.draw(values, label="value")
    argv = [a.format(tmp=tmp) for a in prefix] + [f"{option}={value}" if option else value]
    assert_refused(argv, option, value)
    if option:
        rc, out, _ = run_cli(["events", "--help"])
        assert rc == 0 and option in out


@pytest.mark.parametrize("argv, needle", [
    (["bench", "store", "--dir", "{tmp}/nope"], "argument --dir: "),
    (["bench", "store", "--dir", "{tmp}/afile"], "is not a directory"),
    (["bench", "store", "--sizes", "1MiB,abc"], "'abc' is not a size"),
    (["bench", "store", "--total", "abc"], "argument --total: 'abc'"),
    (["bench", "store", "--batch", "0"], "argument --batch: '0': must be at least 1"),
    (["bench", "store", "--lookup-blocks", "-5"], "cannot be negative"),
    (["bench", "redis", "--sizes", "0"], "'0' must be more than 0 bytes"),
    (["bench", "paths", "--paths", "cpu,foo"], "unknown 'foo'; choose from cpu,dpu,gds"),
    (["bench", "store", "--plot", "{tmp}/nope/x.png"], "does not exist"),
    (["bench", "store", "--plot", "{tmp}/x.txt"], "is not one matplotlib writes"),
    (["cache", "stats", "{tmp}/nope"], "not a cache directory"),
    (["bench", "redis", "--url", "http://x"], "error: --url: 'http://x' is not a redis://"),
    (["bench", "redis", "--url", "redis://127.0.0.1:1", "--secret-file", "{tmp}/nope"],
     "error: --secret-file: "),
])
def test_the_reported_tracebacks_are_error_lines(tmp: Path, argv: list[str], needle: str) -> None:
    rc, out, err = run_cli([a.format(tmp=tmp) for a in argv])
    assert rc == 2 and out == "" and needle in err and "Traceback" not in err, err


def test_an_unreachable_redis_is_one_line_exit_1(tmp: Path) -> None:
    rc, out, err = run_cli(["bench", "redis", "--url", "redis://127.0.0.1:1", "--sizes", "64KiB",
                            "--total", "64KiB", "--rounds", "1"])
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 1 and out == "" and len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("error: bench redis --url redis://127.0.0.1:1: ") and \
        "fix --url" in errors[0]


def test_an_unexpected_exception_is_one_line_and_v_logs_its_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from offload.commands import plan

    def boom(args: object) -> int:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(plan, "run", boom)
    rc, _, err = run_cli(["plan"])
    assert rc == 1 and err.splitlines() == [
        "error: internal error: ZeroDivisionError: a bug (run with -v for the traceback and "
        "report it)"]


def test_an_unexpected_exception_quoting_a_redis_url_shows_no_password(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from offload.commands import plan

    def boom(args: object) -> int:
        raise RuntimeError("cannot reach redis://app:hunter2secret@10.0.0.5:6379/0")

    monkeypatch.setattr(plan, "run", boom)
    rc, _, err = run_cli(["plan"])
    assert rc == 1 and "hunter2secret" not in err and "redis://app:***@10.0.0.5:6379/0" in err


# --- closed pipes ------------------------------------------------------------------------------------

class ClosedAfter(io.TextIOBase):
    """A stdout whose reader goes away after `limit` characters (as `| head -c N` does)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.written = limit, 0

    def write(self, s: str) -> int:
        self.written += len(s)
        if self.written > self.limit:
            raise BrokenPipeError(32, "Broken pipe")
        return len(s)

    def flush(self) -> None:
        if self.written > self.limit:
            raise BrokenPipeError(32, "Broken pipe")


def _pipe_commands(tmp: Path) -> list[list[str]]:
    cfg = tmp / "c.yaml"
    cfg.write_text(f"offload:\n  store:\n    path: {tmp / 'cache'}\n")
    return [["plan", "--tp", "2"], ["plan", "--tp", "2", "--json"],
            ["cache", "stats", "--json", str(tmp / "cache")],
            ["config", "validate", "--json", "--offload-only", str(cfg)],
            ["detect", "--json", "--root", str(HOSTS / "cpu-box")],
            ["bench", "plot", "--help"]]


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_closed_stdout_ends_quietly(tmp: Path, data: st.DataObject) -> None:
    argv = data.draw(st.sampled_from(_pipe_commands(tmp)), label="argv")
    limit = data.draw(st.integers(0, 400), label="chars read")
    err = io.StringIO()
    with contextlib.redirect_stdout(ClosedAfter(limit)), contextlib.redirect_stderr(err):
        rc = main(argv)
    assert rc in (0, EXIT_PIPE), (argv, limit, err.getvalue())
    assert "Traceback" not in err.getvalue() and "error" not in err.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv", [["plan", "--tp", "2"],
                                  ["detect", "--json", "--root", str(HOSTS / "cpu-box")]])
def test_a_real_closed_pipe(argv: list[str]) -> None:
    """`sglang-offload plan | head -c 0`: the reader is gone before the first write."""
    r, w = os.pipe()
    os.close(r)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "offload.cli", *argv], stdout=w,
                       stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(w)
    assert p.returncode == EXIT_PIPE, p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr


# --- -v ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["detect", "--root", str(HOSTS / "cpu-box")], "detect (offload.commands.detect)"),
    (["cache", "stats", "{tmp}/cache"], "opening {tmp}/cache"),
    (["bench", "store", "--sizes", "64KiB", "--total", "256KiB", "--lookup-blocks", "0",
      "--repeat", "1", "--dir", "{tmp}"], "removed {tmp}/sglo-bench-"),
])
def test_v_gives_debug_lines(tmp: Path, caplog: pytest.LogCaptureFixture, argv: list[str],
                             needle: str) -> None:
    import logging

    caplog.set_level(logging.DEBUG, logger="offload")
    try:
        rc, _, _ = run_cli(["-v", *[a.format(tmp=tmp) for a in argv]])
    finally:
        logging.getLogger("offload").setLevel(logging.NOTSET)
    assert rc == 0 and needle.format(tmp=tmp) in caplog.text, caplog.text
    assert not list(tmp.glob("sglo-bench-*"))                 # the bench removed what it wrote


def test_v_logs_ours_not_every_library_s_debug_lines() -> None:
    # matplotlib's font search alone was ~150 DEBUG lines of `-v bench ... --plot`
    code = ("import logging, sys; from offload.cli import main; rc = main(['-v', 'plan', '--tp', '2']); "
            "logging.getLogger('some.library').debug('LIBRARY DEBUG'); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "DEBUG offload.cli: plan" in p.stderr and "LIBRARY DEBUG" not in p.stderr, p.stderr


# --- an operator's first day (issue 39): each stumble is one `error:` line and a non-zero exit ---

@pytest.mark.parametrize("argv, want", [
    (["launch", "--config", "{tmp}/c.yaml", "--port", "30001"],
     "error: launch: unrecognized arguments: --port; SGLang's own flags go after `--`, e.g. "
     "sglang-offload launch --config {tmp}/c.yaml -- --port 30001"),
    (["launch", "--config", "{tmp}/c.yaml", "--dry-run", "--tp-size=2"],
     "error: launch: unrecognized arguments: --tp-size=2; SGLang's own flags go after `--`, e.g. "
     "sglang-offload launch --config {tmp}/c.yaml -- --tp-size=2"),
    (["detect", "--python", "/nonexistent"],
     "error: --python /nonexistent: no such executable; name the interpreter that runs SGLang "
     "(e.g. /opt/venv/bin/python), or leave --python out for this one"),
    (AGENT + ["--memory", "--store", "{tmp}/cache"],
     "error: agent: --memory keeps blocks in DRAM and uses no directory, but --store "
     "{tmp}/cache was given too; drop --store (DRAM only, lost on restart) or --memory (the "
     "disk store there)"),
])
def test_an_operator_s_stumble_is_one_error_line(tmp: Path, argv: list[str], want: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_OFFLOAD_SECRET", "0123456789abcdef0123456789abcdef")
    rc, out, err = run_cli([a.format(tmp=tmp) for a in argv])
    assert rc == 2 and out == "" and err.splitlines() == [want.format(tmp=tmp)], err


def test_other_commands_keep_argparse_s_unrecognized_line() -> None:
    rc, _, err = run_cli(["plan", "--bogus"])
    assert rc == 2 and err.splitlines()[-1] == "sglang-offload: error: unrecognized arguments: --bogus"


def test_version_names_ours_and_the_installed_sglang() -> None:
    from importlib.metadata import version

    from offload.launch.interpreter import pinned

    rc, out, err = run_cli(["--version"])
    assert rc == 0 and err == ""
    assert out == (f"sglang-offload {version('sglang-offload')} (SGLang {version('sglang')}; "
                   f"launch composes for SGLang {pinned()[0]})\n")


def test_an_agent_whose_ucx_cannot_start_says_what_to_check(tmp: Path) -> None:
    """A real NIXL whose UCX has no usable transport (UCX_TLS names none this host has): the
    agent's last line says what to check, not `internal error ... report it`."""
    pytest.importorskip("nixl")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_TLS": "no_such_transport",
           "SGLANG_OFFLOAD_SECRET": "0123456789abcdef0123456789abcdef"}
    p = subprocess.run([sys.executable, "-m", "offload.cli", "agent", "--listen", "127.0.0.1:0",
                        "--memory", "--capacity", "64MiB", "--memory-reserve", "1MiB"],
                       capture_output=True, text=True, env=env, timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1, p.stderr
    assert last.startswith("error: agent: --transport ucx: NIXL could not create its UCX backend "
                           "(NIXL_ERR_BACKEND;"), p.stderr
    assert "UCX_TLS='no_such_transport'" in last and "--transport tcp" in last
    assert "internal error" not in p.stderr and "Traceback" not in p.stderr
