"""test_accelerator.py's GPU tests, run on the CPU (BRISK_TEST_DEVICE=cpu), so that the tests
themselves (their references, bounds and calls) keep up with the code between the sessions that
have a GPU: a test that fails for its own reasons would spend a lent GPU's minutes."""
import pytest
import torch

from conftest import run_test_file


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="test_accelerator.py runs on the GPU here")
def test_accelerator_tests_pass_on_the_cpu():
    run = run_test_file("tests/test_accelerator.py", BRISK_TEST_DEVICE="cpu")
    assert run.returncode == 0 and " passed" in run.stdout and " skipped" not in run.stdout, \
        run.stdout[-4000:] + run.stderr[-2000:]
