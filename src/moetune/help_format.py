"""The help layout every moetune command shares (the CLI and the commands defined beside their code)."""

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has a meaningful one (not for None or on/off switches)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
