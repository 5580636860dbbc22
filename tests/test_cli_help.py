# Every command line's --help says what each flag means: fit.py (each subcommand, with the CSV columns it
# reads), downstream.py, sample.py (with every default), probe.py, eval_core.py, eval_harness.py, grow.py, ladder.py,
# match.py, python -m tooling.plots, tooling.memory, tooling.convert_checkpoint and tooling.export.
import argparse
import importlib

import pytest

CLIS = ["fit", "downstream", "sample", "probe", "eval_core", "eval_harness", "grow", "ladder", "tooling.plots",
        "tooling.match_cli", "tooling.memory", "tooling.convert_checkpoint", "tooling.export"]


class Captured(BaseException):  # not an Exception: no CLI's error handling catches it
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parser_of(module_name, monkeypatch, argv=()):
    """The ArgumentParser a CLI's main() builds, caught where it would parse the command line."""
    module = importlib.import_module(module_name)

    def capture(self, args=None, namespace=None):
        raise Captured(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Captured) as e:
        module.main(list(argv))
    return e.value.parser


def all_parsers(parser, name):
    """(name, parser) of a parser and every subcommand's parser under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from all_parsers(sub, f"{name} {sub_name}")


def arguments(parser):
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("module_name", CLIS)
def test_every_flag_has_help_text(module_name, monkeypatch):
    missing = []
    for name, parser in all_parsers(parser_of(module_name, monkeypatch), module_name):
        parser.format_help()  # a stray % in a help string fails here, not when a user asks for --help
        for action in arguments(parser):
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{name}: {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"arguments without --help text: {missing}"


def test_sample_help_shows_every_default(monkeypatch):
    parser = parser_of("sample", monkeypatch)
    formatter = parser._get_formatter()
    for action in arguments(parser):
        text = formatter._expand_help(action)
        assert "(default: " in text, (action.dest, text)
        if action.default not in (None, ""):
            assert f"(default: {action.default})" in text, (action.dest, text)


@pytest.mark.parametrize("command, columns", [
    ("surface", ["columns arch, cell (", "F (training FLOPs per token, > 0), S (sparsity", "D (training tokens", "loss (> 0)"]),
    ("chinchilla", ["columns N (parameters; or params), D (training tokens; or C or train_flops", "and loss, all > 0"]),
    ("power", ["columns arch, C (training FLOPs, > 0) and loss (> 0)"]),
])
def test_fit_subcommand_help_names_its_input_columns(command, columns, capsys):
    import fit
    with pytest.raises(SystemExit) as e:
        fit.main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the flag texts
    for text in columns:
        assert text in out, (text, out)
