"""``python -m skyrl_lora.server``: the ``skyrl-lora`` CLI."""

import sys

from .cli import main

if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this module
    sys.exit(main())
