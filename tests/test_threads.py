"""Real clients call the layer from one Python thread per device.

GluonCV's segmentation and detection scripts (``--syncbn``) run the network
through ``DataParallelModel`` / ``DataParallelCriterion(sync=True)``, whose
``parallel_apply`` starts one Python thread per device; each thread calls the
network inside ``autograd.record()`` and waits for its output. Here GluonCV's
own ``parallel_apply`` drives a float64 network whose first synchronized call
comes from those threads, each case in a fresh process (one-time setup is
where races live), on every backend, 2 and 4 devices, uneven slices,
imperative and hybridized, against float64 maths on the whole batch.
``tests/soak_threads.py`` runs the first call many times over.
"""
import pytest

from tests.conftest import PATH_OPERATOR, ScenarioFailed, needs_gluoncv, run_scenario

EXACT = 1e-12  # float64 throughout
# A wait that ends the case long before its process's deadline, were it to hang.
TIMEOUT = {'GLUON_SYNCBN_TIMEOUT': '60'}


@needs_gluoncv
@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
@pytest.mark.parametrize('num_devices,batch', [(2, 7), (4, 10)], ids=['N2', 'N4'])
def test_first_step_from_gluoncv_threads(operator, num_devices, batch, hybridize):
    r = run_scenario('gluoncv_threads', timeout=150, env=TIMEOUT, num_devices=num_devices,
                     batch=batch, hybridize=hybridize)
    assert r['operator'] == PATH_OPERATOR[operator] and r['warnings'] == 0, r
    assert len(r['slices']) == num_devices and len(set(r['slices'])) > 1, r  # uneven
    for what in ('dx', 'running_mean', 'running_var'):
        assert r[what] < EXACT, (what, r)


@needs_gluoncv
@pytest.mark.parametrize('seed', range(4))
def test_a_failing_thread_ends_its_step_at_once_for_every_thread(operator, seed):
    """In each of 13 steps one device's thread raises in user code; the
    others start after it failed, or at once and 0-20 ms apart, their calls
    racing with the failure (13 steps x 4 processes x each operator path:
    over 100). Every step fails at once (not after the 60 s timeout), the
    user sees the failing thread's own exception, and the steps after are
    exact. (Fewer steps per process: MXNet gives each new Python thread
    resources of its own, about 80 MB here, which it does not free.)"""
    r = run_scenario('gluoncv_threads', timeout=240, env=TIMEOUT, num_devices=2, batch=7,
                     fail=13, seed=seed)
    assert r['failed'] == 'ValueError: user code failed on cpu(0)', r
    assert r['wrong'] == [], r
    assert r['failed_seconds'] < 10, r
    for what in ('dx', 'running_mean', 'running_var'):
        assert r[what] < EXACT, (what, r)


@needs_gluoncv
@pytest.mark.parametrize('backend', ['auto', 'async'])
def test_threads_get_the_error_when_the_library_cannot_be_had(tmp_path, backend):
    # The build fails in whichever thread comes first; every device's thread
    # then raises the reason at once, none waits for the others.
    env = dict(TIMEOUT, CXX=str(tmp_path / 'no-such-compiler'), GLUON_SYNCBN_BACKEND=backend,
               GLUON_SYNCBN_CACHE=str(tmp_path / 'cache'))
    with pytest.raises(ScenarioFailed) as failed:
        run_scenario('gluoncv_threads', timeout=60, env=env, num_devices=4, batch=10)
    head = ('the native operators are required' if backend == 'auto'
            else 'GLUON_SYNCBN_BACKEND=async')
    assert head + ', but the native library is not available: no C++ compiler' \
        in str(failed.value), str(failed.value)[-3000:]
