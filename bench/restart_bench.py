#!/usr/bin/env python3
"""Time lost per failure of examples/gpt_train under commgrad-run --max-restarts.

Runs gpt_train with rank 0 SIGKILLed as step K begins (GPT_TRAIN_FAULT=kill:K)
and stamps every output line as it arrives: the time lost is from the kill
to the first step finished after the restart (the launcher's teardown, the
new processes, the rendezvous, the load, the first step). It also reports
what that costs beyond a step: minus the median step time of the run.

  bench/restart_bench.py [--build build] [--ranks 2] [--layout --dp 2] [--steps 8] [--kill-at 4] [--runs 3]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time


def one_run(args, layout):
    root = tempfile.mkdtemp(prefix="commgrad-restart-bench-")
    cmd = [os.path.join(args.build, "bin/commgrad-run"), "-n", str(args.ranks), "--max-restarts", "1",
           os.path.join(args.build, "bin/gpt_train"), *layout, "--steps", str(args.steps), "--save", root,
           "--save-every", str(args.save_every), "--curve", "none"]
    env = dict(os.environ, GPT_TRAIN_FAULT=f"kill:{args.kill_at}")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    killed = restarted = first_after = None
    steps = []
    last_step_time = None
    for line in proc.stdout:
        now = time.monotonic() - start
        if "fault: rank 0 kills itself" in line:
            killed = now
        elif "restarting the job" in line:
            restarted = now
        elif re.match(r"\[0\] step \d+/\d+: loss", line):
            if killed is not None and first_after is None:
                first_after = now
            elif killed is None:
                if last_step_time is not None:
                    steps.append(now - last_step_time)
                last_step_time = now
    proc.wait()
    shutil.rmtree(root, ignore_errors=True)
    if proc.returncode != 0 or killed is None or first_after is None:
        raise SystemExit(f"run failed (exit {proc.returncode}): {' '.join(cmd)}")
    return first_after - killed, restarted - killed, statistics.median(steps) if steps else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=4)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    args, layout = p.parse_known_args()
    layout = layout or ["--dp", str(args.ranks)]
    print(f"# gpt_train {' '.join(layout)} on {args.ranks} ranks, rank 0 killed as step {args.kill_at} begins,"
          f" --save-every {args.save_every}")
    print(f"# {'run':>3} {'lost (s)':>9} {'to restart (s)':>15} {'step (s)':>9}")
    lost = []
    for k in range(args.runs):
        total, to_restart, step = one_run(args, layout)
        lost.append(total)
        print(f"  {k:>3} {total:>9.2f} {to_restart:>15.2f} {step:>9.3f}")
    print(f"# median time lost per failure: {statistics.median(lost):.2f} s (kill -> first step after the restart)")


if __name__ == "__main__":
    main()
