"""The nets the engine's tests train: plain torch, images (N, C, H, W) in, logits out. The ViT's blocks are what
tensor parallel splits and pipeline parallel cuts into stages, applied from outside (starter/strategies)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Sequential):
    def __init__(self, in_shape: list[int], num_classes: int, width: int = 256, depth: int = 2, dropout: float = 0.0):
        layers: list[nn.Module] = [nn.Flatten()]
        features = math.prod(in_shape)
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU(), *([nn.Dropout(dropout)] if dropout > 0 else [])]
            features = width
        super().__init__(*layers, nn.Linear(features, num_classes))


class CNN(nn.Sequential):
    def __init__(self, in_channels: int, num_classes: int, width: int = 32):
        super().__init__(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(4),
            nn.Flatten(),
            nn.Linear(2 * width * 16, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )


class PatchEmbedding(nn.Module):
    def __init__(self, in_channels: int, image_size: int, patch_size: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image_size // patch_size) ** 2 + 1, dim) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.proj(images).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1) + self.pos_embed


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        # heads from the width (-1): the same code runs on a tensor-parallel rank that holds only some of them
        q, k, v = (f(x).view(n, length, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, length, -1))


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLPBlock(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ClassifierHead(nn.Module):
    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x[:, 0]))


class ViT(nn.Sequential):
    """Patch embedding, `depth` pre-norm transformer blocks, a head on the class token."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, patch_size: int = 4, dim: int = 96,
                 depth: int = 3, heads: int = 4, mlp_ratio: float = 2.0):  # fmt: skip
        super().__init__(
            PatchEmbedding(in_channels, image_size, patch_size, dim),
            *(Block(dim, heads, mlp_ratio) for _ in range(depth)),
            ClassifierHead(dim, num_classes),
        )
