"""predict.py on long inputs: per-batch (not per-image) tensor reads, rows written as they are predicted, an
interrupted run keeping the rows it predicted."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from vitrel.inference import _top_rows


class _CountTorchCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_top_rows_reads_a_batch_in_a_few_tensor_calls_not_one_per_image():
    # an element read from a CUDA tensor (int(c[j, r]), float(p[j, r])) syncs the GPU: 3 * k per image capped predict.py
    probs = torch.rand(256, 10, dtype=torch.float64).softmax(-1)
    with _CountTorchCalls() as mode:
        rows = _top_rows(probs, range(256), [f"{i}.png" for i in range(256)], None, 5)
    assert mode.calls < 10, mode.calls
    p, c = probs.topk(5, dim=-1)
    assert [r["index_0"] for _, r in rows] == c[:, 0].tolist()
    assert all(r[f"prob_{j}"] == round(float(p[i, j]), 6) for i, (_, r) in enumerate(rows) for j in range(5))
