from skyrl_lora.server.cli import main
import sys

sys.exit(main())
