"""Print the ``LD_LIBRARY_PATH`` with which the GPU build of mxnet imports on its own.

``import gluon_syncbn`` before ``import mxnet`` loads the CUDA runtime wheels'
libraries itself (:mod:`gluon_syncbn.cuda_libs`). A program that imports
mxnet first, or runs without gluon_syncbn, needs their folders on the library
path::

    export LD_LIBRARY_PATH=$(python -m gluon_syncbn.cuda_path)

It prints those folders followed by the current ``LD_LIBRARY_PATH``; with the
CPU build of mxnet, the current value unchanged (and says why on stderr).
"""
import os
import sys

from .cuda_libs import RUNTIME, mxnet_library, needed_libraries, wheel_library

__all__ = ['library_path']


def library_path(library=None, search=None, current=None):
    """The folders of the wheel libraries ``library`` needs, then ``current``.

    Parameters
    ----------
    library : str, optional
        A ``libmxnet.so`` (default: the one ``import mxnet`` loads).
    search : list of str, optional
        Where to look for NVIDIA's wheels (default: ``sys.path``).
    current : str, optional
        The value to extend (default: ``$LD_LIBRARY_PATH``).

    Returns
    -------
    str
        A ``:``-separated list without repetitions.
    """
    library = library or mxnet_library()
    current = os.environ.get('LD_LIBRARY_PATH', '') if current is None else current
    needed = needed_libraries(library) if library else []
    found = [wheel_library(name, search) for name in RUNTIME if name in needed]
    folders = [os.path.dirname(path) for path in found if path] + current.split(os.pathsep)
    return os.pathsep.join(f for i, f in enumerate(folders) if f and f not in folders[:i])


def main():
    library = mxnet_library()
    if library is None or not set(RUNTIME) & set(needed_libraries(library)):
        sys.stderr.write('gluon_syncbn: %s is not the GPU build of mxnet; nothing to add.\n'
                         % (library or 'mxnet is not installed:'))
    print(library_path(library))


if __name__ == '__main__':
    main()
