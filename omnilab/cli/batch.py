"""``omnilab batch MANIFEST --model DIR --out DIR [--address ray://HOST:PORT | auto | local | local:N | none]``.

Synthesizes every manifest row (``omnilab.batch.synthesize``; docs/batch.md) and prints the run's summary.
Exit status: 0 when every row is written (now or by an earlier run), 1 when some rows were reported bad or
failed (the others are written), 2 when the run was refused (``--strict`` with a bad row, a bad argument).
"""
from __future__ import annotations

import argparse

from omnilab.batch.run import synthesize
from omnilab.cli.main import Formatter
from omnilab.logs import add_arguments as add_verbosity, apply_arguments as apply_verbosity


def batch_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnilab batch", formatter_class=Formatter, description=(
        "Synthesize a manifest (CSV / JSONL / Parquet: id, text, speaker / instruct / ref_audio, language, generation "
        "settings) to OUT/wav/<id>.wav and OUT/metrics.parquet, one Pipeline per Ray actor (one per NUMA node of "
        "each Ray node) or in this process. Ids whose wav exists are skipped (resume). Exit status: 0 all rows "
        "written, 1 some rows bad or failed (the rest written), 2 refused. See docs/batch.md."))
    ap.add_argument("manifest", help="the manifest file: .csv, .jsonl / .ndjson or .parquet")
    ap.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the embedded tiny "
                    "checkpoint, random weights)")
    ap.add_argument("--out", default="batch-out", help="output directory (wav/, records/, metrics.parquet)")
    ap.add_argument("--address", default=None,
                    help="ray://HOST:PORT | HOST:PORT | auto | local | local:N (N Ray nodes on this machine) | none "
                         "(this process) (default: a local Ray instance, or this process without ray installed)")
    ap.add_argument("--backend", default="vllm", choices=("vllm", "eager"), help="each actor's talker backend")
    ap.add_argument("--deploy-profile", default="auto",
                    help="each actor's profile: auto | a preset name | a deploy YAML path | none")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the deploy profile's)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads and Ray CPUs per actor (default: the NUMA node's physical cores, at most the Ray "
                         "node's CPUs)")
    ap.add_argument("--actors-per-node", type=int, default=None, help="actors on each Ray node (default: one per NUMA node)")
    ap.add_argument("--max-retries", type=int, default=2, help="reruns of a row whose actor died before it is reported failed")
    ap.add_argument("--strict", action="store_true", help="refuse the whole run if any manifest row is bad")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbosity(ap)
    args = ap.parse_args(argv)
    apply_verbosity(args)

    profile = None if args.deploy_profile.lower() == "none" else args.deploy_profile
    rep = synthesize(args.manifest, args.model, args.out, address=args.address, backend=args.backend,
                     deploy_profile=profile, dtype=args.dtype, threads=args.threads,
                     actors_per_node=args.actors_per_node, strict=args.strict, progress=not args.no_progress,
                     max_retries=args.max_retries)
    print(rep)
    for e in rep.failed:
        print(f"failed  {e}")
    return 1 if rep.failed else 0
