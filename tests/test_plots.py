import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import torch

from mpguide import plots, policy


def test_policy_map_colours_each_op_on_each_device():
    ops = [op for op in policy.CATALOGUE if op.name in ("matmul", "sum", "softmax")]
    devices = policy.across(torch.bfloat16, ["cpu", "cuda"], ops, simulate=True)
    fig = plots.policy_map(devices)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["matmul", "softmax", "sum"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["cpu (simulated)", "cuda (simulated)"]
    grid = ax.images[0].get_array().tolist()
    lower, float32, unchanged = (
        policy.CLASSES.index(k) for k in (policy.LOWER, policy.FLOAT32, policy.UNCHANGED)
    )
    assert grid == [[lower, unchanged, unchanged], [lower, float32, float32]]  # catalogue order
    only = plots.policy_map(devices, only_differing=True).axes[0]
    assert [t.get_text() for t in only.get_xticklabels()] == ["softmax", "sum"]
    plt.close("all")
