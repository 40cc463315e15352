"""tests/conftest.py skips @pytest.mark.gpu tests when CUDA is absent (and runs them when present)."""
import pytest


@pytest.mark.gpu
def test_gpu_marked_tests_only_run_with_cuda():
    import torch

    assert torch.cuda.is_available()
