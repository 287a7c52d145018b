"""Head gradients of another dtype than the layer's output.

``autograd.backward(ys, heads)`` accepts heads of any dtype (MXNet's own
nn.BatchNorm then refuses a mismatch), and AMP-style code passes float16
heads for float32 outputs. On every code path (conftest.PATHS), for float32
and float64 networks, channels on axis 1 or last, imperative, hybridized and
static: a float head gives
exactly the float64 maths' output and input gradient (inputs and heads are
exact in every float dtype), in the network's dtype; an integer head is
either used as given or refused with an error naming the layer and the dtype.
A native operator that read a float16 head as float32 got relative errors of
1e30 and more, reading past the end of the buffer.
"""
import pytest

from tests.conftest import PATHS, result_of, run_batch

FLOAT_HEADS = ['float16', 'bfloat16', 'float32', 'float64']
TOLERANCE = {'float32': 1e-6, 'float64': 1e-12}  # one rounding of the output
CASES = [dict(out_dtype=out, hybridize=mode, heads=FLOAT_HEADS + ['int32'], axis=axis)
         for out, axis in (('float32', 1), ('float64', 1), ('float32', 3))
         for mode in (False, True, 'static')]


@pytest.fixture(scope='module', params=list(PATHS))
def results(request):
    return run_batch([('head_dtypes', case) for case in CASES], timeout=300,
                     env=PATHS[request.param])


@pytest.mark.parametrize('case', range(len(CASES)),
                         ids=['%(out_dtype)s-%(hybridize)s-axis%(axis)d' % c for c in CASES])
def test_head_of_any_float_dtype_gives_exact_gradients(results, case):
    result = result_of(results, case)
    tolerance = TOLERANCE[CASES[case]['out_dtype']]
    for head in FLOAT_HEADS:
        got = result[head]
        assert 'message' not in got, (head, got)
        assert got['y'] < tolerance and got['dx'] < tolerance, (head, got)
        assert got['dx_dtype_ok'] == 1.0, (head, got)


@pytest.mark.parametrize('case', range(len(CASES)),
                         ids=['%(out_dtype)s-%(hybridize)s-axis%(axis)d' % c for c in CASES])
def test_integer_head_is_used_as_given_or_refused_by_name(results, case):
    got = result_of(results, case)['int32']
    if 'message' in got:
        assert "SyncBatchNorm 'syncbatchnorm" in got['message'], got
        assert 'int32' in got['message'] and 'Cast it' in got['message'], got
    else:
        tolerance = TOLERANCE[CASES[case]['out_dtype']]
        assert got['y'] < tolerance and got['dx'] < tolerance, got
