"""``python -m skyrl_lora.server.embedded [--out DIR]``: build and print paths."""

import argparse
import logging
from pathlib import Path

from skyrl_lora.server.embedded import ensure_embedded_model

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--out", type=Path, default=None, help="cache folder (default: ~/.cache)")
logging.basicConfig(level=logging.INFO)
model = ensure_embedded_model(parser.parse_args().out)
print(f"model: {model.model_dir}")
for name, path in sorted(model.adapters.items()):
    print(f"adapter {name}: {path}")
