"""Every reference in the docs and in the code's comments resolves.

Scanned: docs/*.md, README.md, tests/README.md, benchmarks/README.md,
examples/*/README.md, and every .py/.h/.cc file under gluon_syncbn/, tests/,
benchmarks/ and examples/ (whole text: comments and docstrings, and the
paths the code itself names). The rules, kept simple:

* A file name (``name.py``, ``dir/name.h``, ...: a word ending in one of
  ``EXTENSIONS``) is a file of this repository: relative to the referring
  file, to the root, to ``gluon_syncbn/``, or the end of a tracked path
  (``sync_call.h`` is ``gluon_syncbn/native/sync_call.h``).
* ``file:N`` and ``file:N-M`` point inside the file; ``file:name`` (a
  Python or C++ identifier, dotted for a method: ``graphs.py:Graphs.use``)
  names a definition in it (Python: ``def``/``class``; C++: the last part
  of the name as a whole word). Prefer names to line numbers: they move
  less.
* A file of another project is named by a bare name or path that
  ``EXTERNAL`` maps to its path there: MXNet 1.9.1's from its source root
  (``resource.cc`` is ``src/resource.cc``), others' to None. Paths from
  MXNet's root (``src/...``, ``include/mxnet/...``) need no entry. With
  ``MXNET_SOURCE`` naming an MXNet checkout or a git directory with the tag
  ``1.9.1``, those files and their lines (``:N-M``, or ``N-M`` after the
  name) are checked there; otherwise that test is skipped.
* A markdown link ``[text](path#section)`` names a file that exists and a
  heading of it (GitHub's anchors); ``(#section)`` a heading of the same
  file; ``docs/x.md, section 'Title'`` a heading titled so, and
  ``docs/x.md, "Words"`` a document holding those words (wrapped comments
  read whole).
* design.md's module map names every file of the package, and each name
  in backticks in a module's row (``_bind``, ``hooks.install``) is a word of
  that module's text (of the named module's, when dotted with one).
* ``NOT_FILES`` lists the file names that are no file on purpose (a
  script a test writes, a user's own script in a command line).

No MXNet needed; it reads text only.
"""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOCS = ['README.md', 'tests/README.md', 'benchmarks/README.md']
CODE_DIRS = ['gluon_syncbn', 'tests', 'benchmarks', 'examples']
EXTENSIONS = ('py', 'h', 'cc', 'cu', 'md', 'sh', 'toml')
MXNET_ROOTS = ('src/', 'include/mxnet/', 'python/mxnet/', '3rdparty/')

# Other projects' files the docs and comments name: their path in MXNet
# 1.9.1's source, or None for another project's.
EXTERNAL = {
    'resource.cc': 'src/resource.cc',
    'threaded_engine.h': 'src/engine/threaded_engine.h',
    'threaded_engine.cc': 'src/engine/threaded_engine.cc',
    'c_api_error.cc': 'src/c_api/c_api_error.cc',
    'c_api.h': 'include/mxnet/c_api.h',
    'kvstore_dist.h': 'src/kvstore/kvstore_dist.h',
    'kvstore_dist_server.h': 'src/kvstore/kvstore_dist_server.h',
    'imperative_utils.h': 'src/imperative/imperative_utils.h',
    'cached_op.cc': 'src/imperative/cached_op.cc',
    'cached_op.h': 'src/imperative/cached_op.h',
    'cuda_graphs.h': 'src/executor/cuda_graphs.h',
    'attach_op_resource_pass.cc': 'src/executor/attach_op_resource_pass.cc',
    'batch_norm.cc': 'src/operator/nn/batch_norm.cc',
    'batch_norm.cu': 'src/operator/nn/batch_norm.cu',
    'cudnn/cudnn_batch_norm-inl.h': 'src/operator/nn/cudnn/cudnn_batch_norm-inl.h',
    'custom-inl.h': 'src/operator/custom/custom-inl.h',
    'libinfo.py': 'python/mxnet/libinfo.py',
    'mxnet/libinfo.py': 'python/mxnet/libinfo.py',
    'mxnet/tools/launch.py': 'tools/launch.py',   # the wheel's copy
    'tools/launch.py': 'tools/launch.py',
    'horovod/mxnet/mpi_ops.cc': None,
    'cuda_runtime_api.h': None,
}

