"""Property-based API testing: schemathesis against the server's own /openapi.json, on loopback.

    python benchmarks/schemathesis_run.py [--model GGUF] [--max-examples 25] [--url http://127.0.0.1:8000]

Without --url it starts `edgellm serve` in a subprocess on a free loopback port with a small context (so any
valid generation request is short) and stops it afterwards. Schemathesis sends schema-valid and schema-violating
requests to every operation; the run fails on any 5xx (`not_a_server_error`), on responses that contradict the
schema (status code, content type, body), and on schema-violating requests that are accepted.
Exit code: schemathesis's (0 = no failures). Needs the dev extra (schemathesis).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from load_test import check_loopback, launch_server, stop_server  # noqa: E402

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance," \
         "negative_data_rejection"


def start_server(args) -> tuple[subprocess.Popen, str]:
    options = ["--ctx-size", str(args.ctx_size), "--max-batch", "16"] + (["--model", args.model] if args.model else [])
    return launch_server(options, timeout=600, name="schemathesis_run")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback only); default: start one")
    ap.add_argument("--model", help="GGUF for the started server (default: the bundled model)")
    ap.add_argument("--ctx-size", type=int, default=64, help="context of the started server (bounds generations)")
    ap.add_argument("--max-examples", type=int, default=25, help="test cases per operation and phase")
    ap.add_argument("--checks", default=CHECKS)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole schemathesis run")
    args = ap.parse_args()
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        sys.exit("schemathesis_run: schemathesis is not installed (pip install 'edgellm[dev]')")
    proc = None
    if args.url:
        check_loopback(args.url)
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args)
    cmd = [exe, "run", url + "/openapi.json", "--checks", args.checks, "--max-examples", str(args.max_examples),
           "--seed", str(args.seed), "--workers", "1", "--request-timeout", "300", "--generation-database", "none",
           "--phases", "examples,coverage,fuzzing", "--no-color"]
    try:
        return subprocess.run(cmd, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print("schemathesis_run: timed out", file=sys.stderr)
        return 1
    finally:
        stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
