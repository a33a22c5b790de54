"""``python -m k3launch`` and the installed ``k3launch`` command: :func:`k3launch.cli.main`."""

import gc


def main() -> None:
    # Off while the command line is imported: k3launch.cli.main turns it back on unless the command
    # is a quick one (the collector's passes over what these imports create are a cost of its own).
    gc.disable()
    from k3launch.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
