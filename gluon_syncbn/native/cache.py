"""Where the native library and its self-test verdicts live, and whether
they can be trusted.

A library loaded into the process runs its code in every training job that
loads it, so whoever can write it, or a directory on the way to it, can run
code in those jobs, and whoever can write a verdict can make an untested
library look tested. So the library and its verdicts are used only where
nobody else can change them: the files and every directory from them up to
the cache's root owned by this user and writable by nobody else (group and
others have no write bit). The directories this module creates are 0700.
A verdict records the SHA-256 of the library it was reached on, and a
library whose digest differs from a verdict's is not loaded.

Where the cache cannot be trusted (``GLUON_SYNCBN_CACHE`` set to a shared
directory, say, or a file in it handed to another user), the library is
built in a private place instead, with one warning naming the path and the
reason: the user's own default cache if that can be trusted, else a new
temporary directory of this process's (0700). Refusing outright would stop
every job that synchronizes for a problem of where the cache is; building
privately costs one build (about 30 s) where it happens, and the warning
says how to end it.
"""
import glob
import hashlib
import os
import pwd
import stat
import tempfile

__all__ = ['CACHE_VARIABLE', 'root', 'default_root', 'untrusted', 'make_directories',
           'private_root', 'digest', 'verdicts', 'read_verdict', 'write_verdict']

CACHE_VARIABLE = 'GLUON_SYNCBN_CACHE'
_DIGEST = 'sha256 '  # a verdict's first line: 'sha256 <hex digest of the library>'


def default_root():
    """``$XDG_CACHE_HOME/gluon_syncbn``, or ``~/.cache/gluon_syncbn``."""
    return os.path.join(os.environ.get('XDG_CACHE_HOME') or
                        os.path.join(os.path.expanduser('~'), '.cache'), 'gluon_syncbn')


def root():
    """The cache's root: ``$GLUON_SYNCBN_CACHE``, else :func:`default_root`."""
    return os.path.abspath(os.environ.get(CACHE_VARIABLE) or default_root())


def _owner(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return 'uid %d' % uid


def _problem(path):
    """Why ``path`` (which exists) cannot be trusted, or ''."""
    info = os.stat(path)
    me = os.geteuid()
    if info.st_uid != me:
        return '%s is owned by %s, not by %s' % (path, _owner(info.st_uid), _owner(me))
    writable = [who for who, bit in (('its group', stat.S_IWGRP), ('others', stat.S_IWOTH))
                if info.st_mode & bit]
    if writable:
        return '%s can be written by %s (mode %o)' % (path, ' and '.join(writable),
                                                      stat.S_IMODE(info.st_mode))
    return ''


def untrusted(library, cache_root):
    """Why ``library``, its verdicts or a directory from them up to
    ``cache_root`` could be changed by somebody else, or '' (also where
    none of them exists yet)."""
    directory, paths = os.path.dirname(library), [library] + verdicts(library)
    cache_root = os.path.abspath(cache_root)
    while True:
        paths.append(directory)
        if directory == cache_root or os.path.dirname(directory) == directory:
            break
        directory = os.path.dirname(directory)
    for path in paths:
        if os.path.exists(path):
            why = _problem(path)
            if why:
                return why
    return ''


def make_directories(directory, cache_root):
    """``directory`` and those above it up to ``cache_root``, each made 0700
    where it is missing (those above the cache's root as any program makes
    them)."""
    os.makedirs(os.path.dirname(os.path.abspath(cache_root)), exist_ok=True)
    missing = []
    while not os.path.isdir(directory) and directory != os.path.dirname(directory):
        missing.append(directory)
        if os.path.abspath(directory) == os.path.abspath(cache_root):
            break
        directory = os.path.dirname(directory)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue  # another process made it
        os.chmod(path, 0o700)  # whatever the umask


def private_root(cache_root):
    """A cache root only this user can change, for a cache that cannot be
    trusted: the default one where it differs and can be trusted, else a new
    temporary directory (0700)."""
    default = os.path.abspath(default_root())
    if default != os.path.abspath(cache_root) and not (os.path.exists(default)
                                                        and _problem(default)):
        return default
    return tempfile.mkdtemp(prefix='gluon_syncbn-')


def digest(library):
    """The library's SHA-256, hex."""
    sha = hashlib.sha256()
    with open(library, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            sha.update(block)
    return sha.hexdigest()


def verdicts(library):
    """The self-test verdicts kept beside ``library``."""
    return sorted(glob.glob(glob.escape(library) + '.*.selftest'))


def read_verdict(marker):
    """``(digest, verdict)`` kept in ``marker``."""
    with open(marker) as f:
        head, _, verdict = f.read().partition('\n')
    return head[len(_DIGEST):].strip(), verdict


def write_verdict(marker, library_digest, verdict):
    """Keep ``verdict`` on the library of ``library_digest`` in ``marker``,
    atomically (other processes read all of it or nothing), mode 0600."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(marker))
    with os.fdopen(fd, 'w') as f:
        f.write(_DIGEST + library_digest + '\n' + verdict)
    os.replace(tmp, marker)
