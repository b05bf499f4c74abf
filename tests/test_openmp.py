"""torch's OpenMP threads are stopped before ggml's decode graphs take the cores (kvtier/openmp.py)."""
import os
import time

import pytest
import torch

from kvtier import openmp


@pytest.mark.skipif(openmp._pause_all() is None, reason="torch here runs no GNU libgomp")
def test_stopping_ends_the_threads_a_parallel_region_left_and_the_next_starts_them_again():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(256, 256)
        expected = x @ x
        torch.add(x, x)      # a parallel region: its team's threads spin after it
        before = len(os.listdir("/proc/self/task"))
        openmp.stop_spinning()
        deadline = time.monotonic() + 5      # the team's threads exit on their own schedule once released
        while len(os.listdir("/proc/self/task")) >= before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/task")) < before
        assert torch.equal(x @ x, expected)      # the next region has its team again
    finally:
        torch.set_num_threads(threads)
