"""The real-engine scenarios of ``tests/``, run against CUDA vLLM.

Importing the scenario modules collects their tests here, where the
``engine_server`` fixture is the CUDA server of ``gpu_tests/conftest.py``:
one set of scenarios, two engines.
"""

from tests.test_client_engine import *  # noqa: F403
from tests.test_server_engine import *  # noqa: F403
