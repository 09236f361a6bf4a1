"""``python -m sglang_prr.launch_server``: the user's command (and the supervisor's child), kept
at this path; the launcher is ``sglang_prr.serving.launch_server``."""

from .serving.launch_server import main

if __name__ == "__main__":
    main()
