"""generate's --stop: the text ends before the first place where the generated text holds a stop string (one, or any of
a list given in brackets on the command line or as a YAML list in a file), against str.find on the whole text; the
escapes a shell leaves; a bracketed value that is no list of strings, or a list of one plain item (`[END]`, which may
mean the bracketed text), refused in one line with how to give what was meant."""
import random

import pytest

from fabric_lin.generate import StopString, main as generate, stop_strings
from helpers import cli_error, make_model_dir, small_config

PROMPT = "the model"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stop") / "model"
    make_model_dir(directory, small_config())
    return directory


@pytest.fixture(scope="module")
def full(model):
    """What the model generates greedily, unstopped: the prompt and 30 tokens."""
    return generate(model, prompt=PROMPT, max_new_tokens=30, temperature=0.0, device="cpu")


def greedy(model, capsys, **kwargs):
    capsys.readouterr()
    text = generate(model, prompt=PROMPT, max_new_tokens=30, temperature=0.0, device="cpu", **kwargs)
    return text, capsys.readouterr()


def test_generate_stops_before_the_stop_string(model, full, capsys):
    """--stop: the text printed and returned is the prompt and the generated text up to the stop string's first
    occurrence in it (a piece of the text that the model makes when not stopped, spanning tokens), left out, and the
    model samples no token past it; a stop string that never comes holds nothing back."""
    generated = full[len(PROMPT):]
    assert full.startswith(PROMPT) and len(generated) > 12
    stop = generated[8:12]  # three characters before it and after it would be held back, were they its start
    expected = PROMPT + generated[:generated.find(stop)]
    text, (out, err) = greedy(model, capsys, stop=stop)
    assert text == expected and out == expected + "\n"
    assert int(err.split(" tokens in ")[0]) < 30
    # its start, the text's last characters, printed at the end
    assert greedy(model, capsys, stop=generated[-3:] + "\x00")[0] == full
    # a stop string in the prompt alone stops nothing
    assert greedy(model, capsys, stop=PROMPT)[0] == full


def test_several_stop_strings_end_the_text_at_the_first_that_comes(model, full, capsys):
    """A list of stop strings, from Python, the command line in brackets or a YAML file's list: the text ends before
    whichever comes first, listed first or not; one that never comes changes nothing."""
    from fabric_lin.cli import main as cli_main

    generated = full[len(PROMPT):]
    early, late = generated[5:8], generated[12:15]
    expected = PROMPT + generated[:min(generated.find(early), generated.find(late))]
    assert len(expected) < len(PROMPT) + 12
    assert greedy(model, capsys, stop=[late, early])[0] == expected
    assert greedy(model, capsys, stop=[late, "\x00never"])[0] == PROMPT + generated[:generated.find(late)]
    assert greedy(model, capsys, stop=[])[0] == full

    argv = ["generate", str(model), "--prompt", PROMPT, "--max_new_tokens", "30", "--temperature", "0", "--device", "cpu"]
    capsys.readouterr()
    cli_main(argv + ["--stop", f'["{late}", "{early}"]'])
    assert capsys.readouterr().out == expected + "\n"
    config = model.parent / "generate.yaml"
    config.write_text(f'stop: ["{late}", "{early}"]\n')
    cli_main(argv + ["--config", str(config)])
    assert capsys.readouterr().out == expected + "\n"


def cut_text(pieces, stops):
    """The reference: the text of `pieces` up to the first piece after which the text holds a stop string (generation
    stops there), cut where the first stop string it holds begins (str.find on the text so far); all of it where
    none comes."""
    text = ""
    for piece in pieces:
        text += piece
        found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
        if found:
            return text[:min(found)], True
    return text, False


def test_stop_strings_held_back_and_printed_as_str_find_cuts_the_text():
    """StopString fed text in pieces (tokens' text): what it prints, then its rest, is the reference's cut, whatever
    the pieces; overlapping stop strings and one inside another included."""
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, len(text)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])] if text else []
        expected, found = cut_text(pieces, stops)
        until, printed = StopString(stops), ""
        for piece in pieces:
            printed += until.add(piece)
            if until.found:
                break
        printed += until.rest()
        assert printed == expected and until.found == found, (pieces, stops)


