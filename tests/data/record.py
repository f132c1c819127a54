"""Record the real traces the tests read: ``python tests/data/record.py`` on a CPU machine.

Each is one profiled step under CPU autocast in bfloat16, written gzipped beside this file.
"""

from pathlib import Path

import torch

from mpguide.traces.profiling import profile_fn

HERE = Path(__file__).parent


def autocast_matmul() -> None:
    """A bf16 x fp32 matmul under autocast, then an explicit fp32 LayerNorm of the result."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(32, 16, generator=gen)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = a @ w
        return torch.nn.functional.layer_norm(y.float(), (16,)).to(torch.bfloat16)

    profile_fn(step, path=HERE / "autocast_matmul.json.gz")


def train_step() -> None:
    """Forward and backward of Linear -> LayerNorm -> Linear under autocast, fp32 weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
    )
    x = torch.randn(16, 32)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()

    profile_fn(step, path=HERE / "train_step.json.gz")


if __name__ == "__main__":
    autocast_matmul()
    train_step()
