"""The engine's device is made current in every thread that uses CUDA (kvtier/devices.py)."""
import threading

import pytest
import torch

from kvtier.devices import bind_thread, on_device


def test_a_device_without_an_index_binds_nothing():
    """`--device cuda` means the current device: nothing to set (torch.cuda.set_device refuses a device without
    an index, which stopped every `--device cuda` engine at start-up)."""
    bind_thread(torch.device("cuda"))
    bind_thread(torch.device("cpu"))


@pytest.mark.gpu
def test_worker_threads_run_on_the_engine_s_device():
    device = torch.device(f"cuda:{torch.cuda.device_count() - 1}")
    seen = []
    thread = threading.Thread(target=on_device(device, lambda: seen.append(torch.cuda.current_device())))
    thread.start()
    thread.join(30)
    assert seen == [device.index]
