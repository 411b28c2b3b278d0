"""The convolution rule's patches: ``F.unfold``'s values and layout, however the convolution is
configured (padding modes, strides, dilations, groups, one spatial dimension), from an input in
either memory layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grabkit.stats.rules import ConvRule

CONVS = [
    (lambda: nn.Conv2d(3, 6, 5), (4, 3, 12, 12)),
    (
        lambda: nn.Conv2d(6, 8, (3, 2), stride=(2, 1), padding=1, dilation=(2, 1), groups=2),
        (3, 6, 11, 9),
    ),
    (lambda: nn.Conv2d(2, 4, 3, padding=2, padding_mode="circular"), (2, 2, 7, 5)),
    (
        lambda: nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=2, padding_mode="reflect"),
        (3, 4, 17),
    ),
]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("index", range(len(CONVS)))
def test_patches_equal_unfold(index, channels_last):
    make, shape = CONVS[index]
    torch.manual_seed(index)
    conv, x = make(), torch.randn(shape)
    if channels_last:  # channels innermost in memory, as images converted from (H, W, C)
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    patches = ConvRule(conv.weight.dim() - 2)._patches(conv, x)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    padded = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    kernel, dilation, stride = conv.kernel_size, conv.dilation, conv.stride
    if padded.dim() == 3:
        padded = padded.unsqueeze(2)
        kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
    expected = F.unfold(padded, kernel, dilation=dilation, stride=stride)
    assert torch.equal(patches, expected)
    assert patches.stride() == expected.stride()
