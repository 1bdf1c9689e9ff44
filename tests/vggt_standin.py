"""A tiny stand-in for vggt's module tree (https://github.com/facebookresearch/vggt), for CPU tests
without the ``vggt`` package.

It keeps what the ELSA adapter relies on: the class names, attribute names and forward semantics of
``Attention`` / ``MemEffAttention`` (qkv → q/k LayerNorm → shared 2-D RoPE → SDPA → proj), ``Block``,
the DINOv2-style patch embedding (class + 4 register tokens, MemEffAttention blocks), the
``Aggregator`` (5 special tokens per frame, frame / global alternation, per-layer outputs
concatenated to 2C, blocks checkpointed in training), a camera head whose trunk attends over
frames (head dim 128 with the default sizes here) and DPT-style heads (``forward`` / ``_forward_impl`` as in vggt) that read chosen
aggregator layers, processing frames in chunks.
Sizes are small so that the Triton interpreter runs it in seconds.

The adapter serves these classes after ``elsa_vision.adapters.vggt.register_classes(**CLASSES)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class RotaryPositionEmbedding2D(nn.Module):
    """vggt.layers.rope: half the features rotate with the y position, half with x."""

    def __init__(self, frequency: float = 100.0):
        super().__init__()
        self.base_frequency = frequency

    def _compute_frequency_components(self, dim, n, device, dtype):
        inv_freq = 1.0 / (self.base_frequency ** (torch.arange(0, dim, 2, device=device).float() / dim))
        angles = torch.einsum("i,j->ij", torch.arange(n, device=device, dtype=inv_freq.dtype), inv_freq).to(dtype)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def _rotate_features(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def _apply_1d_rope(self, x, positions, cos, sin):
        cos = F.embedding(positions, cos)[:, None]
        sin = F.embedding(positions, sin)[:, None]
        return x * cos + self._rotate_features(x) * sin

    def forward(self, tokens, positions):
        dim = tokens.size(-1) // 2
        cos, sin = self._compute_frequency_components(dim, int(positions.max()) + 1, tokens.device, tokens.dtype)
        vert, horiz = tokens.chunk(2, dim=-1)
        return torch.cat((self._apply_1d_rope(vert, positions[..., 0], cos, sin),
                          self._apply_1d_rope(horiz, positions[..., 1], cos, sin)), dim=-1)


class PositionGetter:
    def __call__(self, batch_size, height, width, device):
        pos = torch.cartesian_prod(torch.arange(height, device=device), torch.arange(width, device=device))
        return pos.view(1, height * width, 2).expand(batch_size, -1, -1).clone()


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, proj_bias=True, attn_drop=0.0, proj_drop=0.0,
                 norm_layer=nn.LayerNorm, qk_norm=False, fused_attn=True, rope=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        self.rope = rope

    def forward(self, x, pos=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q = self.rope(q, pos)
            k = self.rope(k, pos)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            x = self.attn_drop(attn) @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class MemEffAttention(Attention):
    def forward(self, x, attn_bias=None, pos=None):
        assert pos is None
        if attn_bias is not None:
            raise AssertionError("xFormers is required for using nested tensors")
        return super().forward(x)


class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features or in_features, bias=bias)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features or in_features, out_features or in_features, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qk_norm=False, init_values=None, rope=None,
                 attn_class=Attention, attn_drop=0.0, fused_attn=True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn_class(dim, num_heads=num_heads, attn_drop=attn_drop, qk_norm=qk_norm, rope=rope,
                               fused_attn=fused_attn)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x, pos=None):
        x = x + self.ls1(self.attn(self.norm1(x), pos=pos))
        return x + self.ls2(self.mlp(self.norm2(x)))


class NestedTensorBlock(Block):
    """DINOv2's block: MemEffAttention, called without positions."""

    def forward(self, x_or_x_list):
        if isinstance(x_or_x_list, torch.Tensor):
            return super().forward(x_or_x_list)
        raise AssertionError("xFormers is required for using nested tensors")   # (as vggt's without xFormers)


