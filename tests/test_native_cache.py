"""The native library's cache key: one build, and one self-test verdict, per
libmxnet.so. The CPU and GPU wheels are both MXNet 1.9.1; two environments
that share one cache (a CPU and a GPU venv under one home directory) must
never load each other's build. Simulated here with two mxnet folders; CI's
GPU stage runs the real two venvs on one cache."""
import glob
import os
import pwd
import stat

import pytest

from gluon_syncbn import native


@pytest.fixture
def environments(tmp_path, monkeypatch):
    """Two mxnet folders of the same version, one cache; returns a function
    giving the library path of environment ``name``."""
    for name, size in (('cpu-venv', 150), ('gpu-venv', 890)):
        folder = tmp_path / name / 'mxnet'
        folder.mkdir(parents=True)
        (folder / 'libmxnet.so').write_bytes(b'\x7fELF' + b'\0' * size)
    monkeypatch.setenv(native.CACHE_VARIABLE, str(tmp_path / 'cache'))

    def library_path(name):
        monkeypatch.setattr(native, '_mxnet_dir',
                            lambda: (str(tmp_path / name / 'mxnet'), '1.9.1'))
        return native.library_path()
    return library_path


def test_two_environments_never_share_a_build(environments):
    cpu, gpu = environments('cpu-venv'), environments('gpu-venv')
    assert cpu != gpu
    # ... nor the self-test's verdict, which lives beside the build.
    assert cpu + '.async.selftest' != gpu + '.async.selftest'
    # Each environment finds its own build again.
    assert environments('cpu-venv') == cpu and environments('gpu-venv') == gpu
    assert os.path.dirname(cpu) == os.path.dirname(gpu)  # one cache, one MXNet version


def test_the_same_size_elsewhere_is_another_build(environments, tmp_path):
    # Same size, same bytes, another environment: still its own build (the
    # library links against its own folder's libmxnet.so).
    other = tmp_path / 'copy-venv' / 'mxnet'
    other.mkdir(parents=True)
    source = tmp_path / 'cpu-venv' / 'mxnet' / 'libmxnet.so'
    (other / 'libmxnet.so').write_bytes(source.read_bytes())
    os.utime(str(other / 'libmxnet.so'), ns=(os.stat(str(source)).st_atime_ns,
                                             os.stat(str(source)).st_mtime_ns))
    assert environments('copy-venv') != environments('cpu-venv')


