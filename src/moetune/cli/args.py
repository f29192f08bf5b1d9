"""What every moetune command's argument parsing shares: the help layout, and usage errors as MoetuneErrors, so that
`moetune.cli.main` prints them with the one prefix every other error has."""

import argparse

from moetune.errors import UsageError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has a meaningful one (not for None or on/off switches)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse prints its own `PROG: error:` line and exits; ours raises, so that main prints every error alike."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # `--out` must not silently stand for `--output-something`
        super().__init__(*args, **kwargs)

    def error(self, message):
        command = self.prog.removeprefix("moetune ")
        raise UsageError(f"{command}: {message} (`{self.prog} --help` lists the flags)")