class DinoVisionTransformer(nn.Module):
    """DINOv2-with-registers patch embedding: class token, 4 register tokens, MemEffAttention blocks."""

    def __init__(self, patch_size=14, embed_dim=64, depth=1, num_heads=2, num_register_tokens=4):
        super().__init__()
        self.patch_size = patch_size
        self.num_register_tokens = num_register_tokens
        self.patch_embed = nn.Conv2d(3, embed_dim, patch_size, patch_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        self.register_tokens = nn.Parameter(torch.randn(1, num_register_tokens, embed_dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, embed_dim, 4, 4) * 0.02)
        self.blocks = nn.ModuleList([NestedTensorBlock(embed_dim, num_heads, init_values=1.0,
                                                       attn_class=MemEffAttention) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, images):
        x = self.patch_embed(images)
        x = x + F.interpolate(self.pos_embed, size=x.shape[-2:], mode="bilinear", align_corners=False)
        x = x.flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1),
                       self.register_tokens.expand(x.shape[0], -1, -1), x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return {"x_norm_clstoken": x[:, 0], "x_norm_patchtokens": x[:, 1 + self.num_register_tokens:]}


def slice_expand_and_flatten(token_tensor, B, S):
    query = token_tensor[:, 0:1, ...].expand(B, 1, *token_tensor.shape[2:])
    others = token_tensor[:, 1:, ...].expand(B, S - 1, *token_tensor.shape[2:])
    combined = torch.cat([query, others], dim=1)
    return combined.view(B * S, *combined.shape[2:])


class Aggregator(nn.Module):
    """vggt.models.aggregator.Aggregator: alternating frame / global attention over 5 + h·w tokens per frame."""

    def __init__(self, patch_size=14, embed_dim=64, depth=4, num_heads=2, num_register_tokens=4,
                 aa_order=("frame", "global"), aa_block_size=1, rope_freq=100, init_values=0.01):
        super().__init__()
        self.patch_embed = DinoVisionTransformer(patch_size, embed_dim, num_heads=num_heads)
        self.rope = RotaryPositionEmbedding2D(frequency=rope_freq)
        self.position_getter = PositionGetter()
        make = lambda: Block(embed_dim, num_heads, qk_norm=True, init_values=init_values, rope=self.rope)  # noqa: E731
        self.frame_blocks = nn.ModuleList([make() for _ in range(depth)])
        self.global_blocks = nn.ModuleList([make() for _ in range(depth)])
        self.depth = depth
        self.aa_order = list(aa_order)
        self.patch_size = patch_size
        self.aa_block_size = aa_block_size
        self.aa_block_num = depth // aa_block_size
        self.camera_token = nn.Parameter(torch.randn(1, 2, 1, embed_dim))
        self.register_token = nn.Parameter(torch.randn(1, 2, num_register_tokens, embed_dim))
        self.patch_start_idx = 1 + num_register_tokens
        for name, value in (("_resnet_mean", [0.485, 0.456, 0.406]), ("_resnet_std", [0.229, 0.224, 0.225])):
            self.register_buffer(name, torch.tensor(value).view(1, 1, 3, 1, 1), persistent=False)

    def forward(self, images):
        B, S, C_in, H, W = images.shape
        images = (images - self._resnet_mean) / self._resnet_std
        patch_tokens = self.patch_embed(images.view(B * S, C_in, H, W))["x_norm_patchtokens"]
        camera_token = slice_expand_and_flatten(self.camera_token, B, S)
        register_token = slice_expand_and_flatten(self.register_token, B, S)
        tokens = torch.cat([camera_token, register_token, patch_tokens], dim=1)
        pos = self.position_getter(B * S, H // self.patch_size, W // self.patch_size, device=images.device) + 1
        pos_special = torch.zeros(B * S, self.patch_start_idx, 2, device=images.device, dtype=pos.dtype)
        pos = torch.cat([pos_special, pos], dim=1)
        _, P, C = tokens.shape
        frame_idx = global_idx = 0
        output_list = []
        for _ in range(self.aa_block_num):
            for attn_type in self.aa_order:
                if attn_type == "frame":
                    tokens, frame_idx, frame_intermediates = self._process_frame_attention(
                        tokens, B, S, P, C, frame_idx, pos=pos)
                else:
                    tokens, global_idx, global_intermediates = self._process_global_attention(
                        tokens, B, S, P, C, global_idx, pos=pos)
            for i in range(len(frame_intermediates)):
                output_list.append(torch.cat([frame_intermediates[i], global_intermediates[i]], dim=-1))
        return output_list, self.patch_start_idx

    def _run(self, block, tokens, pos):
        """As vggt: in training, blocks are checkpointed (recomputed in the backward)."""
        if self.training:
            return checkpoint(block, tokens, pos, use_reentrant=False)
        return block(tokens, pos=pos)

    def _process_frame_attention(self, tokens, B, S, P, C, frame_idx, pos=None):
        if tokens.shape != (B * S, P, C):
            tokens = tokens.view(B, S, P, C).view(B * S, P, C)
        if pos is not None and pos.shape != (B * S, P, 2):
            pos = pos.view(B, S, P, 2).view(B * S, P, 2)
        intermediates = []
        for _ in range(self.aa_block_size):
            tokens = self._run(self.frame_blocks[frame_idx], tokens, pos)
            frame_idx += 1
            intermediates.append(tokens.view(B, S, P, C))
        return tokens, frame_idx, intermediates

    def _process_global_attention(self, tokens, B, S, P, C, global_idx, pos=None):
        if tokens.shape != (B, S * P, C):
            tokens = tokens.view(B, S, P, C).view(B, S * P, C)
        if pos is not None and pos.shape != (B, S * P, 2):
            pos = pos.view(B, S, P, 2).view(B, S * P, 2)
        intermediates = []
        for _ in range(self.aa_block_size):
            tokens = self._run(self.global_blocks[global_idx], tokens, pos)
            global_idx += 1
            intermediates.append(tokens.view(B, S, P, C))
        return tokens, global_idx, intermediates


class CameraHead(nn.Module):
    """Camera tokens of the last layer → a trunk of Blocks attending over frames, refined iteratively."""

    def __init__(self, dim_in=128, trunk_depth=1, num_heads=1, target_dim=9):
        super().__init__()
        self.trunk = nn.Sequential(*[Block(dim_in, num_heads, init_values=0.01) for _ in range(trunk_depth)])
        self.token_norm = nn.LayerNorm(dim_in)
        self.trunk_norm = nn.LayerNorm(dim_in)
        self.empty_pose_tokens = nn.Parameter(torch.zeros(1, 1, target_dim))
        self.embed_pose = nn.Linear(target_dim, dim_in)
        self.pose_branch = nn.Linear(dim_in, target_dim)

    def forward(self, aggregated_tokens_list, num_iterations=2):
        pose_tokens = self.token_norm(aggregated_tokens_list[-1][:, :, 0])
        B, S, _ = pose_tokens.shape
        pred, preds = None, []
        for _ in range(num_iterations):
            inp = self.embed_pose(self.empty_pose_tokens.expand(B, S, -1) if pred is None else pred.detach())
            delta = self.pose_branch(self.trunk_norm(self.trunk(pose_tokens + inp)))
            pred = delta if pred is None else pred + delta
            preds.append(pred)
        return preds


class DPTHead(nn.Module):
    """Patch tokens of ``intermediate_layer_idx`` layers → per-pixel prediction and confidence."""

    def __init__(self, dim_in=128, patch_size=14, output_dim=2, intermediate_layer_idx=(1, 3)):
        super().__init__()
        self.patch_size = patch_size
        self.intermediate_layer_idx = list(intermediate_layer_idx)
        self.norm = nn.LayerNorm(dim_in)
        self.projects = nn.ModuleList([nn.Linear(dim_in, output_dim) for _ in self.intermediate_layer_idx])

    def forward(self, aggregated_tokens_list, images, patch_start_idx, frames_chunk_size=2):
        S = images.shape[1]
        if frames_chunk_size is None or frames_chunk_size >= S:
            return self._forward_impl(aggregated_tokens_list, images, patch_start_idx)
        preds, confs = [], []
        for f0 in range(0, S, frames_chunk_size):
            p, c = self._forward_impl(aggregated_tokens_list, images, patch_start_idx, f0,
                                      min(S, f0 + frames_chunk_size))
            preds.append(p)
            confs.append(c)
        return torch.cat(preds, dim=1), torch.cat(confs, dim=1)

    def _forward_impl(self, aggregated_tokens_list, images, patch_start_idx, frames_start_idx=None,
                      frames_end_idx=None):
        if frames_start_idx is not None:
            images = images[:, frames_start_idx:frames_end_idx]
        B, S, _, H, W = images.shape
        out = 0
        for proj, layer in zip(self.projects, self.intermediate_layer_idx):
            x = aggregated_tokens_list[layer][:, :, patch_start_idx:]
            if frames_start_idx is not None:
                x = x[:, frames_start_idx:frames_end_idx]
            out = out + proj(self.norm(x))
        out = out.reshape(B * S, H // self.patch_size, W // self.patch_size, -1).permute(0, 3, 1, 2)
        out = F.interpolate(out, size=(H, W), mode="bilinear", align_corners=True)
        out = out.permute(0, 2, 3, 1).reshape(B, S, H, W, -1)
        return torch.exp(out[..., :-1]), 1 + torch.exp(out[..., -1])


class VGGT(nn.Module):
    def __init__(self, patch_size=14, embed_dim=64, depth=4, num_heads=2, head_layers=(1, 3)):
        super().__init__()
        self.aggregator = Aggregator(patch_size, embed_dim, depth, num_heads)
        self.camera_head = CameraHead(2 * embed_dim)
        self.point_head = DPTHead(2 * embed_dim, patch_size, output_dim=4, intermediate_layer_idx=head_layers)
        self.depth_head = DPTHead(2 * embed_dim, patch_size, output_dim=2, intermediate_layer_idx=head_layers)

    def forward(self, images):
        if images.dim() == 4:
            images = images.unsqueeze(0)
        tokens, patch_start_idx = self.aggregator(images)
        preds = {"pose_enc": self.camera_head(tokens)[-1]}
        preds["depth"], preds["depth_conf"] = self.depth_head(tokens, images=images, patch_start_idx=patch_start_idx)
        preds["world_points"], preds["world_points_conf"] = self.point_head(
            tokens, images=images, patch_start_idx=patch_start_idx)
        return preds


CLASSES = dict(attention=[Attention, MemEffAttention], aggregator=[Aggregator], block=[Block, NestedTensorBlock], dpt_head=[DPTHead],
               camera_head=[CameraHead])
