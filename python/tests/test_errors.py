"""Bad input gives an error naming op, rank, group and shapes on every rank,
never a hang; a rank that never arrives or dies fails the others within the
group's timeout; the world group stays usable after rejected calls."""


def test_bad_input_and_timeout(run):
    job = run(2, "errors.py", "input")
    assert "[rank 0] errors: 7 of 7 checks passed" in job.output, job.output[-4000:]
    assert "[rank 1] errors: 6 of 6 checks passed" in job.output, job.output[-4000:]


def test_dead_peer_is_named(run):
    job = run(2, "errors.py", "dead_peer")
    assert "[rank 0] errors: 1 of 1 checks passed" in job.output, job.output[-4000:]
