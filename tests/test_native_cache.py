"""The native library's cache key: one build, and one self-test verdict, per
libmxnet.so. The CPU and GPU wheels are both MXNet 1.9.1; two environments
that share one cache (a CPU and a GPU venv under one home directory) must
never load each other's build. Simulated here with two mxnet folders; CI's
GPU stage runs the real two venvs on one cache."""
import os

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
