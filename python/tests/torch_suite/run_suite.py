"""PyTorch's own distributed test suite on the "commgrad" backend.

torch ships the suite every torch.distributed backend is held to
(torch/testing/_internal/distributed/distributed_test.py); PyTorch's CI runs
it through test/distributed/test_distributed_spawn.py with BACKEND=gloo. This
is that runner, rebuilt around the shipped file: each test starts its ranks
as new processes (spawn), and each rank imports this file again, which
imports commgrad (registering the backend) before the suite's code runs.

About 30 of the suite's CPU tests are gated on the name "gloo" (timeouts,
monitored_barrier, sparse all_reduce, ...). So the suite runs commgrad
under Gloo's name: with --backend commgrad, BACKEND is "gloo" for the suite,
and every group it makes with "gloo" (or the default) is created by
commgrad instead (`dist.get_backend()` says "commgrad"). --backend gloo
runs the same tests on Gloo itself: the baseline.

    python run_suite.py --backend commgrad --world-size 2 [--tests a,b] [--json out.json]
    python run_suite.py --backend gloo --world-size 3 --json gloo3.json

Writes one line per test (passed / failed / skipped and why) and, with
--json, {test: {"outcome": ..., "detail": ...}}. compare.py holds the
expectations and compares the outcomes against them.
"""

import os
import sys


def _configure_process():
    """Runs in the runner and again in every spawned rank (which imports this
    file as __mp_main__): the suite's module reads BACKEND at import."""
    backend = os.environ.get("COMMGRAD_SUITE_BACKEND")
    if backend is None:
        return
    os.environ["BACKEND"] = "gloo"
    # file:// (each test its own file, set in setUp): the suite's timeout
    # tests re-initialise the world and need it.
    os.environ.setdefault("INIT_METHOD", "file://")
    if backend == "commgrad":
        import commgrad  # noqa: F401  (registers the backend)
        _carry_gloo_groups_on_commgrad()


def _carry_gloo_groups_on_commgrad():
    """Every process group the suite asks Gloo for is made by commgrad: both
    init_process_group and new_group create their groups through
    _new_process_group_helper, whose `backend` names the backend."""
    import torch.distributed.distributed_c10d as c10d

    make = c10d._new_process_group_helper

    def as_commgrad(backend):
        if backend is not None and str(backend).lower() == "gloo":
            return c10d.Backend("commgrad")
        return backend

    def helper(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = as_commgrad(kwargs["backend"])
        elif len(args) > 3:
            args = (*args[:3], as_commgrad(args[3]), *args[4:])
        return make(*args, **kwargs)

    c10d._new_process_group_helper = helper


_configure_process()

if os.environ.get("COMMGRAD_SUITE_BACKEND") is not None:
    from torch.testing._internal.common_distributed import DistTestCases
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """The suite's tests, each on fresh ranks (as test_distributed_spawn.py)."""

        def setUp(self):
            super().setUp()
            init_file = os.path.join(os.environ["TEMP_DIR"], f"init-{self._testMethodName}-{os.getpid()}")
            os.environ["INIT_METHOD"] = "file://" + init_file
            self._spawn_processes()


def _all_tests():
    import unittest

    return unittest.defaultTestLoader.getTestCaseNames(TestDistBackendWithSpawn)


def _run(names):
    """Runs the named tests; returns {name: (outcome, detail)}."""
    import unittest

    class Collect(unittest.TextTestResult):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.outcomes = {}

        def _name(self, test):
            return test.id().rsplit(".", 1)[-1]

        def addSuccess(self, test):
            super().addSuccess(test)
            self.outcomes[self._name(test)] = ("passed", "")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self.outcomes[self._name(test)] = ("failed", self._exc_info_to_string(err, test)[-3000:])

        def addError(self, test, err):
            super().addError(test, err)
            self.outcomes[self._name(test)] = ("failed", self._exc_info_to_string(err, test)[-3000:])

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self.outcomes[self._name(test)] = ("skipped", reason)

    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=2, resultclass=Collect)
    result = runner.run(suite)
    return result.outcomes


def main():
    import argparse
    import json
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["commgrad", "gloo"], required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tests", default="", help="comma-separated test names (default: every test of the suite)")
    p.add_argument("--list", action="store_true", help="print the suite's test names and exit")
    p.add_argument("--json", help="write the outcomes here")
    args = p.parse_args()

    os.environ["COMMGRAD_SUITE_BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="commgrad-suite-"))
    # Re-run this file with the environment set, so the suite's module sees it at import.
    if os.environ.get("COMMGRAD_SUITE_CHILD") != "1":
        os.environ["COMMGRAD_SUITE_CHILD"] = "1"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])

    names = _all_tests()
    if args.list:
        print("\n".join(names))
        return 0
    if args.tests:
        wanted = [t.strip() for t in args.tests.split(",") if t.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            p.error(f"not tests of the suite: {', '.join(unknown)}")
        names = wanted
    outcomes = _run(names)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: {"outcome": o, "detail": d} for n, (o, d) in sorted(outcomes.items())}, f, indent=1)
    counts = {}
    for o, _ in outcomes.values():
        counts[o] = counts.get(o, 0) + 1
    print(f"suite on {args.backend} at {args.world_size} ranks: " +
          ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
