import torch
import torch.nn.functional as F
from torch import nn

from starter.errors import UserError


class PatchEmbedding(nn.Module):
    """Image -> sequence: non-overlapping patches projected to `dim`, a class token in front, learned positions."""

    def __init__(self, in_channels: int, image_size: int, patch_size: int, dim: int):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch_size}")
        self.image_size = image_size
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image_size // patch_size) ** 2 + 1, dim) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-2:] != (self.image_size, self.image_size):  # shapes are known on the host: no sync
            size = f"{self.image_size}x{self.image_size}"
            raise UserError(
                f"the net takes {size} images only (its position embedding: model.net.image_size) but was"
                f" given {images.shape[-2]}x{images.shape[-1]}; crop the data to {size}"
                " (data.train_crop_size, data.val_crop_size), or change data.image_shape"
            )
        tokens = self.proj(images).flatten(2).transpose(1, 2)  # (N, patches, dim)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        return tokens + self.pos_embed


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} does not split into {heads} heads")
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        # heads inferred from the width (-1): the same code runs on a rank that holds only some of the heads
        q, k, v = (f(x).view(n, length, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)  # (N, heads, length, head_dim)
        return self.proj(out.transpose(1, 2).reshape(n, length, -1))


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

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
        return self.fc(self.norm(x[:, 0]))  # the class token


class ViT(nn.Sequential):
    """Vision Transformer (Dosovitskiy et al. 2020) as a sequence: patch embedding, `depth` blocks, a head on the
    class token. Plain torch: tensor and pipeline parallelism are applied from outside (strategies/)."""

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        patch_size: int = 16,
        dim: int = 384,
        depth: int = 12,
        heads: int = 6,
        mlp_ratio: float = 4.0,
    ):
        super().__init__(
            PatchEmbedding(in_channels, image_size, patch_size, dim),
            *(Block(dim, heads, mlp_ratio) for _ in range(depth)),
            ClassifierHead(dim, num_classes),
        )
