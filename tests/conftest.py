import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the checks' default ("auto") compiles each check region on first use, seconds per dtype and
# layout: the suite runs their eager ops, and tests/integration/test_check_regions.py runs the
# compiled regions against them (same records, same repairs, no false alarm)
os.environ.setdefault("ATTNCHECKER_CHECK_IMPL", "eager")

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: two workers on two cores, one thread
    torch.set_num_threads(1)  # each (two each oversubscribe the cores: 6.8 min, was 9.3)

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before they are
    os.environ.setdefault("TRITON_INTERPRET", "1")  # decorated (attnchecker.kernels imports)

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    max_examples=60,
    derandomize=True,  # CI stays reproducible; HYPOTHESIS_PROFILE=explore searches afresh
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
