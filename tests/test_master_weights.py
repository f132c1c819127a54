import pytest
import torch

from mpguide import MPGuideError
from mpguide.training import master_weights

BF16 = torch.bfloat16


def test_lost_updates_in_bf16():
    w = torch.ones(3, dtype=BF16)
    assert master_weights.spacing(w).tolist() == [2**-7] * 3
    update = torch.tensor([1e-3, 2**-7, 0.0])
    assert master_weights.lost(w, update).tolist() == [True, False, False]
    assert master_weights.lost(w.float(), update).tolist() == [False, False, False]


def test_master_weights_keep_learning_where_bf16_stalls():
    curves = {w: master_weights.train(w, steps=150, dev="cpu") for w in master_weights.WEIGHTS}
    assert curves["bfloat16"].lost_share[-1] == 1.0
    assert curves["bfloat16"].losses[-1] == curves["bfloat16"].losses[-20]
    assert curves["master"].final < curves["bfloat16"].final / 10
    assert curves["float32"].final < curves["master"].final
    assert len(curves["master"].losses) == 150
    assert "bfloat16: 150 steps" in repr(curves["bfloat16"])


def test_train_rejects_unknown_weights():
    with pytest.raises(MPGuideError, match="unknown weights"):
        master_weights.train("fp8")
