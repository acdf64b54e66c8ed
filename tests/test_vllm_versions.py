"""The vLLM plug-in judges a vLLM by what it contains: fingerprints of the functions it
depends on, compared with the releases it was written against. These run without vLLM
(the fingerprints are read from source text); the installed vLLM's own check is
``vllm``-marked, and a downloaded wheel's is checked when one is at hand."""

from __future__ import annotations

import glob
import os
import re
import textwrap

import pytest

from shmclient.vllm import versions
from shmclient.vllm.versions import (ADAPTIVE_TOUCHED, KNOWN, KNOWN_ADAPTIVE, TOUCHED, check, check_adaptive,
                                     fingerprints)


SOURCE = textwrap.dedent('''
    class Base:
        def inherited(self, a, b=1):
            return a + b


    class Client(Base):
        def send(self, request):
            """Docstrings do not count."""
            # nor do comments
            return self.socket.send(request)

        def call(self, method, *args):
            return method(*args)
''')

MODULE = "pkg.client"
ENTRIES = ((MODULE, "Client.send", "body"), (MODULE, "Client.call", "params"), (MODULE, "Client.inherited", "params"))


def prints(source: str) -> tuple[str, ...]:
    return versions._fingerprints(lambda m: source if m == MODULE else None, ENTRIES)


def test_comments_docstrings_and_layout_do_not_change_a_fingerprint():
    same = SOURCE.replace('"""Docstrings do not count."""', '"""Other words."""').replace(
        "# nor do comments", "# another comment").replace("return self.socket.send(request)",
                                                          "return self.socket.send(\n                request)")
    assert prints(same) == prints(SOURCE)


def test_a_changed_body_changes_its_fingerprint_and_only_its():
    changed = SOURCE.replace("return self.socket.send(request)", "return self.socket.send(request, copy=False)")
    before, after = prints(SOURCE), prints(changed)
    assert before[0] != after[0] and before[1:] == after[1:]


def test_params_entries_see_parameters_only():
    body = SOURCE.replace("return method(*args)", "return method(*reversed(args))")
    params = SOURCE.replace("def call(self, method, *args)", "def call(self, method, *args, timeout=None)")
    assert prints(body)[1] == prints(SOURCE)[1]
    assert prints(params)[1] != prints(SOURCE)[1]


def test_an_inherited_method_is_found_in_its_base_and_a_missing_one_says_so():
    assert prints(SOURCE)[2] != "missing"
    assert prints(SOURCE.replace("def inherited", "def renamed"))[2] == "missing"
    assert versions._fingerprints(lambda m: None, ENTRIES) == ("missing",) * 3


@pytest.fixture
def known(monkeypatch):
    table = {"1.4": (("1.4.0", "1.4.1"), ("a", "b", "c")), "1.5": (("1.5.0",), ("a", "B", "c"))}
    monkeypatch.setattr(versions, "KNOWN", table)
    monkeypatch.setattr(versions, "TOUCHED", ENTRIES)
    return table


def test_check_takes_a_tested_release_and_an_unknown_number_with_known_contents(known):
    v = check("1.4.1", ("a", "b", "c"))
    assert v.ok and v.line == "1.4" and "is a tested release" in v.message
    v = check("1.5.0+nv25.12", ("a", "B", "c"))  # a vendor build of a known release
    assert v.ok and v.line == "1.5" and "not a tested release" in v.message


def test_check_refuses_what_differs_and_names_it(known):
    v = check("1.5.2", ("a", "X", "c"))
    assert not v.ok and v.line == "1.5" and v.differs == ["pkg.client.Client.call"]
    assert "differs from the tested vLLM 1.5.0 in pkg.client.Client.call" in v.message
    v = check("2.0.0", ("a", "b", "Z"))  # no line of that number: the closest one
    assert not v.ok and v.line == "1.4" and v.differs == ["pkg.client.Client.inherited"]


def test_known_table_is_whole():
    for line, (tested, prints_) in KNOWN.items():
        assert len(prints_) == len(TOUCHED), line
        assert "missing" not in prints_, line
        assert any(v.startswith(line + ".") for v in tested), (line, tested)


#: Folder of downloaded vLLM wheels to check the table against (e.g. ``pip download
#: --no-deps vllm==0.33.0 -d DIR``); the test is skipped when the variable is not set, and
#: fails when it is set but names no folder with a vLLM wheel in it (a download that went
#: wrong must not pass as a check that was never asked for).
WHEELS_ENV = "SHMCLIENT_TEST_VLLM_WHEELS"


@pytest.mark.parametrize("wheel", sorted(glob.glob(os.path.join(os.environ.get(WHEELS_ENV, "/nonexistent"),
                                                               "vllm*.whl"))) or [None])
def test_a_downloaded_release_matches_its_line(wheel):
    if wheel is None:
        if os.environ.get(WHEELS_ENV):
            pytest.fail(f"${WHEELS_ENV}={os.environ[WHEELS_ENV]!r} holds no vllm*.whl")
        pytest.skip(f"${WHEELS_ENV} is not set")
    version = re.match(r"vllm(?:_cpu)?-([^-]+)-", os.path.basename(wheel)).group(1)
    line = next((k for k, (tested, _) in KNOWN.items() if version in tested), None)
    assert line is not None, f"{version} is in no line of KNOWN"
    assert versions.fingerprints_from_wheel(wheel) == KNOWN[line][1]
    assert versions.fingerprints_from_wheel(wheel, ADAPTIVE_TOUCHED) == KNOWN_ADAPTIVE[line]