# File names that are no file on purpose, and why.
NOT_FILES = {
    'worker.py',   # the script tests/test_launch.py writes
}

_NAME = r'[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*'
REFERENCE = re.compile(
    r'(?<![\w/.<>{}$%*-])'
    r'((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:' + '|'.join(EXTENSIONS) + r'))'
    r'(?![\w/-]|\.\w)'
    r'(?::(\d+)(?:-(\d+))?(?!\d|\.\d)|:(' + _NAME + r'))?')
MXNET_LINES = re.compile(r'`{0,2},? (\d+)(?:-(\d+))?(?![\d.]*\s*(?:ms|s|MB|GB|%))')
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]*)\)')
SECTION = re.compile(r"([\w./-]+\.md),\s+(?:section\s+'([^']+)'|\"([^\"]+)\")")
URL = re.compile(r'\b(?:https?|file)://\S+')


def _tracked():
    # Files not yet committed count too; ignored and deleted ones do not.
    out = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return sorted(p for p in set(out.stdout.split())
                      if os.path.isfile(os.path.join(ROOT, p)))
    files = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith('.')]
        files += [os.path.relpath(os.path.join(top, n), ROOT) for n in names]
    return files


TRACKED = _tracked()


def _scanned():
    files = [p for p in DOCS if os.path.exists(os.path.join(ROOT, p))]
    files += sorted(p for p in TRACKED if p.startswith('docs/') and p.endswith('.md')
                    and p.count('/') == 1)
    files += sorted(p for p in TRACKED if p.startswith('examples/') and p.endswith('README.md'))
    files += sorted(p for p in TRACKED if p.split('/')[0] in CODE_DIRS
                    and p.endswith(('.py', '.h', '.cc')) and p != 'tests/test_docs.py')
    return files   # this file's planted references are not scanned


def resolve(path, referrer):
    """The repository path ``path`` names from ``referrer``, else None."""
    here = os.path.dirname(referrer)
    for candidate in (os.path.join(here, path), path, os.path.join('gluon_syncbn', path)):
        candidate = os.path.normpath(candidate)
        if os.path.exists(os.path.join(ROOT, candidate)):
            return candidate
    ends = [p for p in TRACKED if p == path or p.endswith('/' + path)]
    return ends[0] if ends else None


def has_definition(path, name, text):
    """Whether ``name`` (dotted for a method) is defined in ``path``."""
    parts = name.split('.')
    if path.endswith('.py'):
        return all(re.search(r'^\s*(?:def|class)\s+%s\b' % re.escape(p), text, re.M)
                   or re.search(r'^\s*%s\s*=' % re.escape(p), text, re.M) for p in parts)
    return re.search(r'\b%s\b' % re.escape(parts[-1]), text) is not None


def headings(text):
    """The titles of the headings of a markdown text."""
    out = []
    in_code = False
    for line in text.splitlines():
        if line.startswith('```'):
            in_code = not in_code
        m = re.match(r'#{1,6}\s+(.*?)\s*#*\s*$', line)
        if m and not in_code:
            out.append(m.group(1))
    return out


def anchors(text):
    """GitHub's anchors of the headings of a markdown text."""
    out = set()
    for heading in headings(text):
        title = re.sub(r'[`*_]|\[([^\]]*)\]\([^)]*\)', r'\1', heading).lower()
        slug = re.sub(r'[^\w\- ]', '', title).replace(' ', '-')
        base, n = slug, 1
        while slug in out:
            slug, n = '%s-%d' % (base, n), n + 1
        out.add(slug)
    return out


def _read(path):
    with open(os.path.join(ROOT, path), encoding='utf-8') as f:
        return f.read()


