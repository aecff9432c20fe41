"""What `sglang-offload launch` does: config -> SGLang server arguments -> the command to exec.

Config -> SGLang server arguments -> process. Steps, in order:
1. `load_file` validates the `offload:` section; `check_sglang` (launch_sglang_args) validates the
   `sglang:` section and the extra flags against SGLang's own parser and refuses combinations that
   cannot work with the tier;
2. detection decides the transfer path (`offload.hw.detect_and_decide`, `--root` for a fixture);
   an explicit gds/dpu that cannot work stops here (exit 1, the failed check named); then the
   interpreter that will run SGLang (`--python`) must import sglang and sglang-offload at the
   pinned versions (`offload.launch.interpreter`; exit 1 naming what it lacks);
3. `offload.launch.device.choose` picks what works on SGLang's device (on cpu: torch_native
   attention, no CUDA graphs, the io backend, SGLANG_USE_CPU_ENGINE=1) and, on every device, the
   prefetch wait (`offload.launch.prefetch`: policy timeout, a deadline no longer than
   recomputing the prompt, capped by `offload.worth_it.max_prefetch_wait_s`; its two keys go into
   the extra config), never overriding a key the user set;
4. `compose` builds the command: `python -m sglang.launch_server`, the section's flags (SGLang's
   own `--config` conversion), `--enable-hierarchical-cache`, `--hicache-mem-layout page_first`
   (unless set), the `dynamic` storage backend `offload.hicache.OffloadStorage` with
   `interface_v1` and `config_file`: the path of the effective offload tree (transfer.path = the
   decided path), never the tree itself, which holds secrets (`offload.launch.secrets`), and
   `hicache_storage_pass_prefix_keys` when `kv-events-config` is set (L3 KV events name each
   page's parent: docs/reference/events.md); the device's flags; then the extra flags last (they
   win, as on SGLang's own command line);
5. `--dry-run` prints the decision, the effective config (secrets redacted) and the shell-quoted
   command and exits 0, writing nothing; otherwise `summary` (path and why, store, tiers, device
   choices) goes to stderr, `write` puts the settings file in place (0600, in a private 0700
   runtime directory) and `os.execvpe` replaces this process with SGLang, its environment plus
   the device's (signals reach SGLang directly; SGLang's pid is the one in the file's name).
Exit codes: 0 ok, 1 the requested path cannot work here, 2 bad config or flags.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from offload import redact as _redact
from offload.config import DeploymentConfig, load_file, to_dict
from offload.errors import ConfigError, RunError
from offload.hicache.contract import BACKEND_EXTRA
from offload.hicache.worth_it import plan_text
from offload.launch.argspec import sglang_parser
from offload.launch.device import DeviceChoice, choose
from offload.launch.interpreter import Interpreter, check_interpreter
from offload.launch.prefetch import decide as decide_wait
from offload.launch.prefetch import recompute_facts
from offload.launch.secrets import REDACTED, redact, runtime_dir, settings_path, write_settings
from offload.launch.sglang_args import SglangArgs, check_sglang

if TYPE_CHECKING:
    from offload.hw.decide import Decision



@dataclasses.dataclass
class LaunchCommand:
    """Everything launch decided: printed by --dry-run, executed otherwise."""

    config: DeploymentConfig
    sglang: SglangArgs
    decision: "Decision"
    offload_tree: dict[str, Any]        # effective offload: tree, transfer.path decided
    argv: list[str]
    settings_file: str                  # where `write` puts offload_tree (argv names it)
    device: DeviceChoice                # the device's flags (in argv) and environment
    interpreter: Interpreter            # what --python imports
    warnings: list[str] = dataclasses.field(default_factory=list)  # sglang: + machine's + L2's
    host_errors: list[str] = dataclasses.field(default_factory=list)   # refused without --dry-run
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def command(self) -> str:
        env = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.device.env.items())]
        masked = _redact.argv(self.argv, sglang_parser()[0])             # secrets masked
        return " ".join([*env, shlex.join(masked)])


def compose(dep: DeploymentConfig, sg: SglangArgs, path: str, settings_file: str,
            python: str = sys.executable, device: DeviceChoice | None = None
            ) -> tuple[dict[str, Any], list[str]]:
    """(effective offload tree, SGLang argv) for the decided transfer path.

    The argv names `settings_file` (where the tree must be written) and carries none of the
    tree: no salt, no Redis URL."""
    tree = to_dict(dep.offload)
    tree["transfer"]["path"] = path
    extra = {**(device.extra_config if device else {}), **sg.extra_config, **BACKEND_EXTRA,
             "config_file": settings_file}
    if "kv_events_config" in sg.set_by_user:   # L3 KV events name each page's parent
        extra.setdefault("hicache_storage_pass_prefix_keys", True)
    argv = [python, "-m", "sglang.launch_server", *sg.section_argv]
    if "enable_hierarchical_cache" not in sg.set_by_user:     # (false is refused earlier)
        argv.append("--enable-hierarchical-cache")
    if "hicache_mem_layout" not in sg.set_by_user:
        argv += ["--hicache-mem-layout", "page_first"]
    argv += ["--hicache-storage-backend", "dynamic",
             "--hicache-storage-backend-extra-config", json.dumps(extra, separators=(",", ":"))]
    return tree, argv + (device.argv if device else []) + sg.extra_argv


def prepare(config_file: str, extra_argv: list[str] | None = None, root: str = "/",
         cache_dir: str | None = None, python: str = sys.executable) -> LaunchCommand:
    """Validate, detect, decide, check against the machine (`offload.launch.checks`: the
    warnings `detect` gives, the model path, the GPUs, the L2 host memory) and compose.

    Raises ConfigError (file or flags, a deployment this machine cannot run, or an unsafe
    runtime directory), PathRejectedError (an explicit path that cannot work), DetectError (a bad
    root). Writes nothing but may create the (empty, private) runtime directory."""
    from offload.hw import detect_and_decide
    from offload.hw.live import connect
    from offload.launch.checks import deployment_findings, machine_findings

    dep = load_file(config_file)
    extra_argv = list(extra_argv or [])
    sg = check_sglang(dep.sglang, extra_argv, dep.offload)
    facts, decision = detect_and_decide(dep.offload, root=root, cache_dir=cache_dir,
                                        python=python)
    interp = check_interpreter(python)
    if interp.problem:
        raise RunError(interp.problem)
    deployment = deployment_findings(sg.values, facts, root)
    if deployment.errors:
        raise ConfigError(list(deployment.errors))
    machine = machine_findings(dep.offload, facts, root, cache_dir, connect)
    gpu = next((g.name for g in facts.gpus), None) if sg.values.device != "cpu" else None
    wait = decide_wait(sg.values, sg.set_by_user, sg.extra_config,
                       recompute_facts(dep.offload.worth_it, sg.values, gpu),
                       dep.offload.worth_it.max_prefetch_wait_s)
    device = choose(sg.values, sg.set_by_user, wait)
    settings = str(settings_path(runtime_dir()))
    tree, argv = compose(dep, sg, decision.path, settings, python, device)
    sglang_parser()[0].parse_args(argv[3:])       # the composed command parses (raises if not)
    return LaunchCommand(dep, sg, decision, tree, argv, settings, device, interp,
                         warnings=[*sg.warnings, *machine.warnings, *deployment.warnings],
                         host_errors=list(machine.errors),
                         notes=[*sg.notes, *deployment.notes])


def write(p: LaunchCommand) -> None:
    """Put the settings file the command names in place (mode 0600), just before exec."""
    write_settings(Path(p.settings_file), p.offload_tree)


def worth_it_text(p: LaunchCommand) -> str:
    """Which worth-it threshold the backend will apply on this device, and why."""
    return plan_text(p.config.offload.worth_it, p.device.device, p.decision.bandwidth)


def all_warnings(p: LaunchCommand) -> list[str]:
    """Every warning of the dry run: the sglang: section's, the machine's (what `detect`
    says), the L2 memory's, and what would stop a real launch (`host_errors`)."""
    return p.warnings + [f"{e} (launch refuses to start without --dry-run)"
                         for e in p.host_errors]


