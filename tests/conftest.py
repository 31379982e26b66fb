import pytest

from tests.devices import count_gpus, hide_gpus
from tests.pool import RankPool

# A failed assert in tests/helpers.py shows its values, as one in a test module does.
pytest.register_assert_rewrite("tests.helpers")
hide_gpus()

_pools: dict[int, RankPool] = {}


def pool(world: int) -> RankPool:
    """The session's pool of ``world`` ranks (re-created if a hang killed it)."""
    existing = _pools.get(world)
    if existing is None or not existing.alive:
        _pools[world] = RankPool(world)
    return _pools[world]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` (``gpus=N``: N of them) are skipped where fewer GPUs are present."""
    wanted = [item for item in items if item.get_closest_marker("cuda")]
    if not wanted:
        return
    gpus = count_gpus()
    for item in wanted:
        needed = item.get_closest_marker("cuda").kwargs.get("gpus", 1)
        if gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} NVIDIA GPU(s), this machine has {gpus}"))


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
