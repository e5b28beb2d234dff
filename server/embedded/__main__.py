"""``python -m skyrl_lora.server.embedded [--out DIR]``: build (if needed) and print paths."""

import argparse
import logging
from pathlib import Path

from . import ensure_embedded_model

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument(
    "--out", type=Path, default=None, help="build folder (default: $SKYRL_LORA_CACHE or ~/.cache)"
)
logging.basicConfig(level=logging.INFO, format="%(message)s")
model = ensure_embedded_model(parser.parse_args().out)
print(f"root: {model.root}")
print(f"model: {model.model_dir}")
for name, path in sorted(model.adapters.items()):
    print(f"adapter {name}: {path}")
