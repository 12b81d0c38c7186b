"""benchmarks/common.py: the result document every benchmark prints and writes."""
import argparse
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import out_arg, positive_int, shape_arg, write_result  # noqa: E402


def refusal(parser: argparse.ArgumentParser, option: str, value: str, capsys) -> str:
    """The line that argparse ends with (exit code 2) where `option value` is refused."""
    with pytest.raises(SystemExit) as ended:
        parser.parse_args([option, value])
    assert ended.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


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
    parser = argparse.ArgumentParser(prog="gdn_kernel_registers.py")
    parser.add_argument("--shapes", nargs="*", type=shape_arg)
    assert parser.parse_args(["--shapes", "16,2048,4,128,256", "1,64,1,32,32"]).shapes == [(16, 2048, 4, 128, 256),
                                                                                          (1, 64, 1, 32, 32)]
    for bad in ["1,64", "1,64,1,32,x", "1,64,0,32,32", "1,64,1,32,32,8"]:
        message = refusal(parser, "--shapes", bad, capsys)
        assert message.startswith("gdn_kernel_registers.py: error: argument --shapes:") and repr(bad) in message


def test_an_out_that_cannot_be_written_is_refused_by_the_argument_parser(tmp_path, capsys):
    """--out of every benchmark: a path under a regular file, or a directory, is refused by argparse in one line naming
    it, before the benchmark's work (it was a traceback from write_result once the work was done)."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    parser = argparse.ArgumentParser(prog="activation_memory.py")
    parser.add_argument("--out", type=out_arg)
    new_place = tmp_path / "new" / "deeper" / "result.json"
    assert parser.parse_args(["--out", str(new_place)]).out == str(new_place)
    assert not (tmp_path / "new").exists()  # the folders are made when the result is written, not here
    for bad, expected in [(in_the_way / "sub" / "result.json", f"{in_the_way} is a file"),
                          (tmp_path, f"{tmp_path} is a directory")]:
        message = refusal(parser, "--out", str(bad), capsys)
        assert message.startswith("activation_memory.py: error: argument --out:") and str(bad) in message
        assert expected in message


def test_every_benchmark_checks_its_out_with_the_shared_type():
    """Each script's --out goes through common.out_arg, so that none of them finds out only after hours of work that it
    cannot write its result (each script's parser is built inside its main, after heavy imports: read, not run)."""
    scripts = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))
    declared = {p.name: re.findall(r'add_argument\("--out",[^\n]*', p.read_text()) for p in scripts}
    declared = {name: calls for name, calls in declared.items() if calls}
    assert {"activation_memory.py", "gla_kernel.py", "train_loader.py", "long_context.py"} <= set(declared)
    assert {name: calls for name, calls in declared.items() if not all("type=out_arg" in c for c in calls)} == {}


def test_a_count_below_one_is_refused_by_the_argument_parser(capsys):
    """--tokens, --layers, --steps of the benchmarks that build a model: 0 or less is refused in one line naming it (it
    was a traceback from the model's first reshape, or from torch.randint)."""
    parser = argparse.ArgumentParser(prog="host_overhead.py")
    parser.add_argument("--tokens", type=positive_int)
    assert parser.parse_args(["--tokens", "100"]).tokens == 100  # not a multiple of the chunk size: measured as it is
    for bad in ["0", "-3", "1.5", "many"]:
        message = refusal(parser, "--tokens", bad, capsys)
        assert message.startswith("host_overhead.py: error: argument --tokens:") and repr(bad) in message