def render(p: LaunchCommand, config_file: str) -> str:
    d = p.decision
    lines = [f"sglang-offload launch: {config_file} (dry run)", "", "Decision",
             f"  role: {d.role}   path: {d.path}   (requested: {d.requested})", "  reasons:"]
    lines += [f"    - {r}" for r in d.reasons]
    if d.rejected:
        lines.append("  rejected:")
        for r in d.rejected:
            lines += [f"    - {r.path}: {r.check}", f"        fix: {r.fix}"]
    lines += ["", f"Device: {p.device.device}"] + [f"  - {r}" for r in p.device.reasons]
    lines += ["", "Worth-it threshold", f"  - {worth_it_text(p)}"]
    if all_warnings(p):
        lines += ["", "Warnings"] + [f"  - {w}" for w in all_warnings(p)]
    lines += ["", "Notes", f"  - sglang arguments: checked with {p.sglang.parser_source}",
              f"  - {p.interpreter.note}"]
    lines += [f"  - {n}" for n in p.notes]
    eff = {"sglang": _redact.tree("sglang", p.config.sglang), "offload": redact(p.offload_tree)}
    lines += ["", f"Effective config (offload.transfer.path is the decided path; secrets "
              f"{REDACTED}; launch writes the offload: section to {p.settings_file}, mode 600)",
              *("  " + ln for ln in yaml.safe_dump(eff, sort_keys=False).splitlines()),
              "", "Command", p.command, ""]
    return "\n".join(lines)


