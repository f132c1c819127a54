"""Small functions the compile tests capture, compare and log."""

import torch


def matmul_out_fp32(x, y, b):
    out = torch.empty(x.shape[:-1] + y.shape[-1:], dtype=torch.float32, device=x.device)
    return torch.matmul(x, y, out=out) + b


def issue_inputs():
    gen = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(*s, generator=gen).to(torch.bfloat16)
        for s in ((32, 7, 1, 8), (32, 7, 8, 1), (32, 7, 1, 1))
    )


def round_trip(x):
    return x.to(torch.bfloat16).to(torch.float32) * 3.0