def test_reinstalling_the_wheel_rebuilds(environments, tmp_path):
    before = environments('gpu-venv')
    library = tmp_path / 'gpu-venv' / 'mxnet' / 'libmxnet.so'
    info = os.stat(str(library))
    os.utime(str(library), ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    assert environments('gpu-venv') != before


def test_a_symlinked_environment_is_the_same_build(environments, tmp_path):
    # A venv reached through a symlink links against the same file.
    os.symlink(str(tmp_path / 'gpu-venv'), str(tmp_path / 'gpu-link'))
    assert environments('gpu-link') == environments('gpu-venv')


# ------------------------------------------------------ who can change the cache
# Each case: a cache holding a built library and its verdicts, made
# untrustworthy in one way; a fresh process then loads the library. Its
# build is a copy of the suite's own (monkeypatched), so no case compiles.
LOAD = '''
import shutil, warnings, sys
warnings.simplefilter('always')
from gluon_syncbn import native
from gluon_syncbn.native import cache
built = []
native.build = lambda path, root: (built.append(path), cache.make_directories(
    __import__('os').path.dirname(path), root), shutil.copy(%(good)r, path))
if %(no_private)r:
    cache.private_root = lambda root: %(no_private)r
with warnings.catch_warnings(record=True) as caught:
    lib = native.load()
print('LOADED', lib is not None)
print('PATH', native.status()['path'])
print('WHY_NOT', native.status()['why_not'])
print('BUILT', built)
for w in caught:
    print('WARNING', str(w.message).replace('\\n', ' '))
'''


@pytest.fixture
def caches(tmp_path):
    """A shared cache holding the suite's build and its verdicts, and an
    empty home for the user's own default cache."""
    import shutil
    from tests.conftest import run_python
    out = run_python('from gluon_syncbn import native; native.load(); native.async_operator();'
                     'print("PATH", native.status()["path"])', timeout=600)
    good = [l.split(None, 1)[1] for l in out.stdout.splitlines() if l.startswith('PATH ')][0]
    shared, home = tmp_path / 'shared', tmp_path / 'home'
    home.mkdir()
    name = os.path.relpath(good, os.path.dirname(os.path.dirname(good)))
    library = shared / name
    library.parent.mkdir(parents=True)
    shutil.copy(good, str(library))
    for marker in glob.glob(glob.escape(good) + '.*.selftest'):
        shutil.copy(marker, str(library) + marker[len(good):])

    def load(no_private=''):
        return run_python(LOAD % dict(good=good, no_private=no_private), timeout=120,
                          env={native.CACHE_VARIABLE: str(shared), 'XDG_CACHE_HOME': str(home)})
    return {'shared': shared, 'library': library, 'home': home, 'load': load}


def lines(out, key):
    return [l.split(None, 1)[1] for l in out.stdout.splitlines() if l.startswith(key + ' ')]


def test_a_new_cache_is_made_private(tmp_path):
    from gluon_syncbn.native import cache
    root = tmp_path / 'not' / 'yet' / 'cache'  # nor its parents
    library = root / 'mxnet-1.9.1' / 'libgluon_syncbn-x.so'
    old = os.umask(0o022)
    try:
        cache.make_directories(str(library.parent), str(root))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(str(root)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(str(library.parent)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(str(root.parent)).st_mode) == 0o755  # not ours to close
    assert cache.untrusted(str(library), str(root)) == ''


def test_a_cache_only_you_can_write_is_used(caches):
    out = caches['load']()
    assert lines(out, 'LOADED') == ['True'], out.stderr[-3000:]
    assert lines(out, 'PATH') == [str(caches['library'])], out.stdout
    assert lines(out, 'BUILT') == ['[]'] and not lines(out, 'WARNING'), out.stdout


@pytest.mark.parametrize('change', ['directory world-writable', 'root group-writable',
                                    'library world-writable', 'library foreign-owned',
                                    'verdict foreign-owned', 'directory foreign-owned'])
def test_a_cache_somebody_else_can_change_is_not_loaded(caches, change):
    what, how = change.split(' ', 1)
    path = {'directory': caches['library'].parent, 'root': caches['shared'],
            'library': caches['library'],
            'verdict': glob.glob(str(caches['library']) + '.*.selftest')[0]}[what]
    if how == 'foreign-owned':
        if os.geteuid() != 0:
            pytest.skip('making a file foreign-owned needs root')
        os.chown(str(path), pwd.getpwnam('nobody').pw_uid, -1)
        reason = '%s is owned by nobody' % path
    else:
        os.chmod(str(path), 0o777 if how == 'world-writable' else 0o775)
        reason = '%s can be written by %s' % (
            path, 'its group and others' if how == 'world-writable' else 'its group')
    out = caches['load']()
    assert lines(out, 'LOADED') == ['True'], out.stderr[-3000:]
    private = caches['home'] / 'gluon_syncbn'
    loaded = lines(out, 'PATH')[0]
    assert loaded.startswith(str(private) + os.sep), out.stdout  # the user's own cache
    assert lines(out, 'BUILT') == [str([loaded])], out.stdout
    warning, = lines(out, 'WARNING')
    assert reason in warning and str(caches['shared']) in warning, warning
    assert 'built in %s instead' % private in warning and native.CACHE_VARIABLE in warning
    for directory in (private, os.path.dirname(loaded)):  # made private
        assert stat.S_IMODE(os.stat(str(directory)).st_mode) == 0o700


def test_with_no_private_place_the_reason_is_given(caches, tmp_path):
    os.chmod(str(caches['shared']), 0o777)
    nowhere = tmp_path / 'nowhere'
    nowhere.mkdir(mode=0o777)
    os.chmod(str(nowhere), 0o777)
    out = caches['load'](no_private=str(nowhere))
    assert lines(out, 'LOADED') == ['False'], out.stdout
    assert lines(out, 'WHY_NOT') == [
        'no place to keep it can be trusted: %s can be written by its group and others '
        '(mode 777)' % nowhere], out.stdout


def test_a_library_its_verdict_was_not_reached_on_is_not_loaded(caches):
    with open(str(caches['library']), 'ab') as f:
        f.write(b'\0')  # changed after its self-test
    out = caches['load']()
    assert lines(out, 'LOADED') == ['True'], out.stderr[-3000:]
    assert lines(out, 'BUILT') == [str([str(caches['library'])])], out.stdout  # built again
    warning, = lines(out, 'WARNING')
    assert 'is not the library its self-test verdict' in warning, warning
    assert not glob.glob(str(caches['library']) + '.*.selftest')  # the stale verdicts went
