"""ResNet-18 as torchvision builds it, written here: torchvision's only wheel for this Python is
linked against CUDA torch and does not import with the CPU torch the tests run on.

Same architecture, parameter and buffer names (``conv1``, ``bn1``, ``layer1.0.conv1``, ...,
``layer2.0.downsample.0``, ``fc``) and initialisation as ``torchvision.models.resnet18``;
``width`` (torchvision's 64) scales every stage's channels (width 8: 8, 16, 32, 64), so tests
can run a narrow one.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norms and a shortcut (a 1x1 convolution and a batch
    norm where the stride or the channels change)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """7x7 stride-2 stem, 3x3 stride-2 max-pool, four stages of two BasicBlocks (channels
    width x 1, 2, 4, 8; stages 2-4 start with stride 2), global average pool, Linear head.
    The network's stride is 32: images of 32x32 leave 1x1 pixels to the last stage."""

    def __init__(self, num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        channels = [width, 2 * width, 4 * width, 8 * width]
        inplanes = width
        for i, planes in enumerate(channels):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(inplanes, planes, stride),
                                                         BasicBlock(planes, planes)))
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, num_classes)
        for m in self.modules():           # torchvision's initialisation (fc keeps nn.Linear's)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
