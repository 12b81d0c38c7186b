"""benchmarks/common.py: the result document every benchmark prints and writes."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import write_result  # noqa: E402


def test_result_is_printed_and_written_with_how_it_was_made(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/gla_kernel.py", "--shapes", "16,2048,4,128,256"])
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/cache")
    out = tmp_path / "new" / "result.json"  # a folder that does not exist yet
    document = write_result({"results": [{"ms": 1.5}]}, str(out))

    printed = json.loads(capsys.readouterr().out)
    assert printed == document == json.loads(out.read_text())
    assert list(document) == ["run", "results"] and document["results"] == [{"ms": 1.5}]
    run = document["run"]
    assert run["command"] == "python benchmarks/gla_kernel.py --shapes 16,2048,4,128,256"
    assert run["env"]["TRITON_CACHE_DIR"] == "/tmp/cache" and "HOME" not in run["env"]
    assert run["date"][:2] == "20" and run["date"].endswith("+00:00")
    assert {"gpu", "torch", "triton", "cpu_count"} <= set(run["machine"])
    assert "fla" not in run["machine"]  # the peer's version only where it was measured
    assert [p.name for p in out.parent.iterdir()] == ["result.json"]  # no temporary file left beside it


def test_result_replaces_an_earlier_file_and_records_the_peer(tmp_path, capsys):
    out = tmp_path / "result.json"
    out.write_text("an earlier run's result")
    document = write_result({"x": 1}, str(out), fla_ran=True)
    assert json.loads(out.read_text()) == document
    assert "fla" in document["run"]["machine"]  # None where flash-linear-attention is not installed


def test_no_file_without_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_result({"x": 1})
    assert json.loads(capsys.readouterr().out)["x"] == 1
    assert list(tmp_path.iterdir()) == []


def test_a_shape_that_is_not_five_positive_integers_is_one_line(capsys):
    """--shapes of the kernel benchmarks: B,T,H,K,V parsed to a tuple; a value with too few numbers, a word or a zero is
    refused by argparse in one line naming it (it was a traceback from the unpacking, after the imports)."""
    import argparse

    import pytest

    from common import shape_arg

    parser = argparse.ArgumentParser(prog="gdn_kernel_registers.py")
    parser.add_argument("--shapes", nargs="*", type=shape_arg)
    assert parser.parse_args(["--shapes", "16,2048,4,128,256", "1,64,1,32,32"]).shapes == [(16, 2048, 4, 128, 256),
                                                                                          (1, 64, 1, 32, 32)]
    for bad in ["1,64", "1,64,1,32,x", "1,64,0,32,32", "1,64,1,32,32,8"]:
        with pytest.raises(SystemExit) as ended:
            parser.parse_args(["--shapes", bad])
        assert ended.value.code == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert message.startswith("gdn_kernel_registers.py: error: argument --shapes:") and repr(bad) in message
