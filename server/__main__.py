import sys

from skyrl_lora.server.cli import main

sys.exit(main())
