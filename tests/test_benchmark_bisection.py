"""The benchmarks' bisection (benchmarks/common.largest): what every 'largest batch' and
'deepest network' record rests on."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import largest  # noqa: E402


def probing(fits):
    probed = []

    def probe(n):
        probed.append(n)
        return fits(n)
    return probe, probed


def test_finds_the_largest_within_the_tolerance():
    probe, _ = probing(lambda n: n <= 1000)
    n, exact = largest(probe, 300, tolerance=0.03)
    assert exact and 970 <= n <= 1000


def test_starts_lower_when_the_start_does_not_fit():
    probe, _ = probing(lambda n: n <= 70)
    n, exact = largest(probe, 300, tolerance=0.03)
    assert exact and 68 <= n <= 70


def test_never_probes_at_or_above_a_known_bound():
    probe, probed = probing(lambda n: n <= 910)
    n, exact = largest(probe, 864, bound=945, tolerance=0.03)
    assert exact and 883 <= n <= 910
    assert max(probed) < 945


def test_looks_above_when_fitting_is_not_monotone():
    """A larger batch may get a plan that fits where a smaller one's did not."""
    probe, probed = probing(lambda n: n <= 300 or 360 <= n <= 400)
    n, exact = largest(probe, 160, tolerance=0.03)    # doubling lands on 320: does not fit
    assert 320 in probed and 375 in probed              # 1.25 x 300 does
    assert exact and 388 <= n <= 400


def test_a_spent_time_limit_says_the_result_is_not_exact():
    probe, _ = probing(lambda n: n <= 1000)
    n, exact = largest(probe, 100, seconds=0)
    assert not exact and probe(n)
