"""tools/bundle.py: the shipped kernel files are what src/ generates, and their #line directives name the
tree's real lines (so nvcc errors and compute-sanitizer / ncu source lines point into src/). CPU only;
nothing here imports or builds a kernel file."""
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bundle", os.path.join(ROOT, "tools", "bundle.py"))
bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bundle)

_LINE = re.compile(r'^#line (\d+) "([^"]+)"$')


@pytest.mark.parametrize("target", sorted(bundle.TARGETS))
def test_shipped_file_is_what_the_tree_generates(target):
    with open(os.path.join(ROOT, target), encoding="utf-8") as f:
        assert f.read() == bundle.generate(target), f"{target} is stale: run `python tools/bundle.py`"


@pytest.mark.parametrize("target", sorted(bundle.TARGETS))
def test_line_directives_name_the_tree_lines(target):
    """Every line of the bundled CUDA that came from a tree file verbatim equals the line that the last #line
    directive (plus the lines since) names; expanded placeholder lines are the only others, and each is
    followed by a #line."""
    text = bundle.generate(target)
    start = text.index('_SRC = r"""\n') + len('_SRC = r"""\n')
    cuda = text[start:text.index('"""', start)].split("\n")[:-1]
    trees, where, checked, expanded, in_expansion = {}, None, 0, 0, False
    for line in cuda:
        m = _LINE.match(line)
        if m:
            where, in_expansion = [m.group(2), int(m.group(1))], False
            if where[0] not in trees:
                with open(os.path.join(ROOT, where[0]), encoding="utf-8") as f:
                    trees[where[0]] = f.read().split("\n")
            continue
        assert where is not None, "CUDA text before the first #line"
        if in_expansion:  # the rest of a multi-line expansion, up to the #line after it
            continue
        source = trees[where[0]][where[1] - 1]
        if line == source:
            checked += 1
        else:  # a placeholder's expansion: its first line starts where the placeholder stood
            assert re.search(r"@[A-Z][A-Z0-9_]*@", source), (where, line, source)
            expanded, in_expansion = expanded + 1, True
        where[1] += 1
    assert checked > 3000 and expanded >= 6, (checked, expanded)
    assert set(trees) >= {bundle.TARGETS[target][0].replace(".py", ".cu")}


def test_includes_expand_once_in_place_with_line_directives(tmp_path, monkeypatch):
    """A local include is inlined where it stands, once (a second include of it and #pragma once vanish),
    found beside the including file or in src/common/; placeholders expand; #line resyncs after each."""
    (tmp_path / "src" / "common").mkdir(parents=True)
    (tmp_path / "src" / "op").mkdir()
    (tmp_path / "src" / "common" / "shared.cuh").write_text("#pragma once\nint shared;\n")
    (tmp_path / "src" / "op" / "part.cuh").write_text('#pragma once\n#include "shared.cuh"\nint part;\n')
    (tmp_path / "src" / "op" / "op.cu").write_text(
        '#include <cmath>\n#include "part.cuh"  // its part\n#include "shared.cuh"\n@TWO@\nint tail;\n')
    monkeypatch.setattr(bundle, "ROOT", str(tmp_path))
    cuda = bundle.CudaBundle({"@TWO@": "int a;\nint b;\n"})
    cuda.add("src/op/op.cu")
    assert cuda.text().split("\n") == [
        '#line 1 "src/op/op.cu"', "#include <cmath>",
        '#line 2 "src/common/shared.cuh"', "int shared;",
        '#line 3 "src/op/part.cuh"', "int part;",
        '#line 4 "src/op/op.cu"', "int a;", "int b;",
        '#line 5 "src/op/op.cu"', "int tail;", ""]
    assert cuda.files == ["src/op/op.cu", "src/op/part.cuh", "src/common/shared.cuh"]


def test_missing_include_names_the_including_file(tmp_path, monkeypatch):
    (tmp_path / "src" / "common").mkdir(parents=True)
    (tmp_path / "src" / "op").mkdir()
    (tmp_path / "src" / "op" / "op.cu").write_text('#include "absent.cuh"\n')
    monkeypatch.setattr(bundle, "ROOT", str(tmp_path))
    with pytest.raises(SystemExit, match=r'src/op/op.cu: #include "absent.cuh"'):
        bundle.CudaBundle({}).add("src/op/op.cu")


def test_check_reports_a_stale_file(tmp_path, capsys):
    """--check exits 1 and writes nothing when a shipped file differs from the tree's output; a current one
    passes."""
    target = "contact_map.py"
    stale = tmp_path / target
    stale.write_text(bundle.generate(target).replace("ModelNew", "ModelOld", 1))
    assert bundle.main(["--check", target], shipped_dir=str(tmp_path)) == 1
    assert "ModelOld" in stale.read_text()
    assert "not what src/ generates: contact_map.py" in capsys.readouterr().err
    stale.write_text(bundle.generate(target))
    assert bundle.main(["--check", target], shipped_dir=str(tmp_path)) == 0


def test_placeholder_must_stand_alone(tmp_path, monkeypatch):
    """Text after a placeholder on its line would get the line number of the expansion's end: refused."""
    (tmp_path / "src" / "common").mkdir(parents=True)
    (tmp_path / "src" / "op").mkdir()
    (tmp_path / "src" / "op" / "op.cu").write_text("int a;\n@TWO@}\n")
    monkeypatch.setattr(bundle, "ROOT", str(tmp_path))
    with pytest.raises(SystemExit, match=r"src/op/op.cu:2: placeholder @TWO@ must stand alone"):
        bundle.CudaBundle({"@TWO@": "int b;"}).add("src/op/op.cu")


def test_unread_local_include_fails_the_bundle(tmp_path, monkeypatch):
    """A local include the bundler does not expand (here: a block comment after it) would fail the build in
    load_inline's directory minutes later: generate() refuses it."""
    (tmp_path / "src" / "common").mkdir(parents=True)
    (tmp_path / "src" / "op").mkdir()
    (tmp_path / "src" / "op" / "part.cuh").write_text("int part;\n")
    (tmp_path / "src" / "op" / "op.cu").write_text('#include "part.cuh" /* its part */\n')
    (tmp_path / "src" / "op" / "op.py").write_text('SRC = r"""\n#bundle-cuda src/op/op.cu\n"""\n')
    (tmp_path / "src" / "op" / "generate.py").write_text("def expansions():\n    return {}\n")
    monkeypatch.setattr(bundle, "ROOT", str(tmp_path))
    monkeypatch.setitem(bundle.TARGETS, "op.py", ("src/op/op.py", "src/op/generate.py"))
    with pytest.raises(SystemExit, match=r'could not read: #include "part.cuh" /\* its part \*/'):
        bundle.generate("op.py")
