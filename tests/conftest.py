# Shared test setup. TRITON_INTERPRET must be set before triton is first imported, so it lives here:
# on a machine without CUDA every Triton kernel runs in the interpreter (slow; keep shapes small).
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# one thread: the test models are tiny (thread overhead dominates) and results stay reproducible
torch.set_num_threads(1)
