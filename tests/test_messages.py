"""The wording shared by both languages (gluon_syncbn/messages.py): templates
the native library can fill in as Python does."""
import os
import re
import string

import pytest

from gluon_syncbn import messages


def test_every_field_is_a_plain_name():
    # native/messages.h fills in "{name}" only: no format specs, conversions
    # or positional fields, which str.format would accept and C++ would print.
    for name, template in messages.TEMPLATES.items():
        for _, field, spec, conversion in string.Formatter().parse(template):
            if field is not None:
                assert re.fullmatch(r'[a-z]+', field) and not spec and not conversion, \
                    (name, field, spec, conversion)


def test_text_fills_every_field_and_refuses_a_missing_one():
    text = messages.text('stale_call', layer='bn0', cause='device 1 raised')
    assert text == ("SyncBatchNorm 'bn0': this call belongs to a step that failed earlier: "
                    "device 1 raised")
    with pytest.raises(KeyError):
        messages.text('stale_call', layer='bn0')


HINT = re.compile(r"([\w./-]+\.md),\s+section\s+'([^']+)'")


def test_every_hint_names_a_file_and_a_section_that_has_it():
    # A hint such as "(see README)" sends the user to a page without the
    # answer: every one names the file and its section, and both must exist.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    package = os.path.join(root, 'gluon_syncbn')
    hints = []
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(('.py', '.h', '.cc')):
                path = os.path.join(folder, name)
                text = open(path).read()
                assert not re.search(r'see README\b(?!\.md, section)', text), path
                hints += [(path,) + m for m in HINT.findall(text)]
    assert any(doc == 'docs/install.md' and section == 'Horovod' for _, doc, section in hints)
    for path, doc, section in hints:
        with open(os.path.join(root, doc)) as f:
            headings = [line.lstrip('#').strip() for line in f if line.startswith('#')]
        assert section in headings, (path, doc, section, headings)
