"""CI: a CPU and a GPU venv share one GLUON_SYNCBN_CACHE; each must build,
self-test and load its own native library, twice (the second time from the
cache). Usage: shared_cache.py CPU_PYTHON GPU_PYTHON, with the GPU venv's
extra library path (the driver stand-in) in LD_LIBRARY_PATH_GPU."""
import hashlib
import os
import subprocess
import sys
import tempfile

# Which library this process loaded, and the verdict it acted on.
REPORT = '''
import gluon_syncbn
from gluon_syncbn import native
path = native.library_path()
works = native.async_operator() is not None  # builds and loads it, as a layer's first call
with open('/proc/self/maps') as f:
    mapped = sorted({line.split()[-1] for line in f if 'libgluon_syncbn' in line})
assert mapped == [path], (mapped, path)
print('LOADED', path, works)
'''


def run(python, cache, library_path):
    env = dict(os.environ, GLUON_SYNCBN_CACHE=cache, GLUON_SYNCBN_BACKEND='async',
               LD_LIBRARY_PATH=library_path)
    proc = subprocess.run([python, '-c', REPORT], capture_output=True, text=True,
                          timeout=600, env=env, cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))
    lines = [l.split()[1:] for l in proc.stdout.splitlines() if l.startswith('LOADED ')]
    if proc.returncode != 0 or not lines:
        sys.exit('%s failed:\n%s%s' % (python, proc.stdout[-2000:], proc.stderr[-3000:]))
    path, async_ok = lines[0]
    if async_ok != 'True':
        sys.exit('%s: the asynchronous operator failed its self-test (%s.async.selftest)' % (
            python, path))
    return path


def built(cache):
    return sorted(os.path.join(d, f) for d, _, files in os.walk(cache) for f in files)


def main(cpu_python, gpu_python):
    with tempfile.TemporaryDirectory() as cache:
        environments = [(cpu_python, os.environ.get('LD_LIBRARY_PATH', '')),
                        (gpu_python, os.environ['LD_LIBRARY_PATH_GPU'])]
        first = [run(python, cache, extra) for python, extra in environments]
        if first[0] == first[1]:
            sys.exit('both environments loaded %s' % first[0])
        files = built(cache)
        expected = sorted(first + [p + '.async.selftest' for p in first])
        if files != expected:
            sys.exit('the cache holds %s, not %s' % (files, expected))
        for path in first:
            with open(path + '.async.selftest') as f:
                digest, _, verdict = f.read().partition('\n')
            with open(path, 'rb') as f:
                library = 'sha256 ' + hashlib.sha256(f.read()).hexdigest()
            if verdict != 'ok' or digest != library:
                sys.exit('%s.async.selftest is not ok on this library: %r, %r (%s)' % (
                    path, digest, verdict, library))
        again = [run(python, cache, extra) for python, extra in environments]
        if again != first or built(cache) != files:
            sys.exit('the second run did not reuse its own build: %s, %s' % (again,
                                                                            built(cache)))
        print('shared cache: each environment built, self-tested and reloaded its own '
              'library:\n  ' + '\n  '.join(first))


if __name__ == '__main__':
    main(*sys.argv[1:3])
