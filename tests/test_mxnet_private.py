"""The catalogue in ``mxnet_private``'s docstring lists every reliance on
MXNet's internals: each private name of MXNet's the package's Python uses,
and each mangled C++ symbol anywhere in the package, appears there."""
import os
import re

import mxnet as mx
from mxnet import gluon

import gluon_syncbn
from gluon_syncbn import mxnet_private

PACKAGE = os.path.dirname(gluon_syncbn.__file__)


def _sources(*extensions):
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(extensions):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield os.path.relpath(path, PACKAGE), f.read()


def _private_names(obj):
    names = set(dir(obj)) | set(getattr(obj, '__dict__', {}))
    return {n for n in names if n.startswith('_') and not n.startswith('__')}


def mxnet_private_names():
    """The private attributes of the MXNet objects the package touches: its
    classes, instances of them (fields made in ``__init__``) and modules."""
    param = gluon.Parameter('p', shape=(1,))
    param.initialize()
    params = gluon.ParameterDict()
    params._params['p'] = param
    objects = [
        gluon.Block(), gluon.HybridBlock(), gluon.nn.BatchNorm(), gluon.nn.BatchNorm,
        gluon.SymbolBlock, param, params, gluon.Trainer(params, 'sgd'), mx.nd.ones(1),
        mx.nd.CachedOp, mx.autograd, mx.base, mx.ndarray.register, mx.symbol.register,
        gluon.nn.basic_layers, gluon.data.DataLoader, mx.kv.create('local'),
        mx.module.executor_group.DataParallelExecutorGroup]
    from mxnet.contrib.amp import amp
    objects.append(amp)
    return set().union(*(_private_names(o) for o in objects))


# Our own attributes that share a name with one of MXNet's (transport.py's
# weak reference to the user's kvstore), and the marks hooks leave on what
# they patched.
OURS = {'_kvstore'}


def test_every_private_mxnet_name_used_is_catalogued():
    known = mxnet_private_names() - OURS
    used = {}
    for path, text in _sources('.py'):
        for name in re.findall(r'(?:\.|\bimport )(_[A-Za-z]\w*)\b', text):
            if name in known and not name.startswith('_gluon_syncbn'):
                used.setdefault(name, path)
    assert len(used) > 10, 'the scan finds almost nothing: it no longer works'
    missing = {n: p for n, p in used.items()
               if not re.search(r'(?<!\w)%s(?!\w)' % n, mxnet_private.__doc__)}
    assert not missing, ('MXNet private names used but not in the catalogue '
                         '(gluon_syncbn/mxnet_private.py): %s' % missing)


def test_every_mangled_symbol_is_catalogued():
    used = {}
    for path, text in _sources('.py', '.h', '.cc'):
        for symbol in re.findall(r"_Z[A-Za-z0-9_]{8,}", text):
            used.setdefault(symbol, path)
    assert used, 'the scan finds nothing: it no longer works'
    doc = mxnet_private.__doc__.replace('\n', '').replace(' ', '')
    missing = {s: p for s, p in used.items() if s not in doc and s[:40] not in doc}
    assert not missing, 'mangled symbols not in the catalogue: %s' % missing
