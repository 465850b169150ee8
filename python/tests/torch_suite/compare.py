"""What PyTorch's distributed suite must give on commgrad, and the check.

The contract: every test of the suite that passes on Gloo passes on
commgrad, except the ones listed in NOT_ON_COMMGRAD, each with a reason
that is about the suite, not about commgrad. The list only shrinks: an entry
whose test passes is reported as stale (remove it), and a test that fails
without an entry fails the run.

GLOO_PASSES is the baseline, measured with run_suite.py --backend gloo on
torch 2.15.0 (this machine's CPU-only build) at 2 and 3 ranks; re-measure
with `python compare.py --record-gloo` (see docs/python.md).

    python compare.py RESULTS.json --world-size 2     # exit 1 on a broken contract
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GLOO_BASELINE = os.path.join(HERE, "gloo_passes.json")

# Tests that pass on Gloo and not on commgrad: why, and why that is the suite's business.
NOT_ON_COMMGRAD = {
    "test_ddp_logging_data_cpu": (
        "the suite expects DDP's log to hold the backend's name; torch writes \"custom\" for every "
        "backend registered from outside torch (Backend.register_backend), so no third-party backend can pass it"),
    "test_get_backend": (
        "the suite runs commgrad under Gloo's name (BACKEND=gloo, so that its Gloo-gated tests run) and this test "
        "checks that dist.get_backend() says BACKEND; it says \"commgrad\", as it should"),
}


def gloo_passes(world_size):
    with open(GLOO_BASELINE) as f:
        return set(json.load(f)[str(world_size)])


def broken(outcomes, world_size):
    """The ways `outcomes` ({test: {"outcome", "detail"}}) break the contract."""
    baseline = gloo_passes(world_size)
    problems = []
    for test, result in sorted(outcomes.items()):
        outcome = result["outcome"]
        if test in NOT_ON_COMMGRAD:
            if outcome == "passed":
                problems.append(f"{test}: passes now; remove its entry from NOT_ON_COMMGRAD")
            continue
        if test in baseline and outcome != "passed":
            detail = result["detail"].strip().splitlines()
            problems.append(f"{test}: {outcome} on commgrad, passes on Gloo: {detail[-1] if detail else ''}")
    return problems


def main():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="run_suite.py --json files (--record-gloo: Gloo's, one per world size)")
    p.add_argument("--world-size", type=int, help="the world size of the results")
    p.add_argument("--record-gloo", action="store_true",
                   help="write the tests that passed in these Gloo results as the baseline (WS=file pairs)")
    args = p.parse_args()
    if args.record_gloo:
        baseline = {}
        for pair in args.results:
            ws, path = pair.split("=", 1)
            with open(path) as f:
                baseline[ws] = sorted(t for t, r in json.load(f).items() if r["outcome"] == "passed")
        with open(GLOO_BASELINE, "w") as f:
            json.dump(baseline, f, indent=1)
            f.write("\n")
        print(f"baseline: {', '.join(f'{len(v)} tests pass at {k} ranks' for k, v in baseline.items())}")
        return 0
    outcomes = {}
    for path in args.results:
        with open(path) as f:
            outcomes.update(json.load(f))
    problems = broken(outcomes, args.world_size)
    for line in problems:
        print("CONTRACT", line)
    counts = {}
    for r in outcomes.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(f"{len(outcomes)} tests at {args.world_size} ranks: {counts}; {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