def problems(path, text, mxnet=None):
    """Every reference in ``text`` (the content of ``path``) that does not
    resolve, as 'path:line: why' strings. MXNet's paths are checked with
    ``mxnet`` (path -> its text or None) when given, else left alone."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = URL.sub('', line)
        where = '%s:%d: ' % (path, number)
        for m in REFERENCE.finditer(line):
            ref, first, last, name = m.groups()
            if os.path.basename(ref) in NOT_FILES:
                continue
            target = resolve(ref, path)
            if target is None:
                external = EXTERNAL.get(ref, ref if ref.startswith(MXNET_ROOTS) else False)
                if external is False:
                    found.append(where + '%s: no such file (another project\'s: add it to '
                                 'EXTERNAL)' % ref)
                    continue
                if external is None or mxnet is None:
                    continue
                if not (first or name):
                    # MXNet's lines may also follow its file's name:
                    # ``resource.cc`` 128-135 (ours must use file:N-M).
                    lines = MXNET_LINES.match(line, m.end())
                    first, last = lines.groups() if lines else (None, None)
                target_text = mxnet(external)
                if target_text is None:
                    found.append(where + '%s (%s) is not in MXNet 1.9.1' % (ref, external))
                    continue
            elif first or name:
                target_text = _read(target)
            else:
                continue
            if first:
                lines = target_text.count('\n') + 1
                a, b = int(first), int(last or first)
                if not 1 <= a <= b <= lines:
                    found.append(where + '%s:%s-%s: outside its %d lines' % (ref, a, b, lines)
                             + (' (MXNet)' if target is None else ''))
            elif name and not has_definition(ref, name, target_text):
                found.append(where + '%s defines no %s' % (ref, name) + (' (MXNet)' if target is None else ''))
        if not path.endswith('.md'):
            continue
        for m in LINK.finditer(line):
            target, _, section = m.group(1).partition('#')
            if re.match(r'\w+:', target):
                continue
            if target:
                full = os.path.normpath(os.path.join(os.path.dirname(path), target))
                if not os.path.exists(os.path.join(ROOT, full)):
                    found.append(where + 'link to missing %s' % target)
                    continue
            else:
                full = path
            if section and section not in anchors(_read(full) if full != path else text):
                found.append(where + 'link to missing section %s#%s' % (target, section))
    found += _named_sections(path, text)
    return found


def _flat(text):
    """``text`` as one line: comment markers at line starts dropped, so that
    a reference wrapped over lines of a comment reads whole."""
    return ' '.join(re.sub(r'^\s*(?:#+|//+|\*|\"\"\")?\s*', '', line)
                    for line in text.splitlines())


def _named_sections(path, text):
    """``doc.md, section 'Title'`` and ``doc.md, "Title"``: the document
    exists and has a heading (or, for a quoted title, a text) of that name."""
    found = []
    for m in SECTION.finditer(_flat(text)):
        doc, title, quoted = m.group(1), m.group(2) or m.group(3), m.group(3)
        target = resolve(doc, path)
        if target is None:
            found.append('%s: %s: no such file' % (path, doc))
            continue
        target_text = _read(target)
        where = _flat(target_text) if quoted else '\n'.join(headings(target_text))
        if ' '.join(title.split()).lower() not in where.lower():
            found.append('%s: %s has no section %r' % (path, doc, title))
    return found


def test_references_resolve():
    bad = []
    for path in _scanned():
        bad += problems(path, _read(path))
    assert not bad, 'references that do not resolve:\n' + '\n'.join(bad)


def _mxnet_source():
    source = os.environ.get('MXNET_SOURCE')
    if not source:
        return None
    if os.path.exists(os.path.join(source, 'src', 'resource.cc')):
        def read(path):
            full = os.path.join(source, path)
            return _read_abs(full) if os.path.isfile(full) else None
        return read

    def show(path):
        out = subprocess.run(['git', '--git-dir', source, 'show', '1.9.1:' + path],
                             capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else None
    return show


def _read_abs(path):
    with open(path, encoding='utf-8', errors='replace') as f:
        return f.read()


def test_mxnet_references_resolve():
    mxnet = _mxnet_source()
    if mxnet is None:
        pytest.skip('MXNET_SOURCE (an MXNet 1.9.1 checkout or git directory) not set')
    bad = []
    for path in _scanned():
        bad += [p for p in problems(path, _read(path), mxnet) if 'MXNet' in p]
    assert not bad, 'references to MXNet 1.9.1 that do not resolve:\n' + '\n'.join(bad)


def module_map_problems(text):
    """What design.md's module map (in ``text``) says that the package does
    not hold, and the package's files it does not name."""
    section = text.split('## Module map', 1)[1].split('\n## ', 1)[0]
    package = os.path.join(ROOT, 'gluon_syncbn')
    found = []
    for line in section.splitlines():
        if not line.startswith('| `'):
            continue
        cells = line.split('|')
        paths = []
        for name in re.findall(r'`([^`]+)`', cells[1]):
            full = os.path.join(package, name)
            if not os.path.exists(full):
                found.append('module map: no gluon_syncbn/%s' % name)
            paths += [os.path.join(full, n) for n in sorted(os.listdir(full))] \
                if os.path.isdir(full) else [full]
        own = ''.join(_read_abs(p) for p in paths if os.path.isfile(p))
        for name in re.findall(r'`([A-Za-z_][\w.]*)`', '|'.join(cells[2:])):
            parts = name.split('.')
            module = os.path.join(package, parts[0] + '.py')
            where = _read_abs(module) if len(parts) > 1 and os.path.isfile(module) else own
            if name.endswith(tuple('.' + e for e in EXTENSIONS)) or \
                    os.path.isfile(os.path.join(package, name + '.py')):
                continue   # a file, or a module of the package, named
            if not re.search(r'\b%s\b' % re.escape(parts[-1]), where):
                found.append('module map: %s is not in %s' % (name, cells[1].strip()))
    for path in TRACKED:
        if path.startswith('gluon_syncbn/') and path.endswith(('.py', '.h', '.cc')):
            name = os.path.basename(path)
            if name != '__init__.py' and not re.search(r'\b%s\b' % re.escape(name), section):
                found.append('module map: %s has no mention' % path)
    return found


