"""Bad input gives an error naming op, rank, group and shapes on every rank,
never a hang; a rank that never arrives or dies fails the others within the
group's timeout; the world group stays usable after rejected calls."""

import re

import pytest


@pytest.mark.parametrize("nproc", [2, 3])
def test_bad_input_and_timeout(run, nproc):
    # Also: coalesced calls rejected on different ranks, wait(timeout),
    # monitored_barrier (at 3 ranks, a rank that came and was not released).
    job = run(nproc, "errors.py", "input")
    for rank in range(nproc):
        passed = re.search(rf"\[rank {rank}\] errors: (\d+) of (\d+) checks passed", job.output)
        assert passed and passed.group(1) == passed.group(2), job.output[-6000:]


def test_dead_peer_is_named(run):
    job = run(2, "errors.py", "dead_peer")
    assert "[rank 0] errors: 1 of 1 checks passed" in job.output, job.output[-4000:]