@pytest.mark.vllm
def test_the_installed_vllm_is_a_known_release():
    from .conftest import importorskip_vllm
    vllm = importorskip_vllm()  # an error, not a skip, under SHMCLIENT_REQUIRE_VLLM=1
    v = check(vllm.__version__)
    assert v.ok, v.message
    assert vllm.__version__ in KNOWN[v.line][0]
    assert fingerprints() == KNOWN[v.line][1]
    hooks = check_adaptive(vllm.__version__)
    assert hooks.ok and hooks.line == v.line, hooks.message
    assert fingerprints(entries=ADAPTIVE_TOUCHED) == KNOWN_ADAPTIVE[v.line]


def test_the_command_prints_the_verdict(monkeypatch, capsys):
    known, loop = KNOWN["0.32"][1], KNOWN_ADAPTIVE["0.32"]
    monkeypatch.setattr(versions, "fingerprints_from_wheel",
                        lambda path, entries=None: loop if entries == ADAPTIVE_TOUCHED else known)
    assert versions.main(["/w/vllm-0.32.9-cp38-abi3-linux_x86_64.whl"]) == 0
    out = capsys.readouterr().out
    assert out.count('",  # ') == len(TOUCHED) + len(ADAPTIVE_TOUCHED)
    assert ("vLLM 0.32.9 is not a tested release, but everything the plug-in depends on is as in vLLM 0.32.0: "
            "the rings") in out
    assert out.rstrip().endswith("vLLM 0.32.9's busy loop is as in vLLM 0.32: adaptive holds wake-ups back")

    changed, changed_loop = ("0" * 16,) + known[1:], loop[:-1] + ("0" * 16,)
    monkeypatch.setattr(versions, "fingerprints_from_wheel",
                        lambda path, entries=None: changed_loop if entries == ADAPTIVE_TOUCHED else changed)
    versions.main(["/w/vllm-0.32.9-cp38-abi3-linux_x86_64.whl"])
    out = capsys.readouterr().out
    assert f"in {TOUCHED[0][0]}.{TOUCHED[0][1]}: vLLM keeps its own transport" in out
    assert out.rstrip().endswith(f"in {ADAPTIVE_TOUCHED[-1][0]}.{ADAPTIVE_TOUCHED[-1][1]}: adaptive holds none back")


def test_the_adaptive_table_is_whole():
    """Output mode adaptive's hooks are judged per release line, the same lines as KNOWN."""
    assert set(KNOWN_ADAPTIVE) == set(KNOWN)
    for line, prints_ in KNOWN_ADAPTIVE.items():
        assert len(prints_) == len(ADAPTIVE_TOUCHED), line
        assert "missing" not in prints_, line


@pytest.fixture
def known_loops(monkeypatch):
    table = {"1.4": ("a", "b", "c"), "1.5": ("a", "B", "c")}
    monkeypatch.setattr(versions, "KNOWN_ADAPTIVE", table)
    monkeypatch.setattr(versions, "ADAPTIVE_TOUCHED", ENTRIES)
    return table


def test_check_adaptive_takes_a_known_busy_loop_under_any_number(known_loops):
    v = check_adaptive("1.5.3", ("a", "b", "c"))  # 1.5.3 has 1.4's busy loop: fine
    assert v.ok and v.line == "1.4" and v.differs == []


def test_check_adaptive_names_what_differs(known_loops):
    v = check_adaptive("1.5.3", ("a", "X", "c"))
    assert not v.ok and v.line == "1.5" and v.differs == ["pkg.client.Client.call"]
    assert v.message == "vLLM 1.5.3's busy loop differs from vLLM 1.5's in pkg.client.Client.call"
    v = check_adaptive("2.0.0", ("a", "b", "Z"))  # no line of that number: the closest one
    assert not v.ok and v.line == "1.4" and v.differs == ["pkg.client.Client.inherited"]


def test_the_command_refuses_a_source_it_cannot_read_with_status_2(tmp_path, capsys):
    """Defect: a wheel's file name without "-" raised IndexError, a missing wheel a raw
    FileNotFoundError traceback (a missing folder printed "missing" fingerprints). Each
    is now one line on stderr naming the source, and exit status 2."""
    not_zip = tmp_path / "vllm-0.32.0-cp38-abi3-linux_x86_64.whl"
    not_zip.write_bytes(b"not a zip file")
    for source, words in [
            (str(tmp_path / "vllm.whl"), "is not a wheel's file name"),
            (str(tmp_path / "vllm-0.32.0-cp38-abi3-linux_x86_64.whl.missing.whl"), "cannot be read: [Errno 2]"),
            (str(not_zip), "cannot be read: File is not a zip file"),
            (str(tmp_path / "no_such_folder"), "is neither a wheel (.whl) nor a folder")]:
        assert versions.main([source]) == 2, source
        err = capsys.readouterr().err
        assert err.startswith("python -m shmclient.vllm.versions: ") and repr(source) in err and words in err, err
