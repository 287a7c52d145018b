"""sync_groups: devices normalize within groups, each group exactly as an
independent run on its devices would (float64 maths per group). Across
processes: test_multiprocess (groups per worker and across workers)."""
import pytest

from gluon_syncbn.errors import SyncBatchNormError
from gluon_syncbn.groups import check_sync_groups, partition
from tests.conftest import OPERATOR_PATHS, PATHS, result_of, run_batch, run_scenario

EXACT = 1e-5
GROUPS = [[[0, 1], [2, 3]], 2, [[0, 3], [1], [2]], 1, [[3, 2, 1, 0]]]
MODES = [False, 'static']
CASES = [(i, m) for i in range(len(GROUPS)) for m in MODES]


@pytest.fixture(scope='module', params=OPERATOR_PATHS)
def results(request):
    return run_batch([('sync_groups_layer', dict(sync_groups=GROUPS[i], hybridize=m))
                      for i, m in CASES], timeout=300, env=PATHS[request.param])


@pytest.mark.parametrize('index,hybridize', CASES)
def test_each_group_normalizes_with_its_own_statistics(results, index, hybridize):
    errs = result_of(results, CASES.index((index, hybridize)))
    for name in ('y', 'dx', 'dgamma', 'dbeta', 'running_mean', 'running_var'):
        assert errs[name] < EXACT, (GROUPS[index], name, errs)


def test_group_sizes_and_lists_become_partitions():
    assert partition(check_sync_groups(2), 4, 'bn') == [[0, 1], [2, 3]]
    assert partition(check_sync_groups(None), 3, 'bn') == [[0, 1, 2]]
    assert partition(check_sync_groups([(1, 0), [2]]), 3, 'bn') == [[1, 0], [2]]


@pytest.mark.parametrize('value', [0, [[0, 1], [1, 2]], [[]], 'two', [[-1, 0]]])
def test_malformed_groups_are_refused_at_construction(value):
    with pytest.raises(ValueError, match='sync_groups'):
        check_sync_groups(value)


@pytest.mark.parametrize('value,devices,expected', [
    (3, 4, 'does not divide the 4 devices'),
    ([[0, 1], [2]], 4, 'missing: [3]'),
    ([[0, 1], [2, 3, 4]], 4, 'no such device: [4]'),
])
def test_groups_that_do_not_tile_the_devices_name_the_problem(value, devices, expected):
    with pytest.raises(SyncBatchNormError, match=r"'bn'.*") as info:
        partition(check_sync_groups(value), devices, 'bn')
    assert expected in str(info.value)


def test_a_layer_whose_groups_do_not_tile_its_contexts_fails_at_its_first_call():
    r = run_scenario('misconfigured', timeout=120, problem='sync_groups')
    assert r['type'] == 'SyncBatchNormError', r
    assert "'syncbatchnorm0'" in r['message'] and 'no such device: [2]' in r['message']
