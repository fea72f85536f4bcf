"""``omnilab probe`` and ``omnilab plan``: print the hardware description and the deploy profile.

Contract: ``probe_main(argv)`` and ``plan_main(argv)`` parse their own arguments, print a table (or JSON
with ``--json``) and return an exit code: 0 on success, 2 on a configuration error (message on stderr).
No torch or vLLM import.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Sequence

from omnilab.cli.main import Formatter
from omnilab.errors import OmnilabError
from omnilab.hardware import kernel_isas, probe_hardware, snapshot_hardware
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity
from omnilab.profiles.overrides import env_help
from omnilab.profiles.resolve import list_presets, resolve_profile


def probe_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab probe", formatter_class=Formatter, description="Describe this machine's "
                                 "CPUs, NUMA layout, cgroup limits and memory, as the deploy planner sees them.")
    ap.add_argument("--root", default="/", help="filesystem root or a .json snapshot to probe")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--snapshot", metavar="OUT.json", help="also write every file the probe read to OUT.json "
                    "(attach it to bug reports; '--root OUT.json' replays it) (default: not written)")
    add_verbosity(ap)
    args = ap.parse_args(argv)
    apply_verbosity(args)
    try:
        hw = probe_hardware(args.root)
        if args.snapshot:
            with open(args.snapshot, "w") as f:
                json.dump(snapshot_hardware(args.root), f, indent=1, sort_keys=True)
    except (OmnilabError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**hw.to_dict(), "kernels": kernel_isas(hw.flags)}, indent=1))
    else:
        print(hw)
        print("kernels (auto, from the flags): " + "; ".join(f"{k} {v}" for k, v in kernel_isas(hw.flags).items()))
    return 0


def _overrides(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
        out[key.strip()] = value.strip()
    return out


def plan_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="omnilab plan", formatter_class=Formatter,
        description="Plan threads, CPU lists, KV budget, dtype and chunking for the talker and code2wav stages.",
        epilog="environment overrides (OMNILAB_* win over vLLM's variables, which win over arguments and files):\n"
               + env_help())
    ap.add_argument("--model", metavar="PATH", help="checkpoint directory or its config.json (default: the released "
                    "0.6B geometry)")
    ap.add_argument("--deploy-profile", default="auto", metavar="P",
                    help=f"auto, a preset ({', '.join(list_presets())}) or a deploy YAML file")
    ap.add_argument("--profile", dest="legacy_profile", default=None, help=argparse.SUPPRESS)  # the former name
    ap.add_argument("--root", default="/", help="filesystem root or .json snapshot to plan for")
    ap.add_argument("--max-concurrency", type=int, help="concurrent requests, max_num_seqs (default: the planner's)")
    ap.add_argument("--max-model-len", type=int, help="talker context length in tokens (default: the planner's)")
    ap.add_argument("--quantization", metavar="Q", help="decode matrix recipe: none | int8 | int4 | "
                    "int4-all, int4 ones with a group suffix -g32 | -g64 | -g128 (default: none)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field, e.g. "
                    "--set talker_threads=4 --set dtype=float32; repeatable (default: none)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--yaml", metavar="OUT.yaml", help="also write the profile as deploy YAML (default: not written)")
    add_verbosity(ap)
    args = ap.parse_args(argv)
    apply_verbosity(args)
    if args.legacy_profile is not None:
        if args.deploy_profile not in ("auto", args.legacy_profile):
            ap.error(f"--profile {args.legacy_profile} and --deploy-profile {args.deploy_profile} disagree; "
                     "accepted: --deploy-profile alone")
        warnings.warn("omnilab plan --profile is deprecated; use --deploy-profile, as the other commands do",
                      FutureWarning, stacklevel=1)
        args.deploy_profile = args.legacy_profile
    try:
        kwargs = {k: v for k, v in (("max_concurrency", args.max_concurrency),
                                    ("max_model_len", args.max_model_len)) if v is not None}
        overrides = _overrides(args.set)
        if args.quantization is not None:
            overrides["quantization"] = args.quantization
        if overrides:
            kwargs["overrides"] = overrides
        hw = probe_hardware(args.root)
        times = _path_times(overrides) if args.root == "/" else None  # a snapshot is another machine: no timing
        if times is not None:
            kwargs["path_times"] = times
        profile = resolve_profile(args.deploy_profile, hardware=hw, model_config=args.model, **kwargs)
        if args.yaml:
            profile.to_yaml(args.yaml)
    except (OmnilabError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**profile.to_dict(), "kernels": kernel_isas(hw.flags)}, indent=1))
    else:
        print(profile)
        print("kernels this CPU gets (auto, from its flags; OMNILAB_CPU_* override): " + "; ".join(
            f"{k} {v}" for k, v in kernel_isas(hw.flags).items()))
    return 0


def _path_times(overrides: dict) -> object:
    """This machine's timing of the linear paths where torch is here and the dtype is open (else None: the ISA
    rule, and the profile's reason says so)."""
    if "dtype" in overrides:
        return None
    try:
        from omnilab.tuning.timing import path_times  # lazy: torch
    except ImportError:  # the core install (no torch): the ISA rule
        return None
    return path_times()


if __name__ == "__main__":  # python -m omnilab.cli.profile {probe|plan} ...
    cmd, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("probe", [])
    sys.exit({"probe": probe_main, "plan": plan_main}.get(cmd, probe_main)(rest))
