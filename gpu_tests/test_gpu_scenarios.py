"""The real-engine scenarios of ``tests/``, run against CUDA vLLM.

Importing the scenario modules collects their tests here, where the
``engine_server`` fixture is the CUDA server of ``gpu_tests/conftest.py``:
one set of scenarios, two engines.
"""

from tests.test_client_engine import *  # noqa: F403
from tests.test_prompt_logprobs_engine import *  # noqa: F403
from tests.test_push_engine import (  # noqa: F401 (the tenant-key test needs API keys)
    admin,
    test_bad_pushes_get_400_and_the_old_version_serves,
    test_finish_old_falls_back_when_no_lora_slot_is_free,
    test_finish_old_lets_in_flight_finish_on_the_old_version,
    test_malformed_pushes_get_4xx,
    test_push_a_folder_and_in_memory_weights,
    test_push_mid_sample_abort_resume_gives_two_ranges,
)
from tests.test_server_engine import *  # noqa: F403