def test_the_module_map_is_the_package():
    bad = module_map_problems(_read('docs/design.md'))
    assert not bad, '\n'.join(bad)


def test_a_stale_module_map_fails():
    text = _read('docs/design.md')
    planted = text.replace('## Module map\n', '## Module map\n\n| `gone.py` | `nowhere` |\n'
                           '| `graphs.py` | `no_such_binding` |\n', 1)
    bad = module_map_problems(planted)
    assert any('no gluon_syncbn/gone.py' in p for p in bad)
    assert any('no_such_binding is not in `graphs.py`' in p for p in bad)
    section = text.split('## Module map', 1)[1].split('\n## ', 1)[0]
    assert any('has no mention' in p
               for p in module_map_problems(text.replace(section, section.replace('tally.py', 'x'))))


@pytest.mark.parametrize('planted, why', [
    ('see `gluon_syncbn/no_such_module.py`', 'no such file'),
    ('(`native/sync_call.h:99999`)', 'outside'),
    ('`graphs.py:no_such_function`', 'defines no'),
    ('[Threads](design.md#no-such-section)', 'missing section'),
    ('[x](no_such_page.md)', 'missing'),
    ('(`resources.cc:129`)', 'no such file'),
    ('see native/session.h:99999.', 'outside'),
    ("docs/install.md, section 'No such'", 'no section'),
    ('(docs/findings.md, "Nothing of\n# that name")', 'no section'),
])
def test_a_bad_reference_fails(planted, why):
    """The rules catch each kind of bad reference, and pass the good ones."""
    assert any(why in p for p in problems('docs/planted.md', planted))
    good = ('`graphs.py` `gluon_syncbn/graphs.py:Graphs` [d](design.md#module-map) '
            '`tests/conftest.py:1-3` `src/resource.cc:129-135` `resource.cc:1` '
            "docs/install.md, section 'Horovod' "
            '(docs/findings.md, "The stand-in\'s\n# floor")')
    assert problems('docs/planted.md', good) == []


def test_a_bad_mxnet_reference_fails():
    """MXNet's references are checked against the source they are given
    (here a stand-in: src/resource.cc of 200 lines)."""
    def source(path):
        return 'line\n' * 199 + 'line' if path == 'src/resource.cc' else None
    assert problems('docs/planted.md', '`resource.cc` 128-135, `src/resource.cc:1`', source) == []
    for planted in ('`resource.cc` 455-458', '(resource.cc 300)', '`src/resource.cc:201`',
                    '`threaded_engine.h`'):
        assert any('MXNet' in p for p in problems('docs/planted.md', planted, source)), planted
