"""A collected layer takes its backend with it: its native state, and
nothing hangs when that happens at an awkward moment."""

from tests.conftest import run_python


def test_a_collected_layer_leaves_nothing_behind():
    # A layer's backend goes at whatever allocation triggers a garbage
    # collection, e.g. inside Session.live_backends while a failing step's
    # clearing walks the backends (seen: 1 in about 50 runs of a fault case
    # hung there when that walk held a lock the collection wanted).
    code = ('import gc, time, weakref, gluon_syncbn, mxnet as mx\n'
            'gluon_syncbn.configure_cpu_contexts(2)\n'
            'from mxnet import autograd\n'
            'from gluon_syncbn.session import SESSION\n'
            'def layer():\n'
            '    bn = gluon_syncbn.SyncBatchNorm(in_channels=3)\n'
            '    bn.initialize(ctx=[mx.cpu(0), mx.cpu(1)])\n'
            '    with autograd.record():\n'
            '        ys = [bn(mx.nd.ones((2, 3), ctx=c)) for c in (mx.cpu(0), mx.cpu(1))]\n'
            '    mx.nd.waitall()\n'
            '    return bn, weakref.ref(bn._sync_backend)\n'
            'bn, gone = layer()\n'
            'del bn\n'
            'SESSION.live_backends()\n'
            'deadline = time.time() + 10\n'
            'while gone() is not None and time.time() < deadline:\n'
            '    mx.nd.waitall(); gc.collect(); time.sleep(0.01)\n'
            'kept = layer()\n'
            'print("REMOVED", gone() is None, kept[1]() is not None,\n'
            '      SESSION.live_backends() == [kept[1]()])\n')
    for backend in ('async', 'exchange'):
        out = run_python(code, timeout=60, env={'GLUON_SYNCBN_BACKEND': backend})
        assert 'REMOVED True True True' in out.stdout, (out.stdout + out.stderr)[-3000:]
