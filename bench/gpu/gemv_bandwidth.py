"""How fast one token's matrix-vector products can stream bf16 weights on this GPU, measured
with PyTorch (cuBLAS) and CUDA events: the rate a decode step could reach if its products
alone ran, back to back, with no host in the way. Shapes are those of a Gemma 4 E4B layer.

Each shape cycles through enough distinct weight copies that none stays in L2 between uses,
and the launches are captured in one CUDA graph so that host time does not count. Prints a
markdown table: shape, MB per product, microseconds per product, TB/s."""
import torch

from stage_bound import replay_us

L2_BYTES = 60 * 1024**2
SHAPES = [
    ("q,k,v fused (E4B)", 2048 + 2 * 512, 2560),
    ("gate (E4B)", 10240, 2560),
    ("down (E4B)", 2560, 10240),
    ("gate (12B)", 15360, 3840),
    ("output head (E4B)", 262144, 2560),
]
CALLS = 64


def rate(n, k):
    per = n * k * 2
    copies = max(2, (4 * L2_BYTES) // per + 1)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

    def run():
        for i in range(CALLS):
            torch.matmul(x, weights[i % copies].t(), out=outs[i % copies])

    us = replay_us(run) / CALLS
    return per / 1e6, us, per / us / 1e6


print("| product (1 token) | MB | µs each | TB/s |")
print("|---|---|---|---|")
for name, n, k in SHAPES:
    mb, us, tbs = rate(n, k)
    print(f"| {name}: [{n}, {k}] | {mb:.1f} | {us:.1f} | {tbs:.2f} |")
