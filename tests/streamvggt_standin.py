"""A tiny stand-in for StreamVGGT's module tree (https://github.com/wzzheng/StreamVGGT), for CPU
tests without the ``streamvggt`` package; built on the vggt stand-in (tests/vggt_standin.py).

It keeps what the adapter relies on and what makes streaming differ from batch:

* ``Attention.forward(x, pos=None, attn_mask=None, past_key_values=None, use_cache=False)``: with
  ``use_cache`` the *pre-norm* k and v of this call are appended to ``past_key_values`` (a tuple of
  [B, H, entries, n, D] tensors, concatenated anew each call), then q/k norm and RoPE (the positions
  repeated per entry) run over the whole cache, and the call returns ``(x, (k, v))``;
* ``Block.forward`` passing ``attn_mask`` / ``past_key_values`` / ``use_cache`` through;
* ``Aggregator.forward(images, past_key_values=None, use_cache=False, past_frame_idx=0)``: in batch
  mode the global blocks get an additive [S·P, S·P] frame-causal mask (finfo.min above the frame
  diagonal); streaming takes one frame, its camera/register tokens chosen by the frame's index
  (counted from the cache), and returns the updated caches;
* a camera head whose trunk attends causally over frames: in batch mode with an [S, S] mask, in
  streaming with its own caches, appended at every refinement iteration.

The adapter serves these classes after
``elsa_vision.adapters.streamvggt.register_classes(**CLASSES)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import vggt_standin as V


class Attention(V.Attention):
    def forward(self, x, pos=None, attn_mask=None, past_key_values=None, use_cache=False):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        pos_k = pos
        if use_cache:
            k, v = k.unsqueeze(2), v.unsqueeze(2)
            if past_key_values is not None:
                k = torch.cat([past_key_values[0], k], dim=2)
                v = torch.cat([past_key_values[1], v], dim=2)
            new_kv = (k, v)
            b, h, e, n, d = k.shape
            k, v = k.reshape(b, h, e * n, d), v.reshape(b, h, e * n, d)
            if pos_k is not None:
                pos_k = pos_k.repeat(1, e, 1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, pos), self.rope(k, pos_k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            if attn_mask is not None:
                attn = attn + attn_mask
            x = self.attn_drop(attn.softmax(dim=-1)) @ v
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
        return (x, new_kv) if use_cache else x


class Block(V.Block):
    def __init__(self, *args, **kw):
        super().__init__(*args, attn_class=Attention, **kw)

    def forward(self, x, pos=None, attn_mask=None, past_key_values=None, use_cache=False):
        if use_cache:
            y, new_kv = self.attn(self.norm1(x), pos=pos, past_key_values=past_key_values, use_cache=True)
        else:
            y, new_kv = self.attn(self.norm1(x), pos=pos, attn_mask=attn_mask), None
        x = x + self.ls1(y)
        x = x + self.ls2(self.mlp(self.norm2(x)))
        return (x, new_kv) if use_cache else x


def frame_mask(L, frame_len, dtype, device):
    frame = torch.arange(L, device=device) // frame_len
    return (frame[:, None] < frame[None, :]).to(dtype) * torch.finfo(dtype).min


class Aggregator(V.Aggregator):
    def __init__(self, patch_size=14, embed_dim=64, depth=4, num_heads=2, **kw):
        super().__init__(patch_size, embed_dim, depth, num_heads, **kw)
        make = lambda: Block(embed_dim, num_heads, qk_norm=True, init_values=0.01, rope=self.rope)  # noqa: E731
        self.frame_blocks = nn.ModuleList([make() for _ in range(depth)])
        self.global_blocks = nn.ModuleList([make() for _ in range(depth)])

    def forward(self, images, past_key_values=None, use_cache=False, past_frame_idx=0):
        B, S, C_in, H, W = images.shape
        S_true = past_key_values[0][0].shape[2] + 1 if use_cache and past_key_values[0] is not None else S
        images = (images - self._resnet_mean) / self._resnet_std
        patch_tokens = self.patch_embed(images.reshape(B * S, C_in, H, W))["x_norm_patchtokens"]
        camera = V.slice_expand_and_flatten(self.camera_token, B, S_true)
        register = V.slice_expand_and_flatten(self.register_token, B, S_true)
        if use_cache:
            camera, register = camera[-1:], register[-1:]
        tokens = torch.cat([camera, register, patch_tokens], dim=1)
        pos = self.position_getter(B * S, H // self.patch_size, W // self.patch_size, device=images.device) + 1
        pos = torch.cat([torch.zeros(B * S, self.patch_start_idx, 2, device=images.device, dtype=pos.dtype), pos], 1)
        _, P, C = tokens.shape
        frame_idx = global_idx = 0
        output_list = []
        for _ in range(self.aa_block_num):
            for attn_type in self.aa_order:
                if attn_type == "frame":
                    tokens, frame_idx, frame_inter = self._process_frame_attention(tokens, B, S, P, C, frame_idx,
                                                                                   pos=pos)
                elif use_cache:
                    tokens, global_idx, global_inter, new_kv = self._process_global_attention(
                        tokens, B, S, P, C, global_idx, pos=pos, past_key_values_block=past_key_values[global_idx],
                        use_cache=True, past_frame_idx=past_frame_idx)
                    past_key_values[global_idx - 1] = new_kv
                else:
                    tokens, global_idx, global_inter = self._process_global_attention(tokens, B, S, P, C, global_idx,
                                                                                      pos=pos)
            for f, g in zip(frame_inter, global_inter):
                output_list.append(torch.cat([f, g], dim=-1))
        if use_cache:
            return output_list, self.patch_start_idx, past_key_values
        return output_list, self.patch_start_idx

    def _process_global_attention(self, tokens, B, S, P, C, global_idx, pos=None, past_key_values_block=None,
                                  use_cache=False, past_frame_idx=0):
        if tokens.shape != (B, S * P, C):
            tokens = tokens.reshape(B, S, P, C).reshape(B, S * P, C)
        if pos is not None and pos.shape != (B, S * P, 2):
            pos = pos.reshape(B, S, P, 2).reshape(B, S * P, 2)
        intermediates = []
        for _ in range(self.aa_block_size):
            if use_cache:
                tokens, block_kv = self.global_blocks[global_idx](tokens, pos=pos, past_key_values=past_key_values_block,
                                                                  use_cache=True)
            else:
                mask = frame_mask(S * P, P, tokens.dtype, tokens.device)
                tokens = self.global_blocks[global_idx](tokens, pos=pos, attn_mask=mask)
            global_idx += 1
            intermediates.append(tokens.reshape(B, S, P, C))
        if use_cache:
            return tokens, global_idx, intermediates, block_kv
        return tokens, global_idx, intermediates


class CameraHead(V.CameraHead):
    def __init__(self, dim_in=128, trunk_depth=1, num_heads=1, target_dim=9):
        super().__init__(dim_in, trunk_depth, num_heads, target_dim)
        self.trunk = nn.Sequential(*[Block(dim_in, num_heads, init_values=0.01) for _ in range(trunk_depth)])

    def forward(self, aggregated_tokens_list, num_iterations=2, past_key_values_camera=None, use_cache=False):
        pose_tokens = self.token_norm(aggregated_tokens_list[-1][:, :, 0])
        B, S, _ = pose_tokens.shape
        pred, preds = None, []
        for _ in range(num_iterations):
            x = pose_tokens + self.embed_pose(self.empty_pose_tokens.expand(B, S, -1) if pred is None else pred.detach())
            mask = None if use_cache else frame_mask(S, 1, x.dtype, x.device)
            for i, block in enumerate(self.trunk):
                if use_cache:
                    x, past_key_values_camera[i] = block(x, past_key_values=past_key_values_camera[i], use_cache=True)
                else:
                    x = block(x, attn_mask=mask)
            delta = self.pose_branch(self.trunk_norm(x))
            pred = delta if pred is None else pred + delta
            preds.append(pred)
        return (preds, past_key_values_camera) if use_cache else preds


class StreamVGGT(nn.Module):
    """forward(images [B, S, 3, H, W]) → batch predictions; inference(images) → the same frame by frame."""

    def __init__(self, patch_size=14, embed_dim=64, depth=4, num_heads=2):
        super().__init__()
        self.aggregator = Aggregator(patch_size, embed_dim, depth, num_heads)
        self.camera_head = CameraHead(2 * embed_dim)

    def forward(self, images):
        tokens, _ = self.aggregator(images)
        return {"tokens": torch.stack(tokens), "pose_enc": self.camera_head(tokens)[-1]}

    def inference(self, images):
        past = [None] * self.aggregator.depth
        past_camera = [None] * len(self.camera_head.trunk)
        outs = []
        for i in range(images.shape[1]):
            tokens, _, past = self.aggregator(images[:, i:i + 1], past_key_values=past, use_cache=True,
                                              past_frame_idx=i)
            poses, past_camera = self.camera_head(tokens, past_key_values_camera=past_camera, use_cache=True)
            outs.append({"tokens": torch.stack(tokens), "pose_enc": poses[-1]})
        return {"tokens": torch.cat([o["tokens"] for o in outs], dim=2),
                "pose_enc": torch.cat([o["pose_enc"] for o in outs], dim=1), "caches": (past, past_camera)}


CLASSES = dict(attention=[Attention, V.MemEffAttention], aggregator=[Aggregator])
