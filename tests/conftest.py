import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def cuda_available() -> bool:
    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device)")