@pytest.mark.parametrize("typed, meant", [("\\n", "\n"), ("a\\tb", "a\tb"), ("\\r\\n", "\r\n"), ("\\\\n", "\\n"),
                                          ("\n", "\n"), ("\\d+", "\\d+"), ("end\\", "end\\")])
def test_generate_stop_reads_the_escapes_that_a_shell_leaves(typed, meant):
    """`--stop "\\n"` on a shell is a backslash and an n, which generated text hardly ever holds: it is a new line, as
    \\t a tab, \\r a carriage return and \\\\ a backslash; a backslash before anything else, or at the end, is itself;
    in each string of a list alike."""
    assert stop_strings(typed) == [meant]
    assert stop_strings([typed, "x"]) == [meant, "x"]


def test_the_command_line_reads_a_list_in_brackets_and_a_string_as_one(model, capsys, monkeypatch):
    """What generate is given, as jsonargparse reads the command line: a list in brackets (its items quoted or not), one
    string (also one holding a comma, or a bracket not at both ends)."""
    import fabric_lin.generate as generate_module
    from fabric_lin.cli import main as cli_main

    given = []
    monkeypatch.setattr(generate_module, "stop_strings", lambda stop: given.append(stop) or [])
    for typed in ("[a, b]", '["Q:", "[END]"]', "a, b", "[a", "\\n\\n", "['END']"):
        cli_main(["generate", str(model), "--stop", typed, "--max_new_tokens", "1", "--device", "cpu"])
    assert given == [["a", "b"], ["Q:", "[END]"], "a, b", "[a", "\\n\\n", ["END"]]


@pytest.mark.parametrize("argv, message", [
    (["--stop", "[END]"], "--stop [END] reads as a list of one stop string, END: to stop at the text [END], give it "
                          "quoted in a list, --stop '[\"[END]\"]'; to stop at END, --stop END"),
    (["--stop=[/INST]"], "--stop [/INST] reads as a list of one stop string, /INST: to stop at the text [/INST], give it "
                         "quoted in a list, --stop '[\"[/INST]\"]'; to stop at /INST, --stop /INST"),
    (["--stop", "[Q:, A:]"], "--stop [Q:, A:] is in brackets, as a list of stop strings is, but YAML does not read it as a "
                             "list of strings: quote its items, --stop '[\"Q:\", \"A:\"]', or, to stop at the text "
                             "[Q:, A:] itself, --stop '[\"[Q:, A:]\"]'"),
    (["--stop", "[3]"], "--stop [3] is in brackets, as a list of stop strings is, but YAML does not read it as a list of "
                        "strings: quote its items, --stop '[\"3\"]', or, to stop at the text [3] itself, --stop "
                        "'[\"[3]\"]'"),
    (["--stop", '[a, ""]'], "--stop ['a', '']: expected a list of stop strings, none of them empty"),
])
def test_a_stop_that_is_no_list_of_strings_is_one_line(model, capsys, argv, message):
    err = cli_error(["generate", str(model), *argv], capsys)
    assert err == f"fabric-lin generate: error: {message}\n"


def test_a_yaml_file_s_bracketed_text_is_refused_naming_the_file(model, tmp_path, capsys):
    """`stop: '[END]'`, quoted text in a YAML file, which jsonargparse would read as the list of END; a YAML list
    (`stop: [END]`) is a list."""
    config = tmp_path / "generate.yaml"
    config.write_text("stop: '[END]'\n")
    assert cli_error(["generate", str(model), "--config", str(config)], capsys) == (
        f"fabric-lin generate: error: stop: '[END]' (in {config}) reads as a list of one stop string, END: to stop at "
        f"the text [END], write it quoted in a list, stop: ['[END]']; to stop at END, stop: END\n")
