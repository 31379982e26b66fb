import pytest

from tests.pool import RankPool

_pools: dict[int, RankPool] = {}


def pool(world: int) -> RankPool:
    """The session's pool of ``world`` ranks (re-created if a hang killed it)."""
    existing = _pools.get(world)
    if existing is None or not existing.alive:
        _pools[world] = RankPool(world)
    return _pools[world]


@pytest.fixture
def pool4() -> RankPool:
    return pool(4)


@pytest.fixture
def pool8() -> RankPool:
    return pool(8)


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()


@pytest.fixture
def pool16() -> RankPool:
    return pool(16)


@pytest.fixture
def pool3() -> RankPool:
    return pool(3)


@pytest.fixture
def pool2() -> RankPool:
    return pool(2)
