import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The variable must be set before any
# kernel is defined, and fabric_lin.model imports the fused kernels, so it is set here, before any
# test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
