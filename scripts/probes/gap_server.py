"""``skyrl-lora serve`` with gap_hooks installed in every process (probe)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gap_hooks  # noqa: E402

gap_hooks.install()

if __name__ == "__main__":
    from skyrl_lora.server.cli import main

    sys.exit(main())
