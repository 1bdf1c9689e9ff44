"""What the Triton kernel families accept, declared without importing Triton: the dispatcher's
capability table reads these, so a call is refused (or sent to another backend) with its reason
before any kernel module is loaded, and a machine without Triton can still say why."""
import torch

HEAD_DIMS = (16, 256)          # attention: head dims padded to a power of two inside the tile
WINDOW_HEAD_DIMS = (16, 128)   # window attention: its per-window tiles hold q, k, v of a whole window
MAX_WINDOW_TOKENS = 256        # window attention: tokens per window
WINDOW_BLOCKS = (64, 128, 256)  # window attention: the key tiles a call may ask for
RESIDUAL_MAX_WIDTH = 16384     # residual passes: the widest row one program holds in registers
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # residual passes: tensor dtypes
POSITION_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # Swin position biases: tables, MLP
ROPE_MIN_HEAD_DIM = 16         # q/k norm + RoPE: a head is two [tokens, 2, D/4] tiles, checked on GPUs from 16
HOPPER_HEAD_DIMS = (64, 128)   # Hopper (Gluon) attention, bf16 / fp16: the head dims it has tiles for
HOPPER_SPLIT_HEAD_DIMS = (64,)  # Hopper attention, float32 in fp16x3: where its float16 parts fit shared memory
MAX_GRID_YZ = 65535            # CUDA's limit on a launch grid's 2nd and 3rd axes (attention puts batch·heads on the 2nd)
