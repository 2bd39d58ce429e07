import sys

sys.path.insert(0, "/app")


def test_small():
    from primes import primes

    assert primes(20) == [2, 3, 5, 7, 11, 13, 17, 19]


def test_edges():
    from primes import primes

    assert primes(2) == [] and primes(3) == [2]
