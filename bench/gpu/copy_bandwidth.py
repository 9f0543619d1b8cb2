"""Device-to-device copy bandwidth through PyTorch, counting bytes read plus bytes written
(TB/s): the denominator of the decode memory floor. Prints one number."""
import time

import torch

x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(10):
    y.copy_(x)
torch.cuda.synchronize()
print(f"{2 * x.numel() * 10 / (time.perf_counter() - start) / 1e12:.2f}")