def to_json(p: LaunchCommand) -> dict[str, Any]:
    d = p.decision
    return {"decision": {"role": d.role, "path": d.path, "requested": d.requested,
                         "reasons": list(d.reasons),
                         "rejected": [{"path": r.path, "check": r.check, "fix": r.fix}
                                      for r in d.rejected]},
            "device": {"device": p.device.device, "argv": p.device.argv, "env": p.device.env,
                       "extra_config": p.device.extra_config, "reasons": p.device.reasons},
            "worth_it": worth_it_text(p),
            "interpreter": {"executable": p.interpreter.executable, "sglang": p.interpreter.sglang,
                            "offload": p.interpreter.offload},
            "warnings": all_warnings(p), "notes": p.notes,
            "sglang_parser": p.sglang.parser_source,
            "config": {"sglang": _redact.tree("sglang", p.config.sglang), "offload": redact(p.offload_tree)},
            "settings_file": p.settings_file, "argv": _redact.argv(p.argv, sglang_parser()[0]),
            "command": p.command}


def _io_limits(store: dict, transfer: dict, path: str) -> str:
    """The store line's I/O settings where set: the page-cache share, the write budget (the cpu
    path's only)."""
    out = ""
    if str(store.get("page_cache") or "0B") not in ("0", "0B"):
        out += f", page cache share {store['page_cache']}"
    if transfer.get("write_budget"):
        out += (f", write-backs at most {transfer['write_budget']}/s" if path == "cpu" else
                f", write_budget not applied (the {path} path has none)")
    return out


def summary(p: LaunchCommand, config_file: str) -> str:
    """What a real launch says before it execs SGLang: path and why, store, tiers, device."""
    d, off = p.decision, p.offload_tree
    store = off["store"]
    dirs = store.get("paths") or [store["path"]]
    tiers = [f"L1 {p.device.device} KV pool (SGLang)", "L2 host pool (HiCache)",
             f"L3 store {', '.join(dirs)}"]
    if d.path == "dpu":
        tiers[-1] = f"L3 agent {off['agent']['address']} ({off['agent']['transport']})"
    if (off.get("redis") or {}).get("url"):
        tiers.append(f"shared Redis {redact(off)['redis']['url']}")
    lines = [f"sglang-offload launch: {config_file}",
             f"  path: {d.path} (requested {d.requested}): " + "; ".join(d.reasons),
             f"  store: {', '.join(dirs)} (capacity {store['capacity']}"
             f"{' for all' if len(dirs) > 1 else ''}, namespace salt "
             f"{'set' if store.get('salt') or store.get('salt_file') else 'unset'}"
             f"{_io_limits(store, off.get('transfer') or {}, d.path)})",
             "  tiers: " + " -> ".join(tiers),
             f"  device {p.device.device}: " + "; ".join(p.device.reasons),
             f"  {worth_it_text(p)}",
             f"  settings: {p.settings_file} (mode 600)", f"  exec: {p.command}"]
    return "\n".join(lines) + "\n"
